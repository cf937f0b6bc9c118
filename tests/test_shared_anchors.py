"""Anchor pools shared by several instances through one store (correction.anchor_store, persist):
concurrent writers merge and never corrupt a blob, live runtimes exchange anchors, a fresh
runtime is warm from its first call, another store type can take the directory's place, and the
tenant boundary holds."""

from __future__ import annotations

import threading

import pytest

from agentcache.correction.anchor_store import AnchorStore, DirectoryStore, Stored
from agentcache.correction.anchors import AnchorBank
from agentcache.correction.persist import blob_name, load_pools, save_pools
from agentcache.correction.plan import Learned
from agentcache.correction.records import Edge
from agentcache.errors import InputError
from agentcache.runtime import Runtime, RuntimeConfig
from tests.conftest import make_engine
from tests.test_economics import DETERMINISTIC, chain, long_query
from tests.test_persist import DIGEST, KVCMAS, _anchors, _big_bank, _files, _fill


class DictStore:
    """An object store in memory: versions are generations, writes are conditional (as S3's If-Match)."""

    def __init__(self) -> None:
        self.location = "memory://anchors"
        self.blobs: dict[str, tuple[bytes, int]] = {}
        self.lock = threading.Lock()
        self.writes = 0

    def read(self, name: str) -> Stored | None:
        with self.lock:
            held = self.blobs.get(name)
        return None if held is None else Stored(held[0], str(held[1]))

    def write(self, name: str, data: bytes, *, expected: str | None) -> str | None:
        with self.lock:
            held = self.blobs.get(name)
            if (None if held is None else str(held[1])) != expected:
                return None
            generation = 1 if held is None else held[1] + 1
            self.blobs[name] = (bytes(data), generation)
            self.writes += 1
            return str(generation)


def _uids(bank: AnchorBank, tenant: str | None = None) -> set[str]:
    return {a.uid for _, a in _anchors(bank, tenant)}


# --- the store ------------------------------------------------------------------------------


def test_directory_store_writes_only_over_the_version_it_read(tmp_path):
    store = DirectoryStore(tmp_path)
    assert isinstance(store, AnchorStore) and store.read("m/a.safetensors") is None
    first = store.write("m/a.safetensors", b"one", expected=None)
    assert first is not None and store.read("m/a.safetensors") == Stored(b"one", first)
    assert store.write("m/a.safetensors", b"two", expected=None) is None  # someone wrote since
    second = store.write("m/a.safetensors", b"two", expected=first)
    assert second not in (None, first) and store.read("m/a.safetensors").data == b"two"
    assert store.write("m/a.safetensors", b"three", expected=first) is None  # stale version
    assert store.read("m/a.safetensors").data == b"two"
    for bad in ("../x", "/etc/passwd", "a/../../b", "", "a b"):
        with pytest.raises(InputError, match="anchor store names"):
            store.read(bad)


