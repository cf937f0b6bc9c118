"""Anchor pools on disk: one safetensors file per model and tenant, loaded into a later process.

A file holds every anchor of one tenant's pools, for the weights that computed their KV and for
the strategy settings that shaped them:

    <directory>/<model digest[:32]>/<tenant file name>.safetensors

The tenant file name is "default" for the default tenant (None), else a sha256 prefix of the
tenant: no tenant's text ever appears in a path. Tensors are stored under systematic names
(`anchor.<i>.keys.a`, `anchor.<i>.correction.<j>.glue_values.b`, ...); what they mean (format
version, model digest, strategy settings, tenant, and per anchor its slot, source agent, serial,
uses, length and consumers) is JSON in the header's `__metadata__`, under the key "agentcache".

Why safetensors: loading one executes no code (unlike pickle, which `torch.load` uses), so a
file from anywhere can at worst be refused. A load checks everything (version, model, strategy,
tenant, tensor names, shapes, finiteness) before it adds a single anchor: a refused file leaves
the bank as it was. A save replaces the file atomically: a failed save leaves the previous file.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Hashable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from agentcache.correction.anchors import Anchor, AnchorBank, Correction
from agentcache.correction.lowrank import Factors
from agentcache.correction.strategies import Strategy
from agentcache.errors import InputError

__all__ = ["FORMAT_VERSION", "STRATEGY_SETTINGS", "model_digest", "pools_path", "save_pools", "load_pools",
           "AnchorFiles"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
METADATA_KEY = "agentcache"
# The strategy settings that shape anchors: a pool learned under other settings is not loaded.
STRATEGY_SETTINGS = ("name", "chained", "base_rank", "delta_rank", "max_anchors", "kvcomm_procedure",
                     "temperature", "gate_scale", "accept")
SAMPLED_VALUES = 4096  # per parameter, evenly spaced, in the weight fingerprint
EDGE_BYTES = 1 << 20  # of a weight file: its first and last MiB are hashed
WEIGHT_FILES = ("*.safetensors", "*.gguf")

_fresh_ids = itertools.count()  # loaded anchors' source ids, unique in this process
_NO_TENANT = object()  # the "tenant" of a pool key not of the form (tenant, slot): equals no tenant


# --- which weights -------------------------------------------------------------------------


def model_digest(engine: Any) -> str:
    """A hex digest naming the weights that computed an engine's KV: the same in every process and
    for every copy of the same model, and cheap (a strided sample of each parameter, or the edges
    of each weight file). Raises InputError for an engine whose weights cannot be named."""
    h = hashlib.blake2b(digest_size=32)
    layout = engine.layout
    _feed(h, "agentcache-model", type(engine).__name__, str(engine.model_name), layout.num_layers,
          layout.num_kv_heads, layout.head_dim, str(layout.dtype), int(engine.vocab_size))
    loaded = getattr(engine, "loaded", None)
    module = getattr(loaded, "model", None)
    if isinstance(module, torch.nn.Module):
        _feed_parameters(h, module)
    elif getattr(engine, "model_directory", None) is not None:
        _feed_directory(h, Path(engine.model_directory))
    else:
        raise InputError(f"cannot persist anchors for engine {type(engine).__name__} "
                         f"({getattr(engine, 'model_name', '?')}): it exposes neither its loaded model "
                         f"(`.loaded.model`) nor its model directory (`.model_directory`), so the weights "
                         f"that computed its KV cannot be named")
    return h.hexdigest()


def _feed(h: "hashlib._Hash", *parts: Any) -> None:
    """Hash each part length-prefixed, so no two sequences of parts hash alike."""
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)


def _feed_parameters(h: "hashlib._Hash", module: torch.nn.Module) -> None:
    """Every parameter's name, shape, dtype and up to SAMPLED_VALUES evenly spaced values."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            flat = param.detach().reshape(-1)
            n, count = flat.numel(), min(SAMPLED_VALUES, flat.numel())
            # evenly spaced from first to last, in integers (float positions round off in large tensors)
            index = torch.arange(count, dtype=torch.int64, device=flat.device) * (n - 1) // max(count - 1, 1)
            sample = flat[index].cpu().contiguous()
            _feed(h, name, tuple(param.shape), str(param.dtype), sample.view(torch.uint8).numpy().tobytes())


