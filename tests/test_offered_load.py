"""The offered-load DoP cap (tangram.policy.offered_load) and its books (tangram.core.offered)."""
from __future__ import annotations

import pytest

from tangram.core import offered
from tangram.core.engine import Engine
from tangram.core.model import Action, Elasticity
from tangram.core.offered import OfferedLoad
from tangram.managers.gpu import GpuManager, GpuNode, ModelSpec
from tangram.policy.offered_load import offered_load_cap
from tangram.policy.snapshot import PolicyParams
from tangram.service.config import parse_config
from tests.helpers import FakeClock, make_action, make_engine, make_node


def teacher(id, *, t1=4.0, serial=0.3):
    return Action.build(id, {"gpu": [1, 2, 4, 8]}, service="rm", t1_s=t1, elasticity=Elasticity.amdahl(serial),
                        action_class="teacher")


def test_load_is_the_work_of_the_window_over_the_capacity():
    books = OfferedLoad()
    assert books.load("gpu", 0.0, 10.0, 8) is None  # nothing submitted yet
    books.add("gpu", 0.0, 8.0)
    assert books.load("gpu", 0.0, 10.0, 8) is None  # no time span since the first submission
    books.add("gpu", 2.0, 8.0)
    assert books.load("gpu", 2.0, 10.0, 8) == pytest.approx(16.0 / (2.0 * 8))  # the span since the first
    books.add("gpu", 12.0, 4.0)
    # the last 5 s hold only the submission at 12 s; the last 10 s that at 2 s too (its edge included)
    assert books.load("gpu", 12.0, 5.0, 8) == pytest.approx(4.0 / (5.0 * 8))
    assert books.load("gpu", 12.0, 10.0, 8) == pytest.approx(12.0 / (10.0 * 8))
    assert books.load("cpu", 12.0, 10.0, 8) is None  # per type
    assert books.load("gpu", 12.0, 10.0, 0) is None


def test_a_window_back_to_the_first_submission_counts_it():
    """``now - (now - first)`` can round past ``first`` (0.3 here): the first submission still counts."""
    books = OfferedLoad()
    books.add("gpu", 0.3, 5.0)
    books.add("gpu", 1.0, 5.0)
    assert 1.0 - (1.0 - 0.3) > 0.3  # the rounding this test is about
    assert books.load("gpu", 1.0, 10.0, 1) == pytest.approx(10.0 / 0.7)
    books.add("gpu", 1.0, 5.0)  # at the same instant: both count, and the first
    assert books.load("gpu", 1.0, 10.0, 1) == pytest.approx(15.0 / 0.7)


def test_the_books_stay_bounded_and_keep_the_latest(monkeypatch):
    monkeypatch.setattr(offered, "MAX_KEPT", 4)
    books = OfferedLoad()
    for t in range(20):
        books.add("gpu", float(t), 1.0)
    b = books._books["gpu"]
    assert len(b.times) <= 8 and len(b.cumulative) == len(b.times) + 1
    assert books.load("gpu", 19.0, 3.0, 1) == pytest.approx(4.0 / 3.0)  # 16..19 are still there
    assert b.first == 0.0


def test_the_cap_is_the_widest_dop_efficient_enough_for_the_load():
    a = teacher("a")  # Amdahl 0.3: E(m) = 1 / (0.3 m + 0.7): E(2) = 0.77, E(4) = 0.53, E(8) = 0.32
    assert offered_load_cap(a, "gpu", None, 0.5) is None  # nothing measured: no cap
    assert offered_load_cap(a, "gpu", 0.5, 0.5) is None  # E(8) >= 0.25: every DoP
    assert offered_load_cap(a, "gpu", 1.2, 0.5).options == (1, 2)  # 0.6: E(2) = 0.77 is, E(4) = 0.53 is not
    assert offered_load_cap(a, "gpu", 3.0, 0.5).options == (1,)  # 1.5: none but the smallest
    assert offered_load_cap(a, "gpu", 3.0, 0.0) is None  # factor 0: off


