"""GpuManager: buddy chunks + service cache behind the ResourceManager interface, and in the engine."""
from __future__ import annotations

import random

import pytest

from tangram.core.engine import Engine
from tangram.core.model import Action, Elasticity
from tangram.managers.base import AllocationError
from tangram.managers.gpu import BuddyAllocator, Chunk, GpuManager, GpuNode, ModelSpec, service_name
from tangram.policy.snapshot import PolicyParams

C = Chunk
MODELS = (ModelSpec("rm", 60), ModelSpec("judge", 60), ModelSpec("tiny", 10))


def gpu_action(id, dop=(1, 2, 4, 8), *, service="rm", t1=8.0, serial=0.05):
    return Action.build(id, {"gpu": list(dop) if isinstance(dop, (list, tuple)) else dop}, service=service,
                        t1_s=t1, elasticity=Elasticity.amdahl(serial), action_class=f"svc:{service}")


def manager(*nodes, mem=100):
    nodes = nodes or (GpuNode("g0", 8, mem),)
    return GpuManager(nodes, MODELS)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_buddy_is_reexported():
    from tangram.managers import buddy

    assert BuddyAllocator is buddy.BuddyAllocator and Chunk is buddy.Chunk


def test_pool_states_report_chunks_and_residents():
    m = manager(GpuNode("g0", 8, 100), GpuNode("g1", 6, 100))
    states = {p.name: p for p in m.pool_states()}
    assert set(states) == {"gpu@g0", "gpu@g1"}
    assert states["gpu@g1"].chunks == (4, 2) and states["gpu@g1"].capacity == 6
    chunk = m.allocate("gpu@g0", 2, "a1", gpu_action("a1", 2))
    assert chunk == C(0, 2)
    m.restored("gpu@g0", "a1", 0.2)
    m.release("gpu@g0", "a1")
    g0 = {p.name: p for p in m.pool_states()}["gpu@g0"]
    assert g0.resident == {"rm@dop2"} and g0.free == 8 and g0.chunks == (8,)
    m.check_invariants()


def test_allocate_returns_the_chunk_and_the_lease_tells_the_executor():
    m = manager()
    c = m.allocate("gpu@g0", 4, "x", gpu_action("x", 4))
    lease = m.lease("gpu@g0", "x")
    assert (lease.chunk, lease.service, lease.hit, lease.model, lease.dop) == (c, "rm@dop4", False, "rm", 4)
    assert list(lease.devices) == [0, 1, 2, 3]
    assert m.held() == {"gpu@g0": {"x": c}}


def test_affinity_prefers_the_chunk_where_the_service_is_resident():
    m = manager()
    # fill GPUs 0..3 with four 1-GPU actions of different services, then free 0 and 3
    for i, svc in enumerate(["tiny", "judge", "tiny", "rm"]):
        c = m.allocate("gpu@g0", 1, f"w{i}", gpu_action(f"w{i}", 1, service=svc))
        assert c == C(i, 1)
        m.restored("gpu@g0", f"w{i}")
    m.release("gpu@g0", "w0")
    m.release("gpu@g0", "w3")
    # rm@dop1 is resident on GPU 3: it goes there although GPU 0 has the lower start
    assert m.allocate("gpu@g0", 1, "r", gpu_action("r", 1, service="rm")) == C(3, 1)
    assert m.lease("gpu@g0", "r").hit
    m.check_invariants()


def test_affinity_avoids_needless_evictions():
    m = manager()
    for i, svc in enumerate(["rm", "tiny"]):
        m.allocate("gpu@g0", 1, f"w{i}", gpu_action(f"w{i}", 1, service=svc))
        m.restored("gpu@g0", f"w{i}")
    m.allocate("gpu@g0", 2, "hold", gpu_action("hold", 2, service=None))
    m.release("gpu@g0", "w0")
    m.release("gpu@g0", "w1")
    # judge (60) fits beside tiny (10) on GPU 1 but not beside rm (60) on GPU 0
    assert m.allocate("gpu@g0", 1, "j", gpu_action("j", 1, service="judge")) == C(1, 1)
    lease = m.lease("gpu@g0", "j")
    assert not lease.hit and lease.evict == ()


