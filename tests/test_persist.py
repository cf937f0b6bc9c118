"""Anchor pools saved to and loaded from safetensors files (agentcache.correction.persist)."""

from __future__ import annotations

import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from agentcache.correction import persist
from agentcache.correction.anchors import AnchorBank, Correction
from agentcache.correction.lowrank import Factors, factorize
from agentcache.correction.persist import load_pools, model_digest, pools_path, save_pools
from agentcache.correction.store import SegmentStore
from agentcache.correction.strategies import STRATEGIES
from agentcache.engine import EmbeddedEngine
from agentcache.engine.kv import KVLayout, SegmentKV
from agentcache.errors import InputError
from agentcache.isolation import Scope
from agentcache.models import load_model

from conftest import make_engine

LAYERS, HEADS, DIM = 3, 2, 32  # tiny-llama's KV layout
FEATURES = HEADS * DIM
LAYOUT = KVLayout(LAYERS, HEADS, DIM, torch.float32)
DIGEST = "ab" * 32
KVCMAS, FULLRANK = STRATEGIES["kvcmas"], STRATEGIES["kvcmas_fullrank"]


def _factors(layers: int, tokens: int, rank: int | None, seed: int) -> Factors:
    gen = torch.Generator().manual_seed(seed)
    return factorize(torch.randn(layers, tokens, FEATURES, generator=gen), rank)


def _correction(tokens: int, rank: int | None, seed: int, glue: int = 0, shared: bool = False) -> Correction:
    keys = _factors(LAYERS - 1, tokens, rank, seed)
    values = keys if shared else _factors(LAYERS - 1, tokens, rank, seed + 1)  # shared: one Factors twice
    if not glue:
        return Correction(keys, values)
    return Correction(keys, values, glue_tokens=tuple(range(100, 100 + glue)),
                      glue_keys=_factors(LAYERS - 1, glue, None, seed + 2),
                      glue_values=_factors(LAYERS - 1, glue, None, seed + 3))


def _fill(bank: AnchorBank, tenant: str | None, seed: int = 0, anchors: int = 3) -> None:
    """Anchors in two slots: low-rank and dense bases, one to three consumers, with and without glue."""
    for i in range(anchors):
        s = seed + 100 * i
        rank = 4 if i % 2 == 0 else None
        tokens = 9 + i
        keys, values = _factors(LAYERS, tokens, rank, s), _factors(LAYERS, tokens, rank, s + 1)
        slot = "query" if i < 2 else "out:planner"
        source_id = f"{slot}#{i}"
        for j in range(1 + i % 3):
            correction = _correction(tokens, rank, s + 10 + 5 * j, glue=3 * j, shared=(j == 0 and i == 0))
            assert bank.add((tenant, slot), source_id, f"agent{i}", keys, values, f"consumer{j}", correction)
        bank.anchor((tenant, slot), source_id).uses = 7 * i + 1


def _files(directory) -> list[str]:
    """The directory's files but the store's lock file."""
    return sorted(name for name in os.listdir(directory) if name != ".lock")


def _anchors(bank: AnchorBank, tenant: str | None = None) -> list:
    """(slot, anchor) of one tenant, in serial order."""
    return sorted(((key[1], a) for key, pool in bank.pools.items() if key[0] == tenant for a in pool.anchors.values()),
                  key=lambda item: item[1].serial)


def _same_factors(x: Factors | None, y: Factors | None) -> None:
    assert (x is None) == (y is None)
    if x is not None:
        assert torch.equal(x.a, y.a) and x.a.dtype == y.a.dtype
        assert (x.b is None) == (y.b is None)
        if x.b is not None:
            assert torch.equal(x.b, y.b)


def _state(bank: AnchorBank) -> tuple:
    return ({key: list(pool.anchors) for key, pool in bank.pools.items()}, bank.nbytes, bank.inserted, bank.evicted)


def _big_bank() -> AnchorBank:
    return AnchorBank(capacity=10, byte_budget=2**30)


