"""Constrained decoding: what a request's output must match, and the token masks that enforce it.

An `OutputConstraint` rides in `SamplingParams`: a JSON schema, any JSON object, or an xgrammar
structural tag (a model's tool-call format with each tool's argument schema). The vLLM engine
hands it to vLLM's structured outputs; the embedded engine enforces it here, with xgrammar:

- JSON (a schema, or JSON mode's any object) is written compactly, without free whitespace, and
  tool-call arguments with at most `MAX_WHITESPACE` whitespace characters in a row: a model
  (above all a random-weight one) can otherwise fill its tokens with blank runs.
- `Grammars` compiles a constraint once per engine (cached by its text), against the engine's
  vocabulary, on worker threads of its own (`ready`; xgrammar releases the GIL), within a size
  budget (`MAX_CONSTRAINT_CHARS`) and a time budget (`COMPILE_BUDGET_S`): compiling can take
  seconds (a 10,000-value enum: 5 s), and on the runtime's planning thread it would stall every
  other call. A constraint xgrammar cannot compile, or not within the budgets, is an `InputError`
  naming why; one that ran out of time is remembered, so sending it again fails at once (until its
  compile, which cannot be stopped, has finished on its worker: then it is served).
- `GrammarState` is one request's matcher. Before a token is chosen, `mask_rows` sets the logits
  of every token the grammar forbids to -inf, row by row, for the constrained rows of a batch only
  (an unconstrained row is never touched); after, the chosen token advances the matcher.

Why xgrammar: vLLM's default structured-output backend, so both engines read one constraint the
same way (the same structural tags, the same JSON-schema dialect); its bitmask kernels run on CPU
tensors; and it ships the tool-call formats of the model families (`get_model_structural_tag`).
Once a grammar is complete it allows only the stop tokens, so a constrained request ends at EOS
by the engines' usual rule.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Collection, Literal, Sequence

import torch

from agentcache.errors import InputError

__all__ = ["MAX_WHITESPACE", "MAX_CONSTRAINT_CHARS", "COMPILE_BUDGET_S", "OutputConstraint", "Grammars", "GrammarState",
           "mask_rows", "schema_error", "text_grammar"]

ConstraintKind = Literal["json_schema", "json_object", "structural_tag"]
_KINDS = ("json_schema", "json_object", "structural_tag")
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[16:42:40] /project/cpp/x.cc:49: "
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # JSON mode: any one JSON object
MAX_WHITESPACE = 2  # runs of JSON whitespace a constrained output may hold (no endless blank runs)
# The budgets of one constraint. 128 KiB holds OpenAI's own schema limits (120,000 characters of names
# and enum values); the slowest such schema measured (a 7,000-value enum of random strings) compiles
# in about 2.5 s on one core of a 2-core CPU, so 10 s refuses only the pathological.
MAX_CONSTRAINT_CHARS = 128 * 1024
COMPILE_BUDGET_S = 10.0
COMPILE_THREADS = 2  # one slow compile leaves a thread for everyone else's


@functools.lru_cache(maxsize=256)  # agents send the same schemas with every call
def schema_error(schema_json: str) -> str | None:
    """Why xgrammar cannot follow the JSON schema `schema_json` (its message, less its source
    location, or the size budget it exceeds), or None. Converting a schema to a grammar takes milliseconds (a 10,000-value enum:
    8 ms); compiling it against a vocabulary, at submit, is the costly step. So a request's schemas
    (tools, forced or not, and response_format) are checked where the request is read, and a bad
    one is a 400 naming its field rather than a failure at submit."""
    from xgrammar import Grammar

    if len(schema_json) > MAX_CONSTRAINT_CHARS:
        return _too_long(len(schema_json))
    try:
        Grammar.from_json_schema(schema_json)
    except (RuntimeError, ValueError) as exc:
        return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip()) or type(exc).__name__
    return None


@dataclass(frozen=True)
class OutputConstraint:
    """What an output must match. `spec` is JSON text: the schema, or the structural tag; "" for
    `json_object` (any JSON object)."""

    kind: ConstraintKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InputError(f"OutputConstraint.kind must be one of {list(_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise InputError(f"OutputConstraint.spec must be JSON text, got {type(self.spec).__name__}")
        if self.kind != "json_object":
            try:
                json.loads(self.spec)
            except ValueError as exc:
                raise InputError(f"OutputConstraint({self.kind}): the spec is not valid JSON ({exc})") from None

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> "OutputConstraint":
        """Output one JSON value valid under `schema` (a dict or its JSON text)."""
        if isinstance(schema, dict):
            try:
                schema = json.dumps(schema)  # property order kept: it is the order the output follows
            except (TypeError, ValueError) as exc:
                raise InputError(f"the JSON schema cannot be written as JSON: {exc}") from None
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> "OutputConstraint":
        """Output any one JSON object (OpenAI's JSON mode)."""
        return cls("json_object")

    @classmethod
    def structural_tag(cls, tag: Any) -> "OutputConstraint":
        """Output matching an xgrammar structural tag (a `StructuralTag`, or its JSON)."""
        text = tag if isinstance(tag, str) else tag.model_dump_json()
        return cls("structural_tag", text)


COMPILED_KEPT = 256  # compiled constraints kept per engine, least recently used dropped first
_HEX = "[A-Fa-f0-9]"
_ANY_ESCAPE = f'("u" {_HEX} {_HEX} {_HEX} {_HEX})'  # xgrammar's JSON string escape: \ud800 included
_TEXT_ESCAPE = (f'(("u" [0-9A-Ca-cEFef] {_HEX} {_HEX} {_HEX}) | ("u" [Dd] [0-7] {_HEX} {_HEX})'
                f' | ("u" [Dd] [89ABab] {_HEX} {_HEX} "\\\\u" [Dd] [C-Fc-f] {_HEX} {_HEX}))')  # or a whole pair


@functools.lru_cache(maxsize=64)  # vLLM's requests ask for it each time: agents send the same schemas
def text_grammar(constraint: OutputConstraint) -> str:
    """`constraint` as xgrammar EBNF that both engines compile. It is xgrammar's own grammar (compact
    JSON, as vLLM's structured outputs write it with disable_any_whitespace), less one thing: a
    `\\u` escape of a UTF-16 surrogate is allowed only as a high-low pair. xgrammar allows a lone
    one (`\\udde8`), which decodes to no character, so the reply could not be sent as UTF-8 and
    strict JSON parsers (pydantic) refuse it."""
    from xgrammar import Grammar

    if constraint.kind == "structural_tag":
        grammar = Grammar.from_structural_tag(constraint.spec)
    else:
        schema = constraint.spec if constraint.kind == "json_schema" else JSON_OBJECT_SCHEMA
        grammar = Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    text = str(grammar).replace(_ANY_ESCAPE, _TEXT_ESCAPE)
    if f'"u" {_HEX}' in text:  # xgrammar wrote its escape another way: fail loudly, never allow lone surrogates
        raise RuntimeError("xgrammar's JSON string escape is not in the form this version of agentcache narrows")
    return text


def _too_long(chars: int) -> str:
    return f"it is {chars} characters as JSON, over the {MAX_CONSTRAINT_CHARS} a constraint may have"


class Grammars:
    """Compiled constraints of one engine's vocabulary. Thread-safe: `ready` compiles on a worker
    thread, `compile` on the calling one (a cache hit once `ready` is done), matchers run on the
    engine's thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int], *,
                 budget_s: float = COMPILE_BUDGET_S) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's vocabulary)
        self.budget_s = budget_s
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1)
        self._compiled: OrderedDict[OutputConstraint, Any] = OrderedDict()  # the newest COMPILED_KEPT
        self._refused: OrderedDict[OutputConstraint, str] = OrderedDict()  # over the time budget: why
        self._workers = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="agentcache-grammar")
        self._lock = threading.Lock()

    def ready(self, constraint: OutputConstraint) -> "Future[None]":
        """A future done once `constraint` is compiled on a worker thread (at once when it already
        is), failed with an InputError when it cannot be within the budgets."""
        done: Future = Future()
        with self._lock:
            known, refused = constraint in self._compiled, self._refused.get(constraint)
        if known or refused is not None or len(constraint.spec) > MAX_CONSTRAINT_CHARS:
            _settle(done, self._known_outcome(constraint))  # at once: no worker, no queue
            return done

        def compile_in_budget() -> None:  # on a worker: the budget counts from here, not from the queue
            timer = threading.Timer(self.budget_s, self._out_of_time, (constraint, done))
            timer.daemon = True
            timer.start()
            try:
                self.compile(constraint)
                _settle(done, None)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                _settle(done, exc)
            finally:
                timer.cancel()

        self._workers.submit(compile_in_budget)
        return done

    def _known_outcome(self, constraint: OutputConstraint) -> InputError | None:
        try:
            self.compile(constraint)  # a cache hit, or an InputError naming the budget at fault
        except InputError as exc:
            return exc
        return None

    def _out_of_time(self, constraint: OutputConstraint, done: Future) -> None:
        why = (f"the output constraint ({constraint.kind}) did not compile within its {self.budget_s:g} s budget: "
               "make it smaller (fewer enum values, properties or alternatives)")
        with self._lock:
            self._refused[constraint] = why
            while len(self._refused) > COMPILED_KEPT:
                self._refused.popitem(last=False)
        _settle(done, InputError(why))

    def compile(self, constraint: OutputConstraint) -> Any:
        """The compiled grammar of `constraint`, compiled on this thread if need be (see `ready`);
        an InputError naming the problem when it cannot be."""
        with self._lock:
            found = self._compiled.get(constraint)
            if found is not None:
                self._compiled.move_to_end(constraint)
                return found
            refused = self._refused.get(constraint)
        if refused is not None:
            raise InputError(refused)
        if len(constraint.spec) > MAX_CONSTRAINT_CHARS:
            raise InputError(f"the output constraint ({constraint.kind}) is not compiled: "
                             f"{_too_long(len(constraint.spec))}")
        try:
            compiled = self._compiler.compile_grammar(text_grammar(constraint))
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's compile errors derive from these
            raise InputError(f"the output constraint ({constraint.kind}) cannot be compiled: {_reason(exc)}") from None
        with self._lock:
            self._compiled[constraint] = compiled
            self._refused.pop(constraint, None)  # compiled at last (after its budget): served from now on
            while len(self._compiled) > COMPILED_KEPT:  # a caller sending a new schema per request stays bounded
                self._compiled.popitem(last=False)
        return compiled

    def start(self, constraint: OutputConstraint) -> "GrammarState":
        return GrammarState(self._xgr.GrammarMatcher(self.compile(constraint)), self)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, grammars: Grammars) -> None:
        self._matcher = matcher
        self._grammars = grammars

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Advance past the chosen token. A token the mask allowed is always accepted; a stop token
        after the grammar is complete ends it."""
        if not self._matcher.accept_token(token) and not self._matcher.is_terminated():
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")

    @property
    def complete(self) -> bool:
        return self._matcher.is_terminated()


def _settle(done: Future, error: BaseException | None) -> None:
    """`done` succeeds, or fails with `error`, unless it already has (the budget and the compile race)."""
    try:
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
    except InvalidStateError:
        pass


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    lines = str(exc).strip().splitlines()
    return _SOURCE_LOCATION.sub("", lines[0]) if lines else type(exc).__name__


def mask_rows(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
    """`logits` (n, V) with the tokens each constrained row's grammar forbids set to -inf, in place;
    rows whose state is None are left exactly as they are."""
    rows = [row for row, state in enumerate(states) if state is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    grammars = states[rows[0]]._grammars
    bitmask = xgr.allocate_token_bitmask(len(states), grammars.vocab_size)  # (n, ceil(V / 32)) int32
    for row in rows:
        states[row].fill(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=grammars.vocab_size, indices=rows)
    return logits
