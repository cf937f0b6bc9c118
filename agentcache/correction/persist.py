"""Anchor pools persisted: one safetensors blob per model and tenant, loaded into a later process
or shared by several instances at once.

A blob holds every anchor of one tenant's pools, for the weights that computed their KV and for
the strategy settings that shaped them, in an `AnchorStore` (a directory to start with):

    <store>/<model digest[:32]>/<tenant file name>.safetensors

The tenant file name is "default" for the default tenant (None), else a sha256 prefix of the
tenant: no tenant's text ever appears in a path. Tensors are stored under systematic names
(`anchor.<i>.keys.a`, `anchor.<i>.correction.<j>.glue_values.b`, ...); what they mean (format
version, model digest, strategy settings, tenant, and per anchor its slot, source agent, serial,
uses, length and consumers) is JSON in the header's `__metadata__`, under the key "agentcache".

Why safetensors: loading one executes no code (unlike pickle, which `torch.load` uses), so a
file from anywhere can at worst be refused. A load checks everything (version, model, strategy,
tenant, tensor names, shapes, finiteness) before it adds a single anchor: a refused file leaves
the bank as it was. A save replaces the file atomically: a failed save leaves the previous file.

Several writers: each anchor carries a `uid` minted where it was learned. A save reads the blob,
merges it with the bank (the bank's anchors first, then the blob's others, up to each pool's
capacity; the bank's verification records over the blob's), and writes only if nobody wrote in
between (`AnchorStore.write`'s compare-and-swap), else reads and merges again: no writer drops
another's anchors unread, and no reader sees half a blob. `AnchorFiles.sync` pulls what other
instances wrote (anchors whose uid the bank lacks) and pushes what this one learned.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import random
import re
import time
from collections import OrderedDict
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Hashable

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from agentcache.correction.anchor_store import AnchorStore, DirectoryStore, Stored, open_store
from agentcache.correction.anchors import Anchor, AnchorBank, Correction
from agentcache.correction.lowrank import Factors
from agentcache.correction.plan import Learned, SharedContextStrategy
from agentcache.correction.strategies import Strategy
from agentcache.correction.verification import Verification
from agentcache.errors import InputError

__all__ = ["FORMAT_VERSION", "STRATEGY_SETTINGS", "model_digest", "blob_name", "pools_path", "save_pools",
           "load_pools", "AnchorFiles"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
METADATA_KEY = "agentcache"
# The strategy settings that shape anchors: a pool learned under other settings is not loaded.
STRATEGY_SETTINGS = ("name", "chained", "base_rank", "delta_rank", "max_anchors", "kvcomm_procedure",
                     "temperature", "gate_scale", "accept")
SAMPLED_VALUES = 4096  # per parameter, evenly spaced, in the weight fingerprint
EDGE_BYTES = 1 << 20  # of a weight file: its first and last MiB are hashed
WEIGHT_FILES = ("*.safetensors", "*.gguf")
WRITE_ATTEMPTS = 8  # a save that keeps losing the race to other writers gives up after this many
KNOWN_UIDS = 1 << 16  # anchor uids an instance remembers per tenant (held or seen in the store)

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
    weights = engine.weights  # the Engine protocol's: the module it runs, or its model directory
    if isinstance(weights, torch.nn.Module):
        _feed_parameters(h, weights)
    elif isinstance(weights, (str, os.PathLike)):
        _feed_directory(h, Path(weights))
    else:
        raise InputError(f"cannot persist anchors for engine {type(engine).__name__} ({engine.model_name}): "
                         f"its weights are a {type(weights).__name__}, neither a torch module nor a model "
                         f"directory, so the weights that computed its KV cannot be named")
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


def blob_name(model_digest: str, tenant: str | None) -> str:
    """The store name of `tenant`'s pools for the model `model_digest`."""
    if not (isinstance(model_digest, str) and re.fullmatch(r"[0-9a-f]{32,}", model_digest)):
        raise InputError(f"model_digest must be a hex digest of at least 32 characters (from model_digest()), "
                         f"got {model_digest!r}")
    if tenant is not None and not isinstance(tenant, str):
        raise InputError(f"tenant must be a str or None, got {type(tenant).__name__}")
    if tenant is None:
        name = "default"
    else:
        name = "tenant-" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{model_digest[:32]}/{name}.safetensors"