def test_round_trip_keeps_every_tensor_and_field(tmp_path):
    bank = _big_bank()
    _fill(bank, None)
    path = save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    assert path == tmp_path / DIGEST[:32] / "default.safetensors" == pools_path(tmp_path, DIGEST, None)
    assert path.is_file() and _files(path.parent) == ["default.safetensors"]

    again = _big_bank()
    assert load_pools(again, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None, layout=LAYOUT) == 3
    before, after = _anchors(bank), _anchors(again)
    assert [slot for slot, _ in before] == [slot for slot, _ in after]  # serial order kept
    for (_, old), (_, new) in zip(before, after):
        assert (new.source, new.uses, new.length) == (old.source, old.uses, old.length)
        assert list(new.corrections) == list(old.corrections)
        _same_factors(old.keys, new.keys)
        _same_factors(old.values, new.values)
        for consumer, c in old.corrections.items():
            d = new.corrections[consumer]
            assert d.glue_tokens == c.glue_tokens
            for part in ("keys", "values", "glue_keys", "glue_values"):
                _same_factors(getattr(c, part), getattr(d, part))
        assert new.nbytes == old.nbytes == new.counted_bytes
        assert new.fits(LAYERS, FEATURES) and new.is_finite()
    assert again.nbytes == bank.nbytes
    assert any(a.keys.b is None for _, a in after) and any(a.keys.b is not None for _, a in after)
    assert any(c.glue_keys is not None for _, a in after for c in a.corrections.values())


def test_metadata_records_the_settings_and_each_anchor(tmp_path):
    bank = _big_bank()
    _fill(bank, "acme")
    path = save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant="acme")
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["agentcache"])
        names = set(f.keys())
    assert header["format"] == persist.FORMAT_VERSION and header["model_digest"] == DIGEST
    assert header["tenant"] == "acme"
    assert header["strategy"] == {"name": "kvcmas", "chained": True, "base_rank": 32, "delta_rank": 32,
                                  "max_anchors": 10, "kvcomm_procedure": False, "temperature": 0.1,
                                  "gate_scale": "nearest", "accept": "verified"}
    assert header["edges"] == []
    first = header["anchors"][0]
    assert (first["slot"], first["source"], first["uses"], first["length"]) == ("query", "agent0", 1, 9)
    assert first["keys"] == {"a": "anchor.0.keys.a", "b": "anchor.0.keys.b"}
    assert [c["consumer"] for c in header["anchors"][2]["corrections"]] == ["consumer0", "consumer1", "consumer2"]
    assert header["anchors"][2]["corrections"][1]["glue_tokens"] == [100, 101, 102]
    assert header["anchors"][1]["keys"]["b"] is None  # dense
    referenced = {n for r in header["anchors"] for part in [r["keys"], r["values"]] + [
        c[k] for c in r["corrections"] for k in ("keys", "values", "glue_keys", "glue_values")]
        if part for n in part.values() if n}
    assert referenced == names


def test_loaded_anchors_get_fresh_ids_no_store_id_can_equal(tmp_path):
    bank = _big_bank()
    _fill(bank, None)
    save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    again = _big_bank()
    load_pools(again, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    ids = [a.source_id for _, a in _anchors(again)]
    assert len(set(ids)) == 3 and all(i.startswith("persisted:") and "#" not in i for i in ids)
    for slot in ("query", "out:planner"):
        assert all(again.anchor((None, slot), f"{slot}#{n}") is None for n in range(50))
    # a new process's store restarts its serials: its materializations are never taken for a loaded base
    store = SegmentStore(2**30)
    for _ in range(3):
        made = store.put(Scope(), "query", "agent0", list(range(9)), SegmentKV(torch.randn(3, 2, 9, 32),
                                                                                torch.randn(3, 2, 9, 32), 0), "dense")
        assert again.anchor((None, "query"), made.id) is None
    # loading twice adds nothing: the bank holds those anchors' uids already
    assert load_pools(again, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None) == 0
    assert again.num_anchors == 3 and {a.uid for _, a in _anchors(again)} == {a.uid for _, a in _anchors(bank)}


def test_each_tenant_has_its_own_file_and_never_gets_anothers_anchors(tmp_path):
    bank = _big_bank()
    _fill(bank, "alice", seed=1)
    _fill(bank, "bob", seed=2, anchors=2)
    _fill(bank, None, seed=3, anchors=1)
    paths = {t: save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=t)
             for t in ("alice", "bob", None)}
    assert len(set(paths.values())) == 3
    assert all("alice" not in str(p) and "bob" not in str(p) for p in paths.values())
    assert save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant="carol") is None

    fresh = _big_bank()
    assert load_pools(fresh, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant="bob") == 2
    assert {key[0] for key in fresh.pools} == {"bob"}
    for (_, old), (_, new) in zip(_anchors(bank, "bob"), _anchors(fresh, "bob"), strict=True):
        _same_factors(old.keys, new.keys)
    alice_bases = [a.keys.a for _, a in _anchors(bank, "alice")]
    assert not any(torch.equal(new.keys.a, base) for _, new in _anchors(fresh, "bob") for base in alice_bases
                   if new.keys.a.shape == base.shape)

    # alice's file put where bob's is: refused (the tenant it records is not bob)
    shutil.copy(paths["alice"], paths["bob"])
    state = _state(fresh)
    with pytest.raises(InputError, match="another tenant"):
        load_pools(fresh, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant="bob")
    assert _state(fresh) == state


