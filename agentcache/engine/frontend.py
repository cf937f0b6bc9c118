"""What every engine knows of its model besides running it: text, control tokens, KV shape, RoPE.

Both engines (embedded and vLLM) load the model's HF config and tokenizer the same way, so they
tokenize identically, re-align keys with the same rotary frequencies and refuse the same bad
requests. `ModelFrontend` is that shared half: an engine subclasses it, sets it up with
`_init_frontend` and adds `submit`, or (vLLM's core, which runs the model elsewhere) builds one
with `ModelFrontend.for_model`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from agentcache.engine.grammar import Grammars, OutputConstraint
from agentcache.engine.kv import KVLayout, SegmentKV, all_finite
from agentcache.engine.protocol import ExecRequest, Step, TokenRecompute
from agentcache.engine.rope import RopeAligner
from agentcache.engine.tokens import LiteralTokenizer
from agentcache.errors import (
    ContextLengthError,
    InputError,
    KVShapeError,
    ModelLoadError,
    PlanError,
    RopeAlignmentError,
    SegmentError,
)
from agentcache.models import LoadedModel

__all__ = ["ModelFrontend", "layout_of"]


def layout_of(model: torch.nn.Module, first_token: int | None = None) -> KVLayout:
    """Probe one token (`first_token`, the BOS a prompt starts with, else id 0) through the model
    and read the KV shape of every layer; a model whose KV overflows its dtype is refused."""
    from transformers import DynamicCache

    config = model.config
    probe = DynamicCache()
    token = 0 if first_token is None else first_token
    with torch.inference_mode():
        out = model(input_ids=torch.full((1, 1), token, dtype=torch.long, device=model.device), past_key_values=probe,
                    use_cache=True)
    if not all_finite(out.logits, *(t for layer in probe.layers for t in (layer.keys, layer.values))):
        dtype = next(model.parameters()).dtype
        raise ModelLoadError(
            f"model type '{config.model_type}' computes NaN or Inf in {dtype} (its activations overflow this "
            "dtype, as Gemma 3's do in float16): run it in bfloat16 or float32"
        )
    shapes = {tuple(layer.keys.shape[1::2]) for layer in probe.layers}  # {(H, D)}
    if len(shapes) != 1:
        raise ModelLoadError(
            f"model type '{config.model_type}' has layers with different KV shapes {sorted(shapes)}; "
            "agentcache's engines support uniform KV layouts"
        )
    (heads, dim), = shapes
    keys = probe.layers[0].keys
    return KVLayout(num_layers=len(probe.layers), num_kv_heads=heads, head_dim=dim, dtype=keys.dtype,
                    device=keys.device)


class ModelFrontend:
    """Tokenizer, vocabulary, context length, KV layout and RoPE aligner of one loaded model."""

    model_name: str
    layout: KVLayout
    max_context: int
    bos_token_id: int | None
    eos_token_id: int | None
    vocab_size: int

    @classmethod
    def for_model(cls, loaded: LoadedModel, model: torch.nn.Module) -> "ModelFrontend":
        """The frontend of `loaded`, its KV layout and RoPE probed through `model` (its weights as run)."""
        frontend = cls()
        frontend._init_frontend(loaded, model)
        return frontend

    def _init_frontend(self, loaded: LoadedModel, model: torch.nn.Module) -> None:
        self.model_name = loaded.name
        self.model_key = loaded.instance_id.encode()  # KV digests name the weights that computed them
        self.tokenizer = loaded.tokenizer
        self._literal = LiteralTokenizer(loaded.tokenizer)
        self.requires_bos = loaded.requires_bos
        self.max_context = loaded.max_context
        self.vocab_size = int(model.config.vocab_size)
        self.bos_token_id = self.tokenizer.bos_token_id
        eos = model.config.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.eos_token_id = min(self.eos_token_ids) if self.eos_token_ids else None
        self.layout = layout_of(model, self.bos_token_id if loaded.requires_bos else None)
        self.hidden_size = int(getattr(model.config, "get_text_config", lambda: model.config)().hidden_size)
        try:
            self._rope: RopeAligner | None = RopeAligner.from_model(model)
            self._rope_error: RopeAlignmentError | None = None
        except RopeAlignmentError as exc:
            self._rope, self._rope_error = None, exc

    # --- text ------------------------------------------------------------------------------

    def tokenize(self, text: str, *, bos: bool = False) -> list[int]:
        """Literal token ids of `text` (text spelling a control token stays text); `bos=True` puts
        the BOS token first."""
        if not isinstance(text, str):
            raise InputError(f"tokenize takes a str, got {type(text).__name__}")
        ids = self._literal.encode(text)
        if bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def control_token_id(self, spelling: str) -> int | None:
        return self._literal.control_id(spelling)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The constraints compiled for this vocabulary (built on the first constrained request)."""
        return Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def constraint_ready(self, constraint: OutputConstraint) -> Future:
        """A future done once `constraint` is compiled off the caller's thread, within the size and
        time budgets (`Grammars.ready`), so `submit` finds it compiled; failed with an InputError."""
        return self.grammars.ready(constraint)

    # --- KV helpers -------------------------------------------------------------------------

    @property
    def supports_realignment(self) -> bool:
        return self._rope is not None

    @property
    def supports_recompute(self) -> bool:
        return False  # an engine that runs part of its decoder stack says so

    def realign(self, kv: SegmentKV, start: int) -> SegmentKV:
        """The same KV moved to positions start..; no longer exact once moved."""
        if start == kv.start:
            return kv
        if self._rope is None:
            raise self._rope_error
        return SegmentKV(self._rope.realign(kv.keys, kv.start, start), kv.values, start)

    # --- checking a request -----------------------------------------------------------------

    def _validate(self, request: ExecRequest, prompt: list[int]) -> None:
        total = len(prompt) + request.sampling.max_tokens
        if total > self.max_context:
            raise ContextLengthError(
                f"call needs {len(prompt)} prompt + {request.sampling.max_tokens} generated tokens = {total}, "
                f"more than {self.model_name}'s context of {self.max_context} tokens"
            )
        if self.requires_bos and prompt[0] != self.bos_token_id:
            raise PlanError(
                f"{self.model_name} needs its BOS token (id {self.bos_token_id}) first; the call starts with "
                f"id {prompt[0]}: tokenize the first segment with bos=True"
            )
        self._check_recompute(request)
        if request.sampling.constraint is not None:
            self.grammars.compile(request.sampling.constraint)  # a constraint that cannot compile fails here
        start = 0
        for seg in request.segments:
            self._check_ids(seg.token_ids, f"segment '{seg.name}'")
            if seg.step is Step.INJECT:
                kv = seg.kv
                kv.check(self.layout, len(seg.token_ids), f"segment '{seg.name}'")
                if not all_finite(kv.keys, kv.values):
                    raise KVShapeError(f"segment '{seg.name}': injected KV contains NaN or Inf")
                if kv.start != start and self._rope is None:
                    raise self._rope_error
            start += len(seg.token_ids)

    def _check_recompute(self, request: ExecRequest) -> None:
        """Selective recomputation and hidden states are asked only of an engine that has them, and fit the model."""
        recomputed = [seg for seg in request.segments if seg.recompute is not None]
        if not recomputed and request.hidden_layer is None:
            return
        if not self.supports_recompute:
            raise PlanError(f"{type(self).__name__} cannot recompute part of an injected segment or hand back hidden "
                            "states (CacheBlend, DroidSpeak): run those on the EmbeddedEngine")
        layers = self.layout.num_layers
        if request.hidden_layer is not None and request.hidden_layer >= layers:
            raise PlanError(f"hidden_layer {request.hidden_layer} is past {self.model_name}'s {layers} layers")
        for seg in recomputed:
            spec = seg.recompute
            if isinstance(spec, TokenRecompute):
                if spec.probe_layer >= layers:
                    raise PlanError(f"segment '{seg.name}': probe layer {spec.probe_layer} is past {layers} layers")
                continue
            if spec.last >= layers:
                raise PlanError(f"segment '{seg.name}': layers {spec.first}..{spec.last} are past {layers} layers")
            if spec.hidden.shape[1] != self.hidden_size:
                raise KVShapeError(f"segment '{seg.name}': LayerRecompute.hidden must have width {self.hidden_size}, "
                                   f"got {tuple(spec.hidden.shape)}")
            known = torch.isfinite(spec.hidden).all(-1)  # (T,): unknown rows may only lead (prefilled)
            if bool(known.any()) and not bool(known[int(known.float().argmax()):].all()):
                raise KVShapeError(f"segment '{seg.name}': LayerRecompute.hidden has NaN/Inf rows after known ones; "
                                   "only leading rows may be unknown")

    def _check_ids(self, token_ids: Sequence[int], what: str) -> None:
        bad = [t for t in token_ids if type(t) is not int or not 0 <= t < self.vocab_size]
        if bad:
            raise SegmentError(f"{what}: token ids {bad[:5]} are not ints in [0, {self.vocab_size})")