@pytest.mark.parametrize("make_store", [DirectoryStore, lambda _: DictStore()], ids=["directory", "object"])
def test_a_writer_that_lost_the_race_merges_instead_of_overwriting(tmp_path, make_store):
    store = make_store(tmp_path)
    mine, theirs = _big_bank(), _big_bank()
    _fill(mine, None, seed=0, anchors=2)
    _fill(theirs, None, seed=500, anchors=2)
    name = blob_name(DIGEST, None)

    class Racing:  # another instance writes between this one's read and its write, once
        location = "racing"
        raced = False

        def read(self, n):
            return store.read(n)

        def write(self, n, data, *, expected):
            if not Racing.raced:
                Racing.raced = True
                save_pools(theirs, store, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
            return store.write(n, data, expected=expected)

    save_pools(mine, Racing(), model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    assert Racing.raced and store.read(name) is not None
    both = _big_bank()
    assert load_pools(both, store, model_digest=DIGEST, strategy=KVCMAS, tenant=None) == 4
    assert _uids(both) == _uids(mine) | _uids(theirs)


def test_two_writers_at_once_never_corrupt_a_blob_and_keep_each_others_anchors(tmp_path):
    banks = [_big_bank(), _big_bank()]
    for i, bank in enumerate(banks):
        _fill(bank, None, seed=1000 * i, anchors=2)  # two query anchors each: four fit a pool of five
    errors: list[BaseException] = []
    reads: list[int] = []
    stop = threading.Event()

    def write(bank: AnchorBank) -> None:
        try:
            for _ in range(15):
                save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def read() -> None:  # a third instance loading while they write: always a whole blob
        while not stop.is_set():
            try:
                reads.append(load_pools(_big_bank(), tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(bank,)) for bank in banks]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert not errors, errors
    assert reads and all(n in (0, 2, 4) for n in reads)  # none yet, one writer's, or both merged; never torn
    final = _big_bank()
    assert load_pools(final, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None) == 4
    assert _uids(final) == _uids(banks[0]) | _uids(banks[1])
    assert _files(tmp_path / DIGEST[:32]) == ["default.safetensors"]  # no temporaries


def test_a_merge_keeps_each_pool_within_its_capacity(tmp_path):
    small = KVCMAS.replace(max_anchors=5)
    banks = [AnchorBank(5, 2**30) for _ in range(3)]
    for i, bank in enumerate(banks[:2]):
        _fill(bank, None, seed=1000 * i, anchors=3)  # 2 query + 1 out:planner each
    extra = banks[2]
    _fill(extra, None, seed=5000, anchors=2)  # 2 more query anchors: 6 offered, capacity 5
    for bank in banks:
        save_pools(bank, tmp_path, model_digest=DIGEST, strategy=small, tenant=None)
    final = AnchorBank(5, 2**30)
    load_pools(final, tmp_path, model_digest=DIGEST, strategy=small, tenant=None)
    assert len(final.pools[(None, "query")]) == 5 and len(final.pools[(None, "out:planner")]) == 2
    assert _uids(extra) <= _uids(final)  # the last writer's own come first


# --- runtimes sharing a store -------------------------------------------------------------------


def _runtime(base, store, **config) -> Runtime:
    settings = dict(self_check=False, learn="after_call", anchor_sync_s=None) | config
    return Runtime(base.fresh(), strategy="kvcmas", config=RuntimeConfig(**settings), anchors_dir=store)


@pytest.mark.parametrize("kind", ["directory", "object"])
def test_a_fresh_instance_is_warm_from_its_first_call_with_anchors_another_learned(tmp_path, kind):
    base = make_engine("tiny-llama", pool_blocks=1024)
    store = tmp_path if kind == "directory" else DictStore()
    first = _runtime(base, store)
    for seed in range(3):
        chain(first, long_query(first, seed))
    first.sync_anchors()  # what a live instance does every anchor_sync_s
    learned = first.summary()
    assert learned["anchors"] > 0 and learned["anchor_saves"] == 1
    cold = Runtime(base.fresh(), strategy="kvcmas", config=DETERMINISTIC)
    warm = _runtime(base, store)
    assert warm.summary()["anchors_loaded"] == learned["anchors"]
    query = long_query(warm, 99)
    cold_results, warm_results = chain(cold, query), chain(warm, query)
    assert sum(r.reused_tokens for r in warm_results[1:]) > 0  # its first workflow reuses
    assert sum(r.reused_tokens for r in cold_results) == 0  # a cold instance has verified nothing yet
    assert [r.text for r in warm_results] == [r.text for r in cold_results] and warm.summary()["faults"] == {}


def test_live_instances_exchange_anchors_and_the_tenant_boundary_holds(tmp_path):
    base = make_engine("tiny-llama", pool_blocks=1024)
    a, b = _runtime(base, tmp_path), _runtime(base, tmp_path)
    for seed in range(2):
        chain(a, long_query(a, seed), tenant="acme")
        chain(b, long_query(b, 10 + seed), tenant="acme")
    chain(b, long_query(b, 20), tenant="globex")
    a.sync_anchors()
    b.sync_anchors()  # takes in a's acme anchors, stores its own merged with them
    a.sync_anchors()  # takes in b's
    acme_a, acme_b = _uids(a.corrector.bank, "acme"), _uids(b.corrector.bank, "acme")
    assert acme_a and acme_a == acme_b and b.summary()["anchors_pulled"] > 0
    assert not _uids(a.corrector.bank, "globex")  # a never served globex: it holds none of its anchors
    assert _uids(b.corrector.bank, "globex").isdisjoint(acme_a)
    assert not any(edge.tenant == "globex" for edge in a.corrector.verification.edges)
    saves = a.summary()["anchor_saves"]
    a.sync_anchors()  # nothing new anywhere: nothing written
    assert a.summary()["anchor_saves"] == saves


def test_the_sync_runs_by_itself_when_idle_and_stops_when_closed(tmp_path):
    base = make_engine("tiny-llama", pool_blocks=1024)
    a = _runtime(base, tmp_path, anchor_sync_s=0.2, learn="idle")
    chain(a, long_query(a, 0))
    chain(a, long_query(a, 1))
    assert a.learned(30.0)
    deadline = threading.Event()
    for _ in range(100):
        if a.summary()["anchor_saves"] > 0:
            break
        deadline.wait(0.1)
    assert a.summary()["anchor_saves"] > 0 and a.summary()["faults"] == {}
    a.close()
    a._anchor_syncer.join(5.0)
    assert not a._anchor_syncer.is_alive()


def test_bad_anchor_sync_settings_are_refused():
    for bad in (0, -1, float("inf"), "30", True):
        with pytest.raises(InputError, match="anchor_sync_s"):
            RuntimeConfig(anchor_sync_s=bad)
    base = make_engine("tiny-llama", pool_blocks=256)
    with pytest.raises(InputError, match="AnchorStore"):
        Runtime(base.fresh(), strategy="kvcmas", config=DETERMINISTIC, anchors_dir=object())


# --- what review found: evictions, verdicts, old files, other configurations, store errors --------


class _Strategy:
    """What AnchorFiles needs of a strategy: its bank, verification records, settings and faults."""

    def __init__(self, capacity: int) -> None:
        from agentcache.correction.verification import Verification

        self.bank = AnchorBank(capacity, 2**30)
        self.verification = Verification()
        self.strategy = KVCMAS.replace(max_anchors=capacity)
        self.faults: list[str] = []

    def fault(self, kind: str, what: str, exc: BaseException | None = None) -> None:
        self.faults.append(kind)


def _files_over(store, capacity: int = 10):
    from agentcache.correction.persist import AnchorFiles
    from tests.test_persist import LAYOUT

    strategy = _Strategy(capacity)
    learned = Learned(strategy.bank, strategy.verification, strategy.strategy)
    return AnchorFiles(store, DIGEST, learned, strategy.fault, "cpu", LAYOUT), strategy


def test_a_sync_never_brings_back_an_anchor_the_bank_evicted(tmp_path):
    files, strategy = _files_over(DirectoryStore(tmp_path), capacity=2)
    _fill(strategy.bank, None, seed=0, anchors=2)  # two query anchors: the pool is full
    files.sync()
    first = _uids(strategy.bank)
    from tests.test_persist import LAYERS, _correction, _factors

    keys, values = _factors(LAYERS, 9, 4, 77), _factors(LAYERS, 9, 4, 78)  # a third: one of the first two goes
    assert strategy.bank.add((None, "query"), "query#new", "agent9", keys, values, "consumer0", _correction(9, 4, 79))
    after_eviction = _uids(strategy.bank)
    assert len(after_eviction) == 2 and not first <= after_eviction
    for _ in range(3):  # the blob still holds the evicted one; the syncs must not take it back
        files.sync()
        assert _uids(strategy.bank) == after_eviction
    assert files.pulled == 0 and strategy.faults == []


def test_a_disagreement_one_instance_finds_reaches_the_other():
    from agentcache.correction.verification import WINDOW, Verdict

    store = DictStore()
    (a, sa), (b, sb) = _files_over(store), _files_over(store)
    a.load(None), b.load(None)  # as a runtime starts
    edge = Edge(None, "query", "planner", "writer", True, 0)
    for _ in range(WINDOW):
        sa.verification.record(edge, [Verdict("corrected", True, 0.001, 8)])
    _fill(sa.bank, None, seed=0, anchors=1)
    a.sync()
    b.sync()
    assert sb.verification.edges[edge].choice(can_correct=True) == "corrected"  # b serves it too
    sa.verification.record(edge, [Verdict("corrected", False, 0.9, 8)])  # the window was full: same count
    a.sync()
    b.sync()
    assert sb.verification.edges[edge].choice(can_correct=True) is None  # b stops reusing it as well
    for _ in range(WINDOW):  # b verifies it again: its newer agreement reaches a
        sb.verification.record(edge, [Verdict("corrected", True, 0.001, 8)])
    b.sync()
    a.sync()
    assert sa.verification.edges[edge].choice(can_correct=True) == "corrected"


def test_a_file_without_uids_loads_the_same_anchors_in_every_instance(tmp_path):
    from tests.test_persist import _rewrite

    bank = _big_bank()
    _fill(bank, None, anchors=3)
    path = save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    _rewrite(path, lambda header: [record.pop("uid") for record in header["anchors"]])  # an earlier version's
    first, second = _big_bank(), _big_bank()
    load_pools(first, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    load_pools(second, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    assert _uids(first) == _uids(second) and len(_uids(first)) == 3
    save_pools(first, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)  # merging: no duplicates
    assert load_pools(_big_bank(), tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None) == 3


def test_a_blob_of_another_configuration_is_never_overwritten(tmp_path):
    bank = _big_bank()
    _fill(bank, None, anchors=2)
    path = save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None)
    data = path.read_bytes()
    with pytest.raises(InputError, match="strategy settings differ"):
        save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS.replace(max_anchors=4), tenant=None)
    assert path.read_bytes() == data
    path.write_bytes(b"not a blob")  # a corrupt one is replaced
    assert save_pools(bank, tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None) == path
    assert load_pools(_big_bank(), tmp_path, model_digest=DIGEST, strategy=KVCMAS, tenant=None) == 2


def test_store_errors_are_counted_and_cost_only_the_exchange(tmp_path):
    class Failing(DictStore):
        def read(self, name):
            raise OSError("the network share is gone")

    files, strategy = _files_over(Failing())
    files.load("acme")  # a tenant's first call goes on, cold
    _fill(strategy.bank, "acme", anchors=1)
    files.sync()
    assert files.save() == [] and strategy.faults == ["anchor_store_error"] * 3
    assert _uids(strategy.bank, "acme")  # its own anchors are still used