def _feed_directory(h: "hashlib._Hash", directory: Path) -> None:
    """config.json, and each weight file's name, size and the sha256 of its first and last MiB."""
    config = directory / "config.json"
    _feed(h, config.read_bytes() if config.is_file() else b"<no config.json>")
    files = sorted({p for pattern in WEIGHT_FILES for p in directory.glob(pattern) if p.is_file()})
    if not files:
        raise InputError(f"cannot persist anchors: the model directory {directory} holds no weight files "
                         f"({', '.join(WEIGHT_FILES)})")
    for path in files:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(EDGE_BYTES)
            f.seek(max(0, size - EDGE_BYTES))
            tail = f.read(EDGE_BYTES)
        _feed(h, path.name, size, hashlib.sha256(head).digest(), hashlib.sha256(tail).digest())


# --- where ---------------------------------------------------------------------------------


def pools_path(directory: str | os.PathLike[str], model_digest: str, tenant: str | None) -> Path:
    """The file of `tenant`'s pools for the model `model_digest` under `directory`."""
    if not (isinstance(model_digest, str) and re.fullmatch(r"[0-9a-f]{32,}", model_digest)):
        raise InputError(f"model_digest must be a hex digest of at least 32 characters (from model_digest()), "
                         f"got {model_digest!r}")
    if tenant is not None and not isinstance(tenant, str):
        raise InputError(f"tenant must be a str or None, got {type(tenant).__name__}")
    if tenant is None:
        name = "default"
    else:
        name = "tenant-" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return Path(directory) / model_digest[:32] / f"{name}.safetensors"


def _settings(strategy: Strategy) -> dict:
    if not isinstance(strategy, Strategy):
        raise InputError(f"strategy must be a Strategy, got {type(strategy).__name__}")
    return json.loads(json.dumps({name: getattr(strategy, name) for name in STRATEGY_SETTINGS}))


# --- saving --------------------------------------------------------------------------------


def save_pools(bank: AnchorBank, directory: str | os.PathLike[str], *, model_digest: str, strategy: Strategy,
               tenant: str | None, edges: list[dict] | None = None) -> Path | None:
    """Write every anchor of `tenant`'s pools (keys `(tenant, slot)`) to its one file, atomically,
    with `edges` (the tenant's verification records, plain JSON) in its metadata; its path, or None
    when the tenant has neither (an existing file is then left as it is).
    Anchors that do not fit their own shapes or hold NaN/Inf are left out (logged). Call it with
    whatever lock guards `bank` held."""
    path = pools_path(directory, model_digest, tenant)
    settings = _settings(strategy)
    held = sorted(((key[1], a) for key, pool in list(bank.pools.items()) if _tenant_of(key) == tenant
                   for a in list(pool.anchors.values())), key=lambda item: item[1].serial)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # storages already taken
    records = []
    for slot, anchor in held:
        if not _sound(anchor):
            log.warning("not saving anchor %s of slot %r: its shapes are inconsistent or it holds NaN/Inf",
                        anchor.source_id, slot)
            continue
        records.append(_record(len(records), slot, anchor, tensors, seen))
    if not records and not edges:
        return None
    header = dict(format=FORMAT_VERSION, model_digest=model_digest, strategy=settings, tenant=tenant, anchors=records,
                  edges=list(edges or []))
    _write_atomically(path, tensors, {METADATA_KEY: json.dumps(header)})
    log.info("saved %d anchors (%d tensors) to %s", len(records), len(tensors), path)
    return path


def _tenant_of(key: Hashable) -> Any:
    """The tenant of a pool key `(tenant, slot)`; `_NO_TENANT` for a key of another form."""
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], str):
        return key[0]
    return _NO_TENANT


def _sound(anchor: Anchor) -> bool:
    """Consistent with its own shapes (L, T, F from its base keys), finite, with a correction."""
    try:
        keys = anchor.keys
        return bool(anchor.corrections) and anchor.fits(keys.num_layers, keys.features) and anchor.is_finite()
    except Exception:  # noqa: BLE001 - factors too corrupt to say
        return False