def test_affinity_never_trades_size_for_residency():
    m = manager()
    assert m.allocate("gpu@g0", 1, "x1", gpu_action("x1", 1, service=None)) == C(0, 1)
    assert m.allocate("gpu@g0", 1, "x2", gpu_action("x2", 1, service=None)) == C(1, 1)
    assert m.allocate("gpu@g0", 2, "x3", gpu_action("x3", 2, service=None)) == C(2, 2)
    assert m.allocate("gpu@g0", 1, "x4", gpu_action("x4", 1)) == C(4, 1)
    m.restored("gpu@g0", "x4")
    m.release("gpu@g0", "x4")  # rm@dop1 stays resident on GPU 4; 4..7 merge back to one chunk
    m.release("gpu@g0", "x2")  # free: 1@1 and 4@4
    # splitting 4@4 would be a hit, but it would cost a 4-GPU chunk: the 1-chunk wins (a miss)
    assert m.allocate("gpu@g0", 1, "r", gpu_action("r", 1)) == C(1, 1)
    assert not m.lease("gpu@g0", "r").hit
    assert m.buddy("g0").free_chunks() == [C(4, 4)]
    m.check_invariants()


def test_lru_eviction_through_the_manager():
    m = manager(GpuNode("g0", 1, 100))
    for i, svc in enumerate(["rm", "judge", "rm"]):
        m.allocate("gpu@g0", 1, f"a{i}", gpu_action(f"a{i}", 1, service=svc))
        lease = m.lease("gpu@g0", f"a{i}")
        assert not lease.hit  # rm and judge (60 each) cannot share one 100-MiB GPU
        assert [e.service for e in lease.evict] == ([] if i == 0 else [["rm", "judge"][i - 1] + "@dop1"])
        m.restored("gpu@g0", f"a{i}", 0.01)
        m.release("gpu@g0", f"a{i}")
    s = m.stats()
    assert (s["hits"], s["misses"], s["evictions"]) == (0, 3, 2)
    assert s["nodes"]["gpu@g0"]["restores"] == 3


@pytest.mark.parametrize("pool, units, holder_twice, why", [
    ("gpu@nope", 1, False, "unknown pool"),  # a pool this manager does not own
    ("gpu@g0", 3, False, "1, 2, 4 or 8"),  # not a chunk size: the policy never asks for it
    ("gpu@g0", 1, True, "already holds"),  # a holder gets one chunk per pool
])
def test_bad_grants_raise_and_leak_nothing(pool, units, holder_twice, why):
    m = manager()
    if holder_twice:
        m.allocate("gpu@g0", 1, "x", gpu_action("x", 1))
    before = m.held()
    with pytest.raises(AllocationError, match=why):
        m.allocate(pool, units, "x", gpu_action("x", 1))
    assert m.held() == before
    m.check_invariants()


def test_no_free_chunk_raises_and_leaks_nothing():
    m = manager()
    m.allocate("gpu@g0", 1, "x", gpu_action("x", 1))
    with pytest.raises(AllocationError, match="no free chunk"):
        m.allocate("gpu@g0", 8, "y", gpu_action("y", 8))
    assert set(m.held()["gpu@g0"]) == {"x"}
    m.check_invariants()


def test_model_that_does_not_fit_at_that_dop_leaks_nothing():
    m = GpuManager([GpuNode("g0", 8, 100)], [ModelSpec("sharded", 300, sharded=True)])
    with pytest.raises(AllocationError, match="MiB per GPU"):
        m.allocate("gpu@g0", 2, "x", gpu_action("x", 2, service="sharded"))  # 150 per GPU at DoP 2
    assert m.held() == {"gpu@g0": {}}
    assert m.allocate("gpu@g0", 4, "y", gpu_action("y", 4, service="sharded")).size == 4  # 75 per GPU
    strict = GpuManager([GpuNode("g0", 8, 100)], unknown_model_mb=None)
    with pytest.raises(AllocationError, match="not registered"):
        strict.allocate("gpu@g0", 1, "z", gpu_action("z", 1, service="who"))
    assert strict.buddy("g0").free_devices == 8
    strict.check_invariants()


def test_release_is_idempotent_and_unconfirmed_restores_are_dropped():
    m = manager()
    m.allocate("gpu@g0", 2, "x", gpu_action("x", 2))
    assert m.release("gpu@g0", "x") is True
    assert m.release("gpu@g0", "x") is False
    assert m.release("gpu@nope", "x") is False
    # never confirmed: the executor failed or was cancelled mid-restore
    assert {p.name: p for p in m.pool_states()}["gpu@g0"].resident == frozenset()
    assert m.stats()["failed_restores"] == 1
    m.check_invariants()