def test_a_burst_of_gpu_requests_is_capped_and_a_lone_one_is_not():
    clock = FakeClock()
    engine = Engine([GpuManager([GpuNode("g0", 8, 80_000)], [ModelSpec("rm", 10_000)])], clock=clock)
    engine.submit(teacher("first"))
    assert engine.record("first").action.demands["gpu"].max == 8  # no time span to measure a rate over
    for i in range(8):  # eight requests of 4 GPU-seconds at one GPU within 0.8 s, on 8 GPUs
        clock.t += 0.1
        engine.submit(teacher(f"r{i}"))
    # r7 at 0.8 s: 9 x 4 GPU-seconds over 0.8 s x 8 GPUs, a load of 5.6: only E(1) = 1 >= 2.8
    assert engine.record("r7").action.demands["gpu"].options == (1,)
    assert engine.record("r7").action.key == "gpu"  # still elastic in kind: its class's T1 is learnt from it
    late = Engine([GpuManager([GpuNode("g0", 8, 80_000)], [ModelSpec("rm", 10_000)])], clock=clock)
    late.submit(teacher("a"))
    clock.t += 100.0  # one request every 100 s: a load far below the capacity
    late.submit(teacher("b"))
    assert late.record("b").action.demands["gpu"].max == 8


def test_off_and_on_cpu_only_when_asked():
    clock = FakeClock()
    engine = Engine([GpuManager([GpuNode("g0", 8, 80_000)], [ModelSpec("rm", 10_000)])], clock=clock,
                    params=PolicyParams(offered_load_caps={}))
    for i in range(9):
        engine.submit(teacher(f"r{i}"))
        clock.t += 0.1
    assert all(engine.record(f"r{i}").action.demands["gpu"].max == 8 for i in range(9))
    cpu, clock = make_engine(make_node(cores=16))
    for i in range(9):
        cpu.submit(make_action(f"c{i}", cpu={"min": 1, "max": 16}, t1=20.0, serial=0.3))
        clock.t += 0.1
    assert cpu.record("c8").action.demands["cpu"].max == 16  # the default caps GPU actions alone
    cpu, clock = make_engine(make_node(cores=16), params=PolicyParams(offered_load_caps={"cpu": 0.5}))
    for i in range(9):
        cpu.submit(make_action(f"c{i}", cpu={"min": 1, "max": 16}, t1=20.0, serial=0.3))
        clock.t += 0.1
    assert cpu.record("c8").action.demands["cpu"].max < 16


@pytest.mark.parametrize("bad, says", [({"gpu": -1.0}, "'gpu'"), ({"gpu": float("inf")}, "'gpu'"),
                                       ({"gpu": True}, "'gpu'"), ([("gpu", 0.5)], "must map"),
                                       ({1: 0.5}, "a key must name a resource type")])
def test_the_knob_is_validated(bad, says):
    with pytest.raises(ValueError, match="offered_load_caps") as e:
        PolicyParams(offered_load_caps=bad)
    assert says in str(e.value)


def _config(**scheduler):
    return parse_config({"cpu_nodes": [], "gpu_nodes": [], "api_pools": {"search": {"concurrency": 2}},
                         "scheduler": scheduler})


async def test_the_service_config_reaches_the_engine():
    from tangram.service.build import build_runtime

    assert _config().offered_load_caps == dict(PolicyParams().offered_load_caps) == {"gpu": 0.5}
    for given, expected in (({}, {}), ({"cpu": 1}, {"cpu": 1.0}), (None, {"gpu": 0.5})):
        cfg = _config() if given is None else _config(offered_load_caps=given)
        assert cfg.offered_load_caps == expected
        async with await build_runtime(cfg) as rt:
            assert dict(rt.engine.params.offered_load_caps) == expected