def test_nothing_to_save_removes_nothing(tmp_path):
    bank = _big_bank()
    _fill(bank, None)
    path = save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    data = path.read_bytes()
    assert save_pools(_big_bank(), tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None) is None
    assert path.read_bytes() == data


def test_missing_file_loads_nothing(tmp_path):
    bank = _big_bank()
    assert load_pools(bank, tmp_path / "absent", model_digest=DIGEST, strategy=KVCMAS, tenant=None) == 0
    assert load_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant="x") == 0
    assert bank.num_anchors == 0 and not bank.pools


def _saved(tmp_path, tenant=None):
    bank = _big_bank()
    _fill(bank, tenant)
    return save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=tenant)


def _occupied() -> AnchorBank:
    """A bank already holding one anchor: a refused load must leave it as it is."""
    bank = _big_bank()
    bank.add((None, "query"), "query#0", "a0", _factors(LAYERS, 5, 4, 9), _factors(LAYERS, 5, 4, 8), "c",
             _correction(5, 4, 7))
    return bank


def test_other_model_strategy_or_version_is_refused(tmp_path):
    path = _saved(tmp_path)
    bank = _occupied()
    state = _state(bank)
    # another model's digest names another folder: nothing there
    assert load_pools(bank, tmp_path, model_digest="cd" * 32, strategy=KVCMAS, tenant=None) == 0
    # a digest that shares the folder but not the whole: refused
    other = DIGEST[:32] + "cd" * 16
    with pytest.raises(InputError, match="model digest"):
        load_pools(bank, tmp_path, model_digest=other, strategy=KVCMAS, tenant=None)
    with pytest.raises(InputError, match=r"strategy settings differ .*base_rank: file 32, asked None"):
        load_pools(bank, tmp_path, model_digest=DIGEST, strategy=FULLRANK, tenant=None)
    with pytest.raises(InputError, match="max_anchors"):
        load_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS.replace(max_anchors=4), tenant=None)
    _rewrite(path, lambda header: header.update(format=persist.FORMAT_VERSION + 1))
    with pytest.raises(InputError, match="format version") as refused:
        load_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    assert str(path) in str(refused.value)
    assert _state(bank) == state


def _rewrite(path, change_header=None, change_tensors=None) -> None:
    """Rewrite a pools file with its metadata (and tensors) changed."""
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["agentcache"])
        tensors = {name: f.get_tensor(name).clone() for name in f.keys()}
    if change_header:
        change_header(header)
    if change_tensors:
        change_tensors(tensors)
    save_file(tensors, str(path), metadata={"agentcache": json.dumps(header)})


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "no_metadata", "missing_tensor",
                                    "nan", "bad_shape", "bad_dtype", "bad_metadata", "wrong_length"])