def _record(index: int, slot: str, anchor: Anchor, tensors: dict[str, torch.Tensor], seen: set[int]) -> dict:
    """One anchor's metadata; its tensors go into `tensors` under the names it records."""
    def put(name: str, factors: Factors | None) -> dict | None:
        if factors is None:
            return None
        names = {"a": f"{name}.a", "b": None if factors.b is None else f"{name}.b"}
        tensors[names["a"]] = _storable(factors.a, seen)
        if factors.b is not None:
            tensors[names["b"]] = _storable(factors.b, seen)
        return names

    prefix = f"anchor.{index}"
    corrections = []
    for j, (consumer, c) in enumerate(anchor.corrections.items()):
        at = f"{prefix}.correction.{j}"
        corrections.append(dict(consumer=consumer, glue_tokens=list(c.glue_tokens),
                                keys=put(f"{at}.keys", c.keys), values=put(f"{at}.values", c.values),
                                glue_keys=put(f"{at}.glue_keys", c.glue_keys),
                                glue_values=put(f"{at}.glue_values", c.glue_values)))
    return dict(slot=slot, source_id=anchor.source_id, source=anchor.source, serial=anchor.serial, uses=anchor.uses,
                length=anchor.length, keys=put(f"{prefix}.keys", anchor.keys),
                values=put(f"{prefix}.values", anchor.values), corrections=corrections)


def _storable(t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """A CPU tensor safetensors can write: contiguous, owning its whole storage, sharing it with no
    tensor already taken (`seen`: their storages' addresses). One Factors may serve as both keys
    and values, and safetensors refuses tensors that share memory: such a one is cloned."""
    t = t.detach().cpu()
    storage = t.untyped_storage()
    if (storage.data_ptr() in seen or not t.is_contiguous() or t.storage_offset() != 0
            or storage.nbytes() != t.numel() * t.element_size()):
        t = t.clone(memory_format=torch.contiguous_format)
    if t.numel():
        seen.add(t.untyped_storage().data_ptr())
    return t


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write to a temporary file beside `path`, fsync it, then rename it over `path`; on any failure
    the temporary file goes and `path` stays as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX; not possible everywhere)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# --- loading -------------------------------------------------------------------------------


def load_pools(bank: AnchorBank, directory: str | os.PathLike[str], *, model_digest: str, strategy: Strategy,
               tenant: str | None, layout: Any = None, device: torch.device | str = "cpu",
               edges: list | None = None) -> int:
    """Add the anchors of `tenant`'s file into `bank` (through `AnchorBank.add`: its capacity and
    byte budget hold) in their saved order, with their uses; the number of them the bank holds
    afterwards. No file: 0. Each gets a fresh source id ("persisted:<n>", which no SegmentStore id
    "<slot>#<serial>" can equal). Raises InputError, adding nothing, when the file is corrupt or
    was written for another format version, model, strategy setting or tenant, or (given the
    model's KV `layout`) its shapes do not fit the model. The file's verification records are
    appended to `edges` when it is given."""
    path = pools_path(directory, model_digest, tenant)
    settings = _settings(strategy)
    if not path.is_file():
        return 0
    header, tensors = _read(path)
    _check_header(path, header, model_digest, settings, tenant)
    records = header.get("anchors")
    if not isinstance(records, list):
        raise _refusal(path, "its metadata has no list of anchors")
    anchors = [_anchor(path, i, record, tensors, layout) for i, record in enumerate(records)]
    anchors.sort(key=lambda item: item[1].serial)
    saved_edges = header.get("edges", [])
    if not (isinstance(saved_edges, list) and all(isinstance(e, dict) for e in saved_edges)):
        raise _refusal(path, "its verification records are not a list of objects")
    loaded = []
    for slot, anchor in anchors:  # everything is checked: only now does the bank change
        key, source_id = (tenant, slot), f"persisted:{next(_fresh_ids)}"
        keys, values = _to(anchor.keys, device), _to(anchor.values, device)
        for consumer, c in anchor.corrections.items():
            correction = Correction(_to(c.keys, device), _to(c.values, device), c.glue_tokens,
                                    _to(c.glue_keys, device), _to(c.glue_values, device))
            if not bank.add(key, source_id, anchor.source, keys, values, consumer, correction):
                break  # too large for the budget on its own
        held = bank.anchor(key, source_id)
        if held is not None:
            held.uses = anchor.uses
            loaded.append((key, source_id))
    count = sum(bank.anchor(key, source_id) is not None for key, source_id in loaded)  # later ones may evict
    if edges is not None:
        edges.extend(saved_edges)
    log.info("loaded %d of %d anchors from %s", count, len(anchors), path)
    return count


