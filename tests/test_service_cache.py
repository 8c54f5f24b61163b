"""The EOE service cache: LRU eviction order, affinity, one action per GPU."""
from __future__ import annotations

import pytest

from tangram.managers.buddy import Chunk
from tangram.managers.service_cache import ModelSpec, ServiceCache, parse_service, service_name

C = Chunk


def cache(num_gpus=8, mem=100, *models) -> ServiceCache:
    return ServiceCache(num_gpus, mem, models or (ModelSpec("a", 60), ModelSpec("b", 60), ModelSpec("c", 30),
                                                   ModelSpec("big", 240, sharded=True)))


def run(sc: ServiceCache, holder: str, service: str, chunk: Chunk, restore_s: float = 0.1):
    """One action, start to end, with a successful restore."""
    d = sc.begin(holder, service, chunk)
    if not d.hit:
        sc.restored(holder, restore_s)
    sc.end(holder)
    sc.check()
    return d


def test_names():
    assert service_name("rm", 2) == "rm@dop2"
    assert parse_service("rm@dop2") == ("rm", 2)
    assert parse_service("org/m@dop@dop8") == ("org/m@dop", 8)
    for bad in ("rm", "rm@dop", "@dop1", "rm@dopx"):
        with pytest.raises(ValueError):
            parse_service(bad)


def test_miss_then_hit():
    sc = cache()
    d1 = run(sc, "x1", "a@dop1", C(0, 1))
    assert (d1.hit, d1.evict, d1.restore_mb_per_device) == (False, (), 60)
    d2 = run(sc, "x2", "a@dop1", C(0, 1))
    assert d2.hit and d2.evict == ()
    assert sc.resident_services() == {"a@dop1"}
    s = sc.stats()
    assert (s["hits"], s["misses"], s["evictions"], s["restores"]) == (1, 1, 0, 1)
    assert s["restore_s"] == pytest.approx(0.1)
    assert s["by_service"]["a@dop1"] == {"hits": 1, "misses": 1, "evictions": 0}


def test_same_model_other_dop_is_another_service():
    sc = cache()
    run(sc, "x1", "c@dop1", C(0, 1))
    d = run(sc, "x2", "c@dop2", C(0, 2))  # 30 + 30 fits on GPU 0: nothing evicted
    assert not d.hit and d.evict == ()
    assert sc.resident_services() == {"c@dop1", "c@dop2"}


def test_same_service_elsewhere_is_a_miss():
    # an instance is a service on one chunk; GPU 1 does not have what GPU 0 has
    sc = cache()
    run(sc, "x1", "a@dop1", C(0, 1))
    assert not run(sc, "x2", "a@dop1", C(1, 1)).hit
    assert sorted(sc.chunks_of("a@dop1")) == [C(0, 1), C(1, 1)]


# (history of (service, chunk) runs, then the service that misses on the chunk, expected evictions in order)
LRU_CASES = [
    # memory for one 60-MiB model per GPU: the resident one goes
    ([("a@dop1", C(0, 1))], ("b@dop1", C(0, 1)), [("a@dop1", C(0, 1))]),
    # enough free memory: nothing is evicted (30 + 60 <= 100)
    ([("c@dop1", C(0, 1))], ("a@dop1", C(0, 1)), []),
    # two small ones resident, the least recently used goes first and one is enough
    ([("c@dop1", C(0, 1)), ("c@dop2", C(0, 2)), ("c@dop1", C(0, 1))], ("a@dop1", C(0, 1)), [("c@dop2", C(0, 2))]),
    # ... by recency of use, not of restore: c@dop1 restored first but used last
    ([("c@dop2", C(0, 2)), ("c@dop1", C(0, 1)), ("c@dop2", C(0, 2))], ("a@dop1", C(0, 1)), [("c@dop1", C(0, 1))]),
    # evicting the LRU one frees nothing where memory is short: it is skipped, not evicted
    ([("a@dop1", C(1, 1)), ("a@dop1", C(0, 1))], ("b@dop1", C(0, 1)), [("a@dop1", C(0, 1))]),
    # a 2-GPU miss evicts from both devices, LRU first, until both have room
    ([("a@dop1", C(0, 1)), ("b@dop1", C(1, 1))], ("b@dop2", C(0, 2)), [("a@dop1", C(0, 1)), ("b@dop1", C(1, 1))]),
    # an instance spanning the chunk and beyond is evicted whole (it cannot run half-loaded)
    ([("a@dop2", C(0, 2))], ("b@dop1", C(1, 1)), [("a@dop2", C(0, 2))]),
    # a sharded model at DoP 4 takes 60 per device: it evicts what blocks it on any of its 4 GPUs
    ([("c@dop1", C(2, 1)), ("a@dop1", C(3, 1)), ("c@dop1", C(0, 1))], ("big@dop4", C(0, 4)), [("a@dop1", C(3, 1))]),
    # instances outside the chunk are never touched
    ([("a@dop1", C(4, 1)), ("a@dop4", C(0, 4))], ("b@dop2", C(0, 2)), [("a@dop4", C(0, 4))]),
]