def test_random_churn_keeps_every_invariant():
    rng = random.Random(5)
    m = manager(GpuNode("g0", 8, 100), GpuNode("g1", 4, 70))
    held: dict[str, tuple[str, Chunk]] = {}
    for step in range(500):
        if held and rng.random() < 0.5:
            h = rng.choice(sorted(held))
            pool, _ = held.pop(h)
            if rng.random() < 0.8:
                m.restored(pool, h, 0.01)
            assert m.release(pool, h)
        else:
            pool = rng.choice(["gpu@g0", "gpu@g1"])
            units = rng.choice([1, 1, 2, 4, 8])
            svc = rng.choice(["rm", "judge", "tiny", None])
            try:
                c = m.allocate(pool, units, f"h{step}", gpu_action(f"h{step}", units, service=svc))
            except AllocationError:
                continue
            for p2, c2 in held.values():
                assert p2 != pool or c.end <= c2.start or c2.end <= c.start
            held[f"h{step}"] = (pool, c)
        m.check_invariants()
    for h, (pool, _) in held.items():
        m.release(pool, h)
    m.check_invariants()
    assert all(not h for h in m.held().values())


# --------------------------------------------------------------------------- #
# engine level


def gpu_engine(nodes=None, params=None):
    clock = Clock()
    mgr = GpuManager(nodes or [GpuNode("g0", 8, 100)], MODELS)
    return Engine([mgr], clock=clock, params=params or PolicyParams()), mgr, clock


def _valid_and_disjoint(started_or_running):
    by_pool: dict[str, list[Chunk]] = {}
    for grants, units in started_or_running:
        for pool, c in grants.items():
            assert isinstance(c, Chunk)
            assert c.size == units and c.start % c.size == 0 and c.size in (1, 2, 4, 8)
            by_pool.setdefault(pool, []).append(c)
    for chunks in by_pool.values():
        chunks.sort()
        for a, b in zip(chunks, chunks[1:]):
            assert a.end <= b.start, f"overlapping chunks {a} {b}"


def test_engine_places_valid_chunks_and_leaks_nothing_after_cancel():
    eng, mgr, clock = gpu_engine([GpuNode("g0", 8, 100), GpuNode("g1", 8, 100)])
    started = []
    for i in range(12):
        started += eng.submit(gpu_action(f"a{i}", service=["rm", "judge", "tiny"][i % 3], t1=4.0 + i))
        eng.check_invariants()
    assert started
    _valid_and_disjoint((r.grants, r.dispatch.units["gpu"]) for r in eng.running.values())
    # the engine's grant is the manager's chunk, and the manager's lease names the service at that DoP
    for s in started:
        (pool, chunk), = s.grants.items()
        lease = mgr.lease(pool, s.action.id)
        assert lease.chunk == chunk and lease.service == service_name(s.action.service, chunk.size)
    # cancel everything, running and waiting: no chunk, no lease, no busy device left
    for rec in list(eng.running.values()) + list(eng.waiting.values()):
        if rec.id in eng.running or rec.id in eng.waiting:
            for s in eng.cancel(rec.id):
                _valid_and_disjoint([(s.grants, s.dispatch.units["gpu"])])
        eng.check_invariants()
    # whatever the cancels started is cancelled too
    while eng.running:
        eng.cancel(next(iter(eng.running)))
    assert not eng.waiting
    assert all(not h for h in mgr.held().values())
    for p in mgr.pool_states():
        assert p.free == 8 and p.chunks == (8,)
        assert mgr.cache(p.name).busy() == {}
    mgr.check_invariants()


def test_engine_completion_cycle_hits_the_cache():
    eng, mgr, clock = gpu_engine([GpuNode("g0", 2, 100)])
    seen = []
    pending = eng.submit(gpu_action("a0", (1,), t1=1.0))
    for i in range(1, 6):
        pending += eng.submit(gpu_action(f"a{i}", (1,), t1=1.0))
    while pending or eng.running:
        for s in pending:
            (pool, chunk), = s.grants.items()
            lease = mgr.lease(pool, s.action.id)
            seen.append(lease.hit)
            if not lease.hit:
                mgr.restored(pool, s.action.id, 0.05)  # what the executor reports after restoring
        clock.t += 1.0
        done = next(iter(eng.running))
        pending = eng.complete(done)
        eng.check_invariants()
    assert seen.count(False) <= 2  # one restore per GPU at most, then hits
    assert mgr.stats()["hits"] == seen.count(True) >= 4
    assert {p.name: p for p in mgr.pool_states()}["gpu@g0"].resident == {"rm@dop1"}


def test_engine_rejects_dops_no_node_has():
    from tangram.core.errors import UnschedulableError

    eng, _, _ = gpu_engine([GpuNode("g0", 4, 100)])
    with pytest.raises(UnschedulableError):
        eng.submit(gpu_action("x", 8))


# --------------------------------------------------------------------------- #
# the simulated executor follows the manager's decisions and returns durations