def test_corrupt_file_is_refused_and_adds_nothing(tmp_path, damage):
    path = _saved(tmp_path)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) - 100])
    elif damage == "garbage":
        path.write_bytes(os.urandom(4096))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "no_metadata":
        save_file({"x": torch.zeros(3)}, str(path))
    elif damage == "missing_tensor":
        _rewrite(path, change_tensors=lambda t: t.pop("anchor.2.correction.1.glue_values.a"))
    elif damage == "nan":  # the last anchor: the first two are valid, and still must not be added
        _rewrite(path, change_tensors=lambda t: t["anchor.2.correction.0.values.a"].view(-1).__setitem__(0, torch.nan))
    elif damage == "bad_shape":
        _rewrite(path, change_tensors=lambda t: t.update({"anchor.1.values.a": torch.zeros(LAYERS, 10, FEATURES + 1)}))
    elif damage == "bad_dtype":
        _rewrite(path, change_tensors=lambda t: t.update({"anchor.0.keys.a": t["anchor.0.keys.a"].double()}))
    elif damage == "bad_metadata":
        _rewrite(path, lambda h: h["anchors"][1].update(corrections=[{"consumer": 3}]))
    elif damage == "wrong_length":
        _rewrite(path, lambda h: h["anchors"][0].update(length=99))
    bank = _occupied()
    state = _state(bank)
    with pytest.raises(InputError, match="refusing to load anchor pools from"):
        load_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    assert _state(bank) == state


def test_shapes_that_do_not_fit_the_model_are_refused(tmp_path):
    _saved(tmp_path)
    bank = _big_bank()
    for layout in (KVLayout(LAYERS + 1, HEADS, DIM, torch.float32), KVLayout(LAYERS, 1, DIM, torch.float32)):
        with pytest.raises(InputError, match="does not fit the model"):
            load_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None, layout=layout)
    assert bank.num_anchors == 0
    assert load_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None, layout=LAYOUT) == 3


def test_failed_save_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    data = path.read_bytes()
    bank = _big_bank()
    _fill(bank, None, seed=50, anchors=4)

    def refuse(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    monkeypatch.undo()
    assert path.read_bytes() == data and _files(path.parent) == [path.name]

    def half_written(fd):  # the temporary file holds the data, not yet durable
        raise RuntimeError("interrupted")

    monkeypatch.setattr(os, "fsync", half_written)
    with pytest.raises(RuntimeError, match="interrupted"):
        save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    monkeypatch.undo()
    assert path.read_bytes() == data and _files(path.parent) == [path.name]
    assert load_pools(_big_bank(), tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None) == 3

    save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)  # a good save merges into it
    assert load_pools(_big_bank(), tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None) == 3 + 4
    assert _files(path.parent) == [path.name]


def test_kvcomm_dense_anchors_with_empty_glue_round_trip(tmp_path):
    kvcomm = STRATEGIES["kvcomm"]
    bank = AnchorBank(kvcomm.max_anchors, 2**30)
    base = _factors(LAYERS, 6, None, 1)
    empty = Factors(torch.zeros(LAYERS - 1, 0, FEATURES), None)  # no template text after the segment
    bank.add(("t", "query"), "query#3", "<reference>", base, base, "a1",
             Correction(_factors(LAYERS - 1, 6, None, 2), _factors(LAYERS - 1, 6, None, 3), (), empty, empty))
    save_pools(bank, tmp_path, model_digest=DIGEST, strategy=kvcomm, tenant="t")
    again = AnchorBank(kvcomm.max_anchors, 2**30)
    assert load_pools(again, tmp_path, model_digest=DIGEST, strategy=kvcomm, tenant="t", layout=LAYOUT) == 1
    (_, loaded), = _anchors(again, "t")
    c = loaded.corrections["a1"]
    assert c.glue_tokens == () and c.glue_keys.a.shape == (LAYERS - 1, 0, FEATURES) and c.glue_values is not None
    _same_factors(loaded.keys, base)
    _same_factors(loaded.values, base)
    with pytest.raises(InputError, match="strategy settings differ"):
        load_pools(again, tmp_path, model_digest=DIGEST, strategy=STRATEGIES["kvcomm_canonical"], tenant="t")