def pools_path(directory: str | os.PathLike[str], model_digest: str, tenant: str | None) -> Path:
    """The file of `tenant`'s pools for the model `model_digest` in the directory store `directory`."""
    return Path(directory) / blob_name(model_digest, tenant)


def _where(store: AnchorStore, name: str) -> Path | PurePosixPath:
    return store.path(name) if isinstance(store, DirectoryStore) else PurePosixPath(store.location, name)


def _settings(strategy: Strategy) -> dict:
    if not isinstance(strategy, Strategy):
        raise InputError(f"strategy must be a Strategy, got {type(strategy).__name__}")
    return json.loads(json.dumps({name: getattr(strategy, name) for name in STRATEGY_SETTINGS}))


# --- saving --------------------------------------------------------------------------------


def save_pools(bank: AnchorBank, store: str | os.PathLike[str] | AnchorStore, *, model_digest: str,
               strategy: Strategy, tenant: str | None, edges: list[dict] | None = None) -> Path | PurePosixPath | None:
    """Merge every anchor of `tenant`'s pools (keys `(tenant, slot)`) and `edges` (the tenant's
    verification records, plain JSON) into its blob in `store` (a directory or an AnchorStore), and
    write it whole; where it is, or None when the tenant has neither (the blob is then left as it
    is). What other writers stored is kept (see the module's docstring); a blob that cannot be read
    is replaced. Anchors that do not fit their own shapes or hold NaN/Inf are left out (logged).
    Call it with whatever lock guards `bank` held."""
    store = open_store(store)
    name = blob_name(model_digest, tenant)
    settings = _settings(strategy)
    own = []
    for slot, anchor in sorted(((key[1], a) for key, pool in list(bank.pools.items()) if _tenant_of(key) == tenant
                                for a in list(pool.anchors.values())), key=lambda item: item[1].serial):
        if _sound(anchor):
            own.append((slot, anchor))
        else:
            log.warning("not saving anchor %s of slot %r: its shapes are inconsistent or it holds NaN/Inf",
                        anchor.source_id, slot)
    if not own and not edges:
        return None
    for attempt in range(WRITE_ATTEMPTS):
        if attempt:
            time.sleep(random.uniform(0, 0.01 * attempt))  # writers that keep colliding spread out
        current = store.read(name)
        theirs, their_edges, generation = _readable(current, store, name, model_digest, settings, tenant)
        kept = _merged(own, theirs, strategy.max_anchors)
        mine = {a.uid for _, a in own}
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()  # storages already taken
        records = [_record(i, slot, anchor, tensors, seen) for i, (slot, anchor) in enumerate(kept)]
        header = dict(format=FORMAT_VERSION, model_digest=model_digest, strategy=settings, tenant=tenant,
                      generation=generation + 1, anchors=records, edges=_merged_edges(edges or [], their_edges))
        data = save_tensors(tensors, metadata={METADATA_KEY: json.dumps(header)})
        if store.write(name, data, expected=None if current is None else current.version) is not None:
            log.info("saved %d anchors (%d of them other writers') to %s, generation %d", len(records),
                     len(kept) - sum(a.uid in mine for _, a in kept), _where(store, name), generation + 1)
            return _where(store, name)
    raise OSError(f"could not save anchor pools to {_where(store, name)}: other writers changed it "
                  f"{WRITE_ATTEMPTS} times while this one merged")