from tangram.executors.simulated_gpu import SimGpuParams, SimulatedGpuExecutor  # noqa: E402


def test_simulated_executor_durations_follow_hits_misses_and_dop():
    params = SimGpuParams(memory_mb_per_gpu=100, restore_gbps=1.0, restore_overhead_s=0.5,
                          batch_latency_s=0.1, batch_size=4)
    m = manager(GpuNode("g0", 2, 100))
    sim = SimulatedGpuExecutor(2, params)

    def go(i, svc, dop, n):
        m.allocate("gpu@g0", dop, f"a{i}", gpu_action(f"a{i}", dop, service=svc))
        lease = m.lease("gpu@g0", f"a{i}")
        t = sim.run(lease, n)
        m.restored("gpu@g0", f"a{i}", t.restore_s)
        m.release("gpu@g0", f"a{i}")
        assert set(sim.resident()) == {(x.service, x.chunk.start) for x in m.cache("g0").instances()}
        return t

    t1 = go(1, "rm", 1, 9)
    assert not t1.hit and t1.restore_s == pytest.approx(0.5 + 60 * 2**20 / 1e9)
    assert t1.exec_s == pytest.approx(0.3)  # ceil(9 / 4) batches
    t2 = go(2, "rm", 1, 9)
    assert t2.hit and t2.restore_s == 0.0 and t2.total_s == pytest.approx(0.3)
    t3 = go(3, "rm", 2, 9)  # another service (DoP 2): a miss; data-parallel halves the batches
    assert not t3.hit and t3.exec_s == pytest.approx(0.2)
    assert t3.evicted == ("rm@dop1",)  # 60 + 60 > 100 on GPU 0
    assert sim.used_mb() == [60, 60]
    from tangram.managers.service_cache import CacheDecision

    plain = CacheDecision("x", None, Chunk(0, 2), hit=True)  # a GPU action without a service
    assert sim.run(plain, 4, exec_s=7.0).total_s == 7.0


def test_simulated_executor_catches_books_that_overflow_memory():
    from tangram.managers.service_cache import CacheDecision

    sim = SimulatedGpuExecutor(1, SimGpuParams(memory_mb_per_gpu=100))
    sim.run(CacheDecision("a", "rm@dop1", Chunk(0, 1), hit=False, restore_mb_per_device=60))
    with pytest.raises(MemoryError):  # the books forgot to evict rm: an error, not optimistic timing
        sim.run(CacheDecision("b", "judge@dop1", Chunk(0, 1), hit=False, restore_mb_per_device=60))
    assert sim.resident() == [("rm@dop1", 0)] and sim.used_mb() == [60]
    with pytest.raises(AssertionError, match="not resident"):
        sim.run(CacheDecision("c", "judge@dop1", Chunk(0, 1), hit=True))


async def test_simulated_executor_async_sleeps_and_undoes_a_cancelled_restore():
    import asyncio

    from tangram.managers.service_cache import CacheDecision

    slept = []

    async def fake_sleep(s):
        slept.append(s)

    sim = SimulatedGpuExecutor(2, SimGpuParams(restore_gbps=1.0, batch_latency_s=0.25, batch_size=1))
    t = await sim.execute(CacheDecision("a", "rm@dop1", Chunk(0, 1), hit=False, restore_mb_per_device=10), 2,
                          sleep=fake_sleep)
    assert slept == [t.restore_s, 0.5]

    async def never(s):
        await asyncio.sleep(3600)

    task = asyncio.create_task(sim.execute(
        CacheDecision("b", "judge@dop1", Chunk(1, 1), hit=False, restore_mb_per_device=10), sleep=never))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sim.resident() == [("rm@dop1", 0)]  # judge's half restore is gone
    assert sim._busy == {}


def test_restore_estimate_follows_the_measured_bandwidth():
    m = GpuManager([GpuNode("g0", 8, 100)], [ModelSpec("rm", 60, sharded=True), ModelSpec("tiny", 10)])
    assert m.restore_estimate("rm") == {}  # nothing measured yet: no charge
    m.allocate("gpu@g0", 2, "x", gpu_action("x", 2))
    m.lease("gpu@g0", "x")
    m.restored("gpu@g0", "x", 3.0)  # 2 x 30 MiB moved in 3 s: 20 MiB/s
    m.release("gpu@g0", "x")
    est = m.restore_estimate("rm")
    assert est[2] == pytest.approx(60 / 20) and est[1] == pytest.approx(60 / 20)
    assert m.restore_estimate("tiny")[4] == pytest.approx(4 * 10 / 20)  # replicated: every device loads it
    assert m.restore_estimate("unknown") == {}