def test_unsound_anchors_are_not_saved(tmp_path):
    bank = _big_bank()
    _fill(bank, None)
    _, bad = _anchors(bank)[1]
    bad.values.a[0, 0, 0] = float("inf")
    save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    again = _big_bank()
    assert load_pools(again, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None) == 2


def _many(tmp_path, count: int = 6) -> AnchorBank:
    bank = _big_bank()
    tokens = 8
    for i in range(count):
        keys, values = _factors(LAYERS, tokens, 4, i), _factors(LAYERS, tokens, 4, 50 + i)
        bank.add((None, "query"), f"query#{i}", "a0", keys, values, "c", _correction(tokens, 4, 100 + i))
        bank.anchor((None, "query"), f"query#{i}").uses = [0, 9, 0, 9, 9, 9][i]
    save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    return bank


def test_loading_into_a_small_bank_respects_capacity_and_budget(tmp_path):
    saved = _many(tmp_path)
    one = _anchors(saved)[0][1].nbytes

    narrow = AnchorBank(capacity=3, byte_budget=2**30)
    assert load_pools(narrow, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None) == 3
    assert narrow.num_anchors == 3 and narrow.evicted == 3
    # the evictions follow the saved uses: the unused oldest went first
    assert [a.uses for _, a in _anchors(narrow)] == [9, 9, 9]

    small = AnchorBank(capacity=10, byte_budget=2 * one + one // 2)
    loaded = load_pools(small, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    assert loaded == small.num_anchors == 2 and small.nbytes <= small.byte_budget

    tiny = AnchorBank(capacity=10, byte_budget=one - 1)
    assert load_pools(tiny, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None) == 0
    assert tiny.num_anchors == 0 and tiny.rejected_too_large == 6 and tiny.nbytes == 0


def test_bad_arguments(tmp_path):
    bank = _big_bank()
    with pytest.raises(InputError, match="model_digest"):
        save_pools(bank, tmp_path, model_digest="../../etc", strategy=KVCMAS, tenant=None)
    with pytest.raises(InputError, match="tenant"):
        load_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=3)
    with pytest.raises(InputError, match="Strategy"):
        load_pools(bank, tmp_path, model_digest=DIGEST, strategy="kvcmas", tenant=None)


# --- model_digest ---------------------------------------------------------------------------


def test_model_digest_names_the_weights():
    engine = make_engine("tiny-llama")
    digest = model_digest(engine)
    assert re.fullmatch("[0-9a-f]{64}", digest), digest  # SHA-256, as lowercase hex
    assert model_digest(make_engine("tiny-llama", pool_blocks=64)) == digest
    assert model_digest(EmbeddedEngine(load_model("tiny-llama"))) == digest  # another copy of the same weights
    assert model_digest(make_engine("tiny-qwen2")) != digest
    assert model_digest(EmbeddedEngine(load_model("tiny-llama", seed=1))) != digest
    # what a load checks anchors against: a real engine's layout
    assert pools_path("/x", digest, None).parent.name == digest[:32]


def test_model_digest_of_a_model_directory(tmp_path):
    def directory_engine(path):
        return SimpleNamespace(model_name="m", layout=LAYOUT, vocab_size=320, weights=path)

    one = tmp_path / "one"
    one.mkdir()
    (one / "config.json").write_text('{"model_type": "llama"}')
    weights = bytearray(os.urandom(3 << 20))
    (one / "model.safetensors").write_bytes(weights)
    copy = tmp_path / "copy"
    shutil.copytree(one, copy)
    digest = model_digest(directory_engine(one))
    assert model_digest(directory_engine(copy)) == digest
    weights[-1] ^= 1
    (copy / "model.safetensors").write_bytes(weights)
    assert model_digest(directory_engine(copy)) != digest
    (copy / "model.safetensors").unlink()
    with pytest.raises(InputError, match="no weight files"):
        model_digest(directory_engine(copy))
    with pytest.raises(InputError, match="cannot persist anchors"):
        model_digest(SimpleNamespace(model_name="m", layout=LAYOUT, vocab_size=320, weights=None))