def _readable(current: Stored | None, store: AnchorStore, name: str, digest: str, settings: dict,
              tenant: str | None) -> tuple[list[tuple[str, Anchor]], list[dict], int]:
    """The anchors, verification records and generation of the stored blob; nothing for a blob
    that is absent or corrupt (logged: the save replaces it). A whole blob of another
    configuration (format version, strategy settings) is refused (InputError): it is another
    deployment's, not this one's to overwrite."""
    if current is None:
        return [], [], 0
    where = _where(store, name)
    try:
        header, tensors = _decode(current.data, where)
    except InputError as exc:
        log.warning("replacing %s: %s", where, exc)
        return [], [], 0
    _check_header(where, header, digest, settings, tenant)
    try:
        anchors = _checked_contents(header, tensors, where, tenant, None)
    except InputError as exc:
        log.warning("replacing %s: %s", where, exc)
        return [], [], 0
    generation = header.get("generation", 0)
    return anchors, header["edges"], generation if type(generation) is int else 0


def _merged(own: list[tuple[str, Anchor]], theirs: list[tuple[str, Anchor]],
            capacity: int) -> list[tuple[str, Anchor]]:
    """Per slot, the bank's anchors, then the blob's others (uids the bank lacks), up to `capacity`."""
    uids = {anchor.uid for _, anchor in own}
    counts: dict[str, int] = {}
    kept = []
    for slot, anchor in own + [(s, a) for s, a in theirs if a.uid not in uids]:
        if counts.get(slot, 0) < capacity:
            counts[slot] = counts.get(slot, 0) + 1
            kept.append((slot, anchor))
    return kept


def _edge_key(record: dict) -> tuple:
    return tuple(record.get(k) for k in ("slot", "source", "consumer", "exact_source", "after"))