def _refusal(path: Path, what: str) -> InputError:
    return InputError(f"refusing to load anchor pools from {path}: {what}")


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The file's metadata and the tensors it names, copied into memory of their own (not the
    file's mapping). Anything unreadable is an InputError."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            text = (f.metadata() or {}).get(METADATA_KEY)
            if text is None:
                raise _refusal(path, f"it is not an agentcache anchor file (no {METADATA_KEY!r} metadata)")
            header = json.loads(text)
            if not isinstance(header, dict):
                raise _refusal(path, "its metadata is not a JSON object")
            present = set(f.keys())
            wanted = _tensor_names(header)
            missing = sorted(wanted - present)
            if missing:
                raise _refusal(path, f"its metadata names tensors the file does not hold: {missing[:5]}")
            tensors = {name: f.get_tensor(name).clone() for name in sorted(wanted)}
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated, garbage, not safetensors, bad JSON: all corrupt
        raise _refusal(path, f"the file is corrupt or not a safetensors file ({type(exc).__name__}: {exc})") from None
    return header, tensors


def _tensor_names(header: dict) -> set[str]:
    """Every tensor name the metadata refers to (any malformed part is caught by the caller)."""
    names: set[str] = set()

    def add(entry: Any) -> None:
        if isinstance(entry, dict):
            names.update(n for n in (entry.get("a"), entry.get("b")) if isinstance(n, str))

    records = header.get("anchors")
    for record in records if isinstance(records, list) else []:
        if isinstance(record, dict):
            add(record.get("keys"))
            add(record.get("values"))
            for c in record.get("corrections") or []:
                if isinstance(c, dict):
                    for part in ("keys", "values", "glue_keys", "glue_values"):
                        add(c.get(part))
    return names


def _check_header(path: Path, header: dict, digest: str, settings: dict, tenant: str | None) -> None:
    """Refuse a file of another format version, model, strategy setting or tenant."""
    if header.get("format") != FORMAT_VERSION:
        raise _refusal(path, f"it has format version {header.get('format')!r}; this agentcache reads {FORMAT_VERSION}")
    if header.get("model_digest") != digest:
        raise _refusal(path, f"it was written for model digest {header.get('model_digest')!r}, not {digest!r} "
                             f"(other weights computed its KV)")
    saved = header.get("strategy")
    if saved != settings:
        saved = saved if isinstance(saved, dict) else {}
        differ = [f"{k}: file {saved.get(k)!r}, asked {settings[k]!r}" for k in STRATEGY_SETTINGS
                  if saved.get(k, object()) != settings[k]]
        raise _refusal(path, f"its strategy settings differ ({'; '.join(differ) or 'unexpected settings'})")
    if "tenant" not in header or header["tenant"] != tenant:
        raise _refusal(path, "it holds another tenant's anchors than the tenant asked for")


def _anchor(path: Path, index: int, record: Any, tensors: dict[str, torch.Tensor], layout: Any) -> tuple[str, Anchor]:
    """One anchor rebuilt from its record and checked (shapes consistent, fitting `layout` when
    given, finite); its slot with it."""
    where = f"anchor {index}"
    try:
        def factors(entry: Any, optional: bool = False) -> Factors | None:
            if entry is None and optional:
                return None
            b = entry["b"]
            return Factors(tensors[entry["a"]], None if b is None else tensors[b])

        slot, source, serial, uses, length = (record[k] for k in ("slot", "source", "serial", "uses", "length"))
        if not (isinstance(slot, str) and isinstance(source, str) and type(serial) is int and type(uses) is int
                and uses >= 0 and type(length) is int):
            raise ValueError("slot, source, serial, uses or length has the wrong type")
        corrections = {}
        for c in record["corrections"]:
            consumer, glue_tokens = c["consumer"], c["glue_tokens"]
            if not (isinstance(consumer, str) and consumer not in corrections and isinstance(glue_tokens, list)
                    and all(type(t) is int for t in glue_tokens)):
                raise ValueError("a consumer is malformed or repeated, or its glue tokens are not ints")
            corrections[consumer] = Correction(factors(c["keys"]), factors(c["values"]), tuple(glue_tokens),
                                               factors(c["glue_keys"], True), factors(c["glue_values"], True))
        anchor = Anchor(str(record.get("source_id", "")), source, factors(record["keys"]), factors(record["values"]),
                        corrections, serial=serial, uses=uses)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _refusal(path, f"{where}'s metadata is malformed ({type(exc).__name__}: {exc})") from None
    if not corrections:
        raise _refusal(path, f"{where} holds no correction")
    keys = anchor.keys
    try:
        consistent = (keys.a.dim() == 3 and (keys.b is None or keys.b.dim() == 3) and anchor.length == length
                      and anchor.fits(keys.num_layers, keys.features))
    except Exception:  # noqa: BLE001 - shapes too odd to compare
        consistent = False
    if not consistent:
        raise _refusal(path, f"{where} (slot {slot!r}) has inconsistent shapes or dtypes (float32 (L, T, F) "
                             f"expected, length {length})")
    if layout is not None:
        features = layout.num_kv_heads * layout.head_dim
        if not anchor.fits(layout.num_layers, features):
            raise _refusal(path, f"{where} (slot {slot!r}) does not fit the model: it has {keys.num_layers} layers "
                                 f"of {keys.features} features, the model {layout.num_layers} of {features}")
    if not anchor.is_finite():
        raise _refusal(path, f"{where} (slot {slot!r}) holds NaN or Inf")
    return slot, anchor