@pytest.mark.parametrize("history, miss, evicted", LRU_CASES)
def test_lru_eviction_order(history, miss, evicted):
    sc = cache()
    for i, (svc, ch) in enumerate(history):
        run(sc, f"h{i}", svc, ch)
    d = run(sc, "m", *miss)
    assert not d.hit
    assert [(i.service, i.chunk) for i in d.evict] == evicted
    assert sc.stats()["evictions"] == len(evicted)
    for svc, ch in evicted:
        assert not sc.is_resident(svc, ch)
    assert sc.is_resident(*miss)
    sc.check()


def test_one_action_per_gpu_is_asserted():
    sc = cache()
    sc.begin("x", "a@dop2", C(0, 2))
    with pytest.raises(AssertionError, match="one action per GPU"):
        sc.begin("y", "b@dop1", C(1, 1))
    with pytest.raises(ValueError):
        sc.begin("x", "b@dop1", C(4, 1))  # one lease per holder
    sc.restored("x", 0.0)
    sc.end("x")
    sc.begin("y", "b@dop1", C(1, 1))  # free again


def test_dop_must_match_the_chunk():
    sc = cache()
    with pytest.raises(ValueError, match="cannot run on 1 devices"):
        sc.begin("x", "a@dop2", C(0, 1))
    assert sc.busy() == {}


def test_unconfirmed_restore_is_forgotten():
    # a restore that failed, timed out or was cancelled leaves nothing resident
    sc = cache()
    run(sc, "x0", "a@dop1", C(0, 1))
    d = sc.begin("x1", "b@dop1", C(0, 1))
    assert [i.service for i in d.evict] == ["a@dop1"]  # eviction is real even if the restore fails
    assert sc.end("x1") is True
    assert sc.end("x1") is False  # idempotent
    assert sc.resident_services() == frozenset()
    assert sc.free_mb(0) == 100
    s = sc.stats()
    assert (s["misses"], s["restores"], s["failed_restores"]) == (2, 1, 1)
    # and the next action misses again
    assert not run(sc, "x2", "b@dop1", C(0, 1)).hit


def test_restored_is_idempotent_and_counts_time_once():
    sc = cache()
    sc.begin("x", "a@dop1", C(0, 1))
    sc.restored("x", 0.5)
    sc.restored("x", 0.5)
    sc.end("x")
    assert sc.stats()["restore_s"] == pytest.approx(0.5)
    assert sc.stats()["restored_mb"] == 60


def test_plain_gpu_action_has_no_service():
    sc = cache()
    d = sc.begin("x", None, C(0, 8))
    assert d.hit and d.service is None
    assert sc.busy() == {i: "x" for i in range(8)}
    sc.end("x")
    assert sc.busy() == {}
    assert sc.stats()["hits"] == 0


def test_models_that_never_fit_are_refused():
    with pytest.raises(ValueError):
        ServiceCache(8, 100, [ModelSpec("huge", 101)])
    ServiceCache(8, 100, [ModelSpec("shardable", 800, sharded=True)])  # fits at DoP 8
    sc = ServiceCache(8, 100, [ModelSpec("shardable", 800, sharded=True)])
    with pytest.raises(ValueError):
        sc.begin("x", "shardable@dop1", C(0, 1))
    assert sc.busy() == {}


def test_unknown_models():
    sc = ServiceCache(2, 100, unknown_model_mb=None)
    with pytest.raises(KeyError):
        sc.mb_per_device("nope@dop1")
    lenient = ServiceCache(2, 100)  # default: unknown models take no memory, affinity only
    assert run(lenient, "x", "nope@dop1", C(0, 1)).restore_mb_per_device == 0


def test_lru_listing_and_forget():
    sc = cache()
    run(sc, "x", "a@dop1", C(0, 1))
    run(sc, "y", "c@dop1", C(1, 1))
    run(sc, "z", "a@dop1", C(0, 1))
    assert [i.service for i in sc.instances()] == ["c@dop1", "a@dop1"]
    assert sc.begin("w", "c@dop1", C(1, 1)).hit
    assert sc.forget("c@dop1", C(1, 1)) is False  # it is running: not now
    sc.end("w")
    assert sc.forget("c@dop1", C(1, 1)) is True
    assert sc.resident_services() == {"a@dop1"}