def _merged_edges(own: list[dict], theirs: list[dict]) -> list[dict]:
    """Per edge, the newer of the bank's and the blob's verification records (the bank's on a
    tie): a disagreement one instance found reaches the others, and so does a later agreement."""
    merged = {_edge_key(r): r for r in theirs}
    for record in own:
        key = _edge_key(record)
        if key not in merged or record.get("updated", 0.0) >= merged[key].get("updated", 0.0):
            merged[key] = record
    return list(merged.values())


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
    return dict(slot=slot, uid=anchor.uid, source_id=anchor.source_id, source=anchor.source, serial=anchor.serial,
                uses=anchor.uses,
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


# --- loading -------------------------------------------------------------------------------


def load_pools(bank: AnchorBank, store: str | os.PathLike[str] | AnchorStore, *, model_digest: str,
               strategy: Strategy, tenant: str | None, layout: Any = None, device: torch.device | str = "cpu",
               edges: list | None = None) -> int:
    """Add the anchors of `tenant`'s blob in `store` (a directory or an AnchorStore) into `bank`
    (through `AnchorBank.add`: its capacity and byte budget hold) in their saved order, with their
    uses; the number of them the bank holds afterwards. No blob: 0. Each gets a fresh source id
    ("persisted:<n>", which no SegmentStore id "<slot>#<serial>" can equal) and keeps its uid.
    Anchors whose uid the bank already holds are skipped. Raises InputError, adding nothing, when
    the blob is corrupt or was written for another format version, model, strategy setting or
    tenant, or (given the model's KV `layout`) its shapes do not fit the model. The blob's
    verification records are appended to `edges` when it is given."""
    store, _ = open_store(store), _settings(strategy)
    current = store.read(blob_name(model_digest, tenant))
    if current is None:
        return 0
    return add_stored(bank, current, _where(store, blob_name(model_digest, tenant)), model_digest=model_digest,
                      strategy=strategy, tenant=tenant, layout=layout, device=device, edges=edges)


def add_stored(bank: AnchorBank, stored: Stored, where: Any, *, model_digest: str, strategy: Strategy,
               tenant: str | None, layout: Any = None, device: torch.device | str = "cpu",
               edges: list | None = None, known: Any = None) -> int:
    """`load_pools` for a blob already read (`where` names it in messages). Anchors whose uid is
    in `known` (a set, or a mapping) are skipped too, and every uid of the blob is added to it."""
    header, anchors = _parsed(stored.data, where, model_digest, _settings(strategy), tenant, layout)
    anchors.sort(key=lambda item: item[1].serial)
    held_uids = {a.uid for pool in bank.pools.values() for a in pool.anchors.values()}
    loaded = []
    for slot, anchor in anchors:  # everything is checked: only now does the bank change
        if anchor.uid in held_uids or (known is not None and anchor.uid in known):
            continue
        key, source_id = (tenant, slot), f"persisted:{next(_fresh_ids)}"
        keys, values = _to(anchor.keys, device), _to(anchor.values, device)
        for consumer, c in anchor.corrections.items():
            correction = Correction(_to(c.keys, device), _to(c.values, device), c.glue_tokens,
                                    _to(c.glue_keys, device), _to(c.glue_values, device))
            if not bank.add(key, source_id, anchor.source, keys, values, consumer, correction):
                break  # too large for the budget on its own
        held = bank.anchor(key, source_id)
        if held is not None:
            held.uses, held.uid = anchor.uses, anchor.uid
            loaded.append((key, source_id))
    count = sum(bank.anchor(key, source_id) is not None for key, source_id in loaded)  # later ones may evict
    if known is not None:
        for _, anchor in anchors:
            known[anchor.uid] = None
    if edges is not None:
        edges.extend(header["edges"])
    log.info("loaded %d of %d anchors from %s", count, len(anchors), where)
    return count


def _parsed(data: bytes, where: Any, digest: str, settings: dict, tenant: str | None,
            layout: Any) -> tuple[dict, list[tuple[str, Anchor]]]:
    """A blob's header (its verification records checked to be a list of objects) and its anchors,
    each checked; InputError for anything amiss."""
    header, tensors = _decode(data, where)
    _check_header(where, header, digest, settings, tenant)
    return header, _checked_contents(header, tensors, where, tenant, layout)


def _checked_contents(header: dict, tensors: dict[str, torch.Tensor], where: Any, tenant: str | None,
                      layout: Any) -> list[tuple[str, Anchor]]:
    """The anchors of a decoded blob whose header was checked, each checked, and its verification
    records validated (left in `header["edges"]`); InputError for anything amiss."""
    records = header.get("anchors")
    if not isinstance(records, list):
        raise _refusal(where, "its metadata has no list of anchors")
    anchors = [_anchor(where, i, record, tensors, layout) for i, record in enumerate(records)]
    saved_edges = header.setdefault("edges", [])
    if not (isinstance(saved_edges, list) and all(isinstance(e, dict) for e in saved_edges)):
        raise _refusal(where, "its verification records are not a list of objects")
    try:
        Verification().load_json(tenant, saved_edges)  # every field checked before anything is used
    except (KeyError, TypeError, ValueError) as exc:
        raise _refusal(where, f"its verification records are malformed ({type(exc).__name__}: {exc})") from None
    return anchors


def _refusal(where: Any, what: str) -> InputError:
    return InputError(f"refusing to load anchor pools from {where}: {what}")


def _decode(data: bytes, where: Any) -> tuple[dict, dict[str, torch.Tensor]]:
    """A blob's metadata and the tensors it names, in memory of their own. Anything unreadable is
    an InputError. The header is read by hand: safetensors' `load` returns no metadata."""
    try:
        size = int.from_bytes(data[:8], "little")
        if len(data) < 8 or size > len(data) - 8:
            raise ValueError("truncated header")
        text = (json.loads(data[8:8 + size]).get("__metadata__") or {}).get(METADATA_KEY)
        if text is None:
            raise _refusal(where, f"it is not an agentcache anchor file (no {METADATA_KEY!r} metadata)")
        header = json.loads(text)
        if not isinstance(header, dict):
            raise _refusal(where, "its metadata is not a JSON object")
        tensors = load_tensors(data)
        missing = sorted(_tensor_names(header) - set(tensors))
        if missing:
            raise _refusal(where, f"its metadata names tensors the file does not hold: {missing[:5]}")
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated, garbage, not safetensors, bad JSON: all corrupt
        raise _refusal(where, f"the file is corrupt or not a safetensors file ({type(exc).__name__}: {exc})") from None
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


def _check_header(path: Any, header: dict, digest: str, settings: dict, tenant: str | None) -> None:
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


def _anchor(path: Any, index: int, record: Any, tensors: dict[str, torch.Tensor], layout: Any) -> tuple[str, Anchor]:
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
        uid = record.get("uid")
        if uid is not None and not (isinstance(uid, str) and re.fullmatch(r"[0-9a-f]{32}", uid)):
            raise ValueError("uid is not 32 hex digits")
        anchor = Anchor(str(record.get("source_id", "")), source, factors(record["keys"]), factors(record["values"]),
                        corrections, serial=serial, uses=uses)
        # files of earlier versions have none: one derived from the anchor, the same in every instance
        anchor.uid = uid if uid is not None else _legacy_uid(slot, anchor)
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


def _legacy_uid(slot: str, anchor: Anchor) -> str:
    h = hashlib.blake2b(digest_size=16)
    _feed(h, "agentcache-legacy-anchor", slot, anchor.source, anchor.serial, anchor.length,
          anchor.keys.a.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _to(factors: Factors | None, device: torch.device | str) -> Factors | None:
    if factors is None:
        return None
    return Factors(factors.a.to(device), None if factors.b is None else factors.b.to(device))


# --- a runtime's files ---------------------------------------------------------------------


class AnchorFiles:
    """A strategy's anchor pools and verification records in a store, one blob per tenant: each
    tenant's blob is loaded when the tenant first calls, every tenant's is merged into the store on
    `save`, and `sync` exchanges anchors with the other instances that share the store. The caller
    holds the lock that guards the strategy. Store errors (I/O, a refused blob) are counted as
    faults and cost only the exchange: calls go on with the anchors the bank holds."""

    def __init__(self, store: AnchorStore, digest: str, learned: Learned, fault: Callable[..., None], device: Any,
                 layout: Any) -> None:
        """`learned`: the strategy's pools, records and settings; `fault(kind, what, exc)`: counts a fault."""
        self.store = store
        self.digest = digest
        self.learned = learned
        self.fault = fault
        self.device = device
        self.layout = layout
        self.loaded: dict[str | None, int] = {}  # tenant -> anchors loaded at its first call
        self.pulled = 0  # anchors other instances learned, taken in by `sync`
        self.pushes = 0  # blobs written
        self._seen: dict[str | None, str] = {}  # tenant -> version of its blob last taken in
        self._pushed: dict[str | None, tuple] = {}  # tenant -> what its last save held (`_signature`)
        # tenant -> uids this instance has held or seen in the store: an anchor its bank evicted
        # is not taken in again (bounded: the oldest are forgotten first)
        self._known: dict[str | None, OrderedDict[str, None]] = {}

    @classmethod
    def open(cls, where: str | os.PathLike[str] | AnchorStore | None, engine: Any,
             strategy: SharedContextStrategy) -> "AnchorFiles | None":
        """The blobs of `strategy` over `engine`'s model in `where` (a directory or an AnchorStore);
        None when there is no store, or the strategy learns no anchors (nothing to persist)."""
        if where is None:
            return None
        if not isinstance(where, (str, os.PathLike, AnchorStore)):
            raise InputError(f"Runtime(anchors_dir=...) must be a directory path or an AnchorStore, "
                             f"got {type(where).__name__}")
        store = open_store(where)
        learned = strategy.learned()
        if learned is None:
            log.info("strategy %s learns no anchors: nothing persists in %s", type(strategy).__name__, store.location)
            return None
        return cls(store, model_digest(engine), learned, strategy.fault, engine.layout.device, engine.layout)

    def load(self, tenant: str | None) -> None:
        """Load `tenant`'s blob once. The default tenant's refusal is raised (it is loaded when the
        runtime starts); another tenant's, or a store error, is counted as a fault and the tenant
        starts cold (the next sync tries again)."""
        if tenant in self.loaded:
            return
        self.loaded[tenant] = 0
        try:
            self.loaded[tenant] = self._pull(tenant)
        except InputError as exc:
            if tenant is None:
                raise
            self.fault("anchor_file_refused", "a tenant's anchor file; the tenant starts cold", exc)
        except OSError as exc:
            self.fault("anchor_store_error", f"reading the anchors store {self.store.location}", exc)
        self._pushed[tenant] = self._signature(tenant)  # what was loaded needs no saving back

    def sync(self) -> None:
        """Take in what other instances stored since the last look, and store what this one learned
        since its last save, for every tenant it has seen; each tenant's faults are its own."""
        for tenant in self._tenants() | set(self.loaded):
            try:
                unchanged = self._signature(tenant) == self._pushed.get(tenant)
                try:
                    self.pulled += self._pull(tenant)
                except InputError as exc:  # this instance's own anchors are still saved
                    self.fault("anchor_file_refused", "a tenant's anchor file; its anchors are not used",
                                        exc)
                if unchanged:  # nothing of its own to add to what it just read
                    self._pushed[tenant] = self._signature(tenant)
                else:
                    self._save(tenant)
            except (OSError, InputError) as exc:
                self.fault("anchor_store_error", f"exchanging anchors with {self.store.location}", exc)

    def save(self) -> list[Path | PurePosixPath]:
        """Store every tenant's pools; where each went (a tenant whose save fails is counted as a
        fault: a blob of another configuration is never overwritten)."""
        written = []
        for tenant in sorted(self._tenants(), key=lambda t: (t is not None, t or "")):
            try:
                where = self._save(tenant)
            except (OSError, InputError) as exc:
                self.fault("anchor_store_error", f"saving anchors to {self.store.location}", exc)
                continue
            if where is not None:
                written.append(where)
        return written

    def figures(self) -> dict:
        return dict(anchors_dir=self.store.location, anchors_loaded=sum(self.loaded.values()),
                    anchors_pulled=self.pulled, anchor_saves=self.pushes)

    def _tenants(self) -> set[str | None]:
        tenants = ({_tenant_of(key) for key in self.learned.bank.pools}
                   | {edge.tenant for edge in self.learned.verification.edges})
        return {t for t in tenants if t is not _NO_TENANT}

    def _known_uids(self, tenant: str | None) -> OrderedDict[str, None]:
        known = self._known.setdefault(tenant, OrderedDict())
        for key, pool in self.learned.bank.pools.items():
            if _tenant_of(key) == tenant:
                for anchor in pool.anchors.values():
                    known[anchor.uid] = None
        while len(known) > KNOWN_UIDS:
            known.popitem(last=False)
        return known

    def _pull(self, tenant: str | None) -> int:
        """Add the anchors of `tenant`'s blob this instance never held or saw, and the verification
        records newer than its own, when the blob changed since last taken in; how many anchors.
        A refused blob raises InputError (and is not tried again until it changes)."""
        name = blob_name(self.digest, tenant)
        current = self.store.read(name)
        if current is None or current.version == self._seen.get(tenant):
            return 0
        self._seen[tenant] = current.version
        edges: list = []
        added = add_stored(self.learned.bank, current, _where(self.store, name), model_digest=self.digest,
                           strategy=self.learned.settings, tenant=tenant, layout=self.layout, device=self.device,
                           edges=edges, known=self._known_uids(tenant))
        self.learned.verification.load_json(tenant, edges, replace=False)  # checked by add_stored
        return added

    def _save(self, tenant: str | None) -> Path | PurePosixPath | None:
        signature = self._signature(tenant)
        self._known_uids(tenant)  # what it stores now it has held
        where = save_pools(self.learned.bank, self.store, model_digest=self.digest, strategy=self.learned.settings,
                           tenant=tenant, edges=self.learned.verification.to_json(tenant))
        self._pushed[tenant] = signature
        self.pushes += where is not None
        return where

    def _signature(self, tenant: str | None) -> tuple:
        """What of `tenant`'s a save would write, but for the anchors' use counts (they change on
        every use) and the corrections' contents (a consumer's correction is replaced only by a
        newer observation of the same edge)."""
        anchors = sorted((a.uid, tuple(sorted(a.corrections))) for key, pool in self.learned.bank.pools.items()
                         if _tenant_of(key) == tenant for a in pool.anchors.values())
        edges = json.dumps(self.learned.verification.to_json(tenant), sort_keys=True)
        return tuple(anchors), hashlib.blake2b(edges.encode(), digest_size=16).digest()