def _to(factors: Factors | None, device: torch.device | str) -> Factors | None:
    if factors is None:
        return None
    return Factors(factors.a.to(device), None if factors.b is None else factors.b.to(device))


# --- a runtime's files ---------------------------------------------------------------------


class AnchorFiles:
    """A strategy's anchor pools and verification records in `directory`, one file per tenant:
    each tenant's file is loaded when the tenant first calls and every tenant's is saved on
    `save`. The caller holds the lock that guards the strategy."""

    def __init__(self, directory: Path, digest: str, strategy: Any, device: Any) -> None:
        self.directory = directory
        self.digest = digest
        self.strategy = strategy  # a Corrector: .bank, .verification, .strategy, .fault
        self.device = device
        self.layout = None
        self.loaded: dict[str | None, int] = {}  # tenant -> anchors loaded

    @classmethod
    def open(cls, directory: str | os.PathLike[str] | None, engine: Any, strategy: Any) -> "AnchorFiles | None":
        """The files of `strategy` over `engine`'s model under `directory`; None when there is no
        directory, or the strategy learns no anchors (nothing to persist)."""
        if directory is None:
            return None
        if not isinstance(directory, (str, os.PathLike)):
            raise InputError(f"Runtime(anchors_dir=...) must be a path, got {type(directory).__name__}")
        if getattr(strategy, "bank", None) is None or not (strategy.strategy.reuse and strategy.strategy.correct):
            log.info("strategy %s learns no anchors: nothing persists in %s", strategy.strategy.name, directory)
            return None
        files = cls(Path(directory), model_digest(engine), strategy,
                    getattr(getattr(engine, "config", None), "device", "cpu"))
        files.layout = engine.layout
        return files

    def load(self, tenant: str | None) -> None:
        """Load `tenant`'s file once. The default tenant's refusal is raised (it is loaded when the
        runtime starts); another tenant's is counted as a fault and the tenant starts cold."""
        if tenant in self.loaded:
            return
        self.loaded[tenant] = 0
        edges: list = []
        try:
            self.loaded[tenant] = load_pools(self.strategy.bank, self.directory, model_digest=self.digest,
                                             strategy=self.strategy.strategy, tenant=tenant, layout=self.layout,
                                             device=self.device, edges=edges)
            self.strategy.verification.load_json(tenant, edges)
        except InputError as exc:
            if tenant is None:
                raise
            self.strategy.fault("anchor_file_refused", "a tenant's anchor file; the tenant starts cold", exc)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"refusing the verification records in {pools_path(self.directory, self.digest, tenant)}: "
                             f"{type(exc).__name__}: {exc}") from None

    def save(self) -> list[Path]:
        tenants = ({_tenant_of(key) for key in self.strategy.bank.pools}
                   | {edge[0] for edge in self.strategy.verification.edges})
        written = []
        for tenant in sorted((t for t in tenants if t is not _NO_TENANT), key=lambda t: (t is not None, t or "")):
            path = save_pools(self.strategy.bank, self.directory, model_digest=self.digest,
                              strategy=self.strategy.strategy, tenant=tenant,
                              edges=self.strategy.verification.to_json(tenant))
            if path is not None:
                written.append(path)
        return written

    def figures(self) -> dict:
        return dict(anchors_dir=str(self.directory), anchors_loaded=sum(self.loaded.values()))
