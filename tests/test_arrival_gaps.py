"""When a trajectory in generation is expected back (tangram.core.gaps): the recent gaps' mean
residual life, and the engine's view of it under ``PolicyParams.arrival_gap``."""
from __future__ import annotations

import random

import pytest

from tangram.core.gaps import GapSample, ResidualGaps
from tangram.core.generating import Generating, UpcomingView
from tangram.policy.schedule import plan
from tangram.policy.snapshot import PolicyParams
from tangram.service.config import ConfigError, parse_config

from tests.helpers import make_action, make_engine, make_node, one_node_snapshot


def test_the_residual_is_the_mean_of_the_gaps_that_outlast_the_quiet_time():
    gaps = ResidualGaps((1.0, 2.0, 3.0, 10.0))
    assert gaps.residual(0.0) == pytest.approx(4.0)  # not quiet yet: the mean gap
    assert gaps.residual(2.5) == pytest.approx((3.0 + 10.0) / 2 - 2.5)  # only 3 and 10 outlast 2.5 s
    assert gaps.residual(9.0) == pytest.approx(1.0)
    assert gaps.residual(10.0) is None  # quiet as long as the longest: nothing says when it comes
    assert gaps.residual(50.0) is None


def test_the_residual_matches_a_brute_force_reading():
    rng = random.Random(3)
    for _ in range(200):
        sample = sorted(rng.lognormvariate(0.0, 1.0) for _ in range(rng.randint(1, 40)))
        gaps = ResidualGaps(tuple(sample))
        q = rng.uniform(0.0, 1.2 * sample[-1])
        outlast = [g - q for g in sample if g > q]
        got = gaps.residual(q)
        assert (got is None) == (not outlast)
        if outlast:
            assert got == pytest.approx(sum(outlast) / len(outlast))


def test_the_sample_keeps_the_latest_gaps_and_republishes_past_its_band():
    sample = GapSample(window=20, band=0.1)
    assert sample.published is None
    assert sample.add(5.0) is True and sample.published.residual(0.0) == 5.0  # the first: published
    for g in range(1, 9):  # while under ten gaps, every one is more than 10% of the sample
        assert sample.add(float(g)) is True
    published = sample.published
    assert sample.add(9.0) is False and sample.published is published  # the tenth: 10%, not more
    moved = [sample.add(100.0) for _ in range(30)]
    assert not all(moved) and any(moved)  # past ten gaps: one publication per 10% new
    assert sample.published is not published
    sample.add(100.0)
    while not sample.add(100.0):
        pass
    # the window: only the latest 20 gaps remain, all 100 s
    assert sample.published.residual(0.0) == pytest.approx(100.0) and len(sample.published) == 20
    with pytest.raises(ValueError, match="window"):
        GapSample(window=0)


def _quiet_node(mode: str):
    """A 4-core node whose 8 trajectories measured gaps of 0.2 s, then went quiet for 10 s."""
    eng, clock = make_engine(make_node("n0", cores=4), params=PolicyParams(arrival_gap=mode))
    for i in range(8):
        eng.submit(make_action(f"a{i}", cpu=1, t1=0.5, trajectory=f"t{i}", cls="shell"))
        clock.advance(0.1)
        eng.complete(f"a{i}")
    for i in range(8):
        clock.advance(0.2)
        eng.submit(make_action(f"b{i}", cpu=1, t1=0.5, trajectory=f"t{i}", cls="shell"))
        eng.complete(f"b{i}")
    clock.advance(10.0)
    return eng, clock


def test_a_trajectory_quiet_past_every_gap_holds_no_cores_back():
    # under the mean gap, eight trajectories quiet for 50 times their gaps are each expected now,
    # for as long as they stay quiet: a reward arriving to the idle node leaves them half of it
    reward = make_action("R", cpu={"min": 1, "max": 4}, t1=32.0, serial=0.0, cls="reward", trajectory="t9")
    eng, _ = _quiet_node("mean")
    assert [seconds for seconds, _ in eng.snapshot().upcoming["n0"]] == [0.0] * 8
    assert [dict(s.dispatch.units) for s in eng.submit(reward)] == [{"cpu": 2}]
    # under the residual gap, no gap measured outlasts them: none is expected, the reward takes all 4
    eng, _ = _quiet_node("residual")
    assert not eng.snapshot().upcoming.get("n0")
    assert [dict(s.dispatch.units) for s in eng.submit(reward)] == [{"cpu": 4}]


def test_the_view_shows_the_soonest_of_those_some_gap_outlasts():
    g = Generating()
    a = make_action("x", cpu=1, trajectory="t0")
    for i, gap in enumerate((1.0, 3.0, 8.0)):  # three gaps measured on one trajectory
        g.ended(a, "n0", 10.0 * i)
        g.submitted(a, 10.0 * i + gap, residual=True)
    g.ended(a, "n0", 40.0)  # t0 quiet since 40
    for name, since in (("t1", 45.0), ("t2", 47.5), ("t3", 49.0)):
        g.submitted(make_action(f"{name}-a", cpu=1, trajectory=name), since - 1.0, residual=True)
        g.ended(make_action(f"{name}-a", cpu=1, trajectory=name), "n0", since)
    view = g.view(49.5, 2, residual=True)
    # t0: quiet 9.5 s, past every gap: not shown; t1: 4.5 s (only 8 outlasts: 3.5 s more);
    # t2: 2 s (3 and 8: 3.5 s more); t3: 0.5 s (all three: 3.5 s more); the limit is 2, in the order
    # they went quiet, then soonest first
    assert [(s, a.trajectory) for s, a in view["n0"]] == [(pytest.approx(3.5), "t1"), (pytest.approx(3.5), "t2")]
    gaps, entries = view.inputs("n0")
    assert gaps is g.published_gaps and [a.trajectory for _, a in entries] == ["t1", "t2"]
    # the mean-gap view of the same trajectories: t0 first, expected now (overdue)
    mean_view = g.view(49.5, 2)
    assert [a.trajectory for _, a in mean_view["n0"]] == ["t0", "t1"] and mean_view["n0"][0][0] == 0.0


def test_the_residual_view_is_sorted_soonest_first():
    quiet = {"n0": {"t0": (0.0, make_action("a0", cpu=1, trajectory="t0")),
                    "t1": (9.0, make_action("a1", cpu=1, trajectory="t1"))}}
    gaps = ResidualGaps((2.0, 12.0))
    # t0 quiet 10 s: 12 outlasts it by 2 s; t1 quiet 1 s: (2 + 12) / 2 - 1 = 6 s
    view = UpcomingView(quiet, 7.0, 10.0, 32, gaps)
    assert [(s, a.id) for s, a in view["n0"]] == [(pytest.approx(2.0), "a0"), (pytest.approx(6.0), "a1")]
    assert UpcomingView(quiet, 7.0, 10.0, 0, gaps)["n0"] == ()


def test_residual_republication_moves_every_node_and_mean_keeps_its_band():
    g = Generating()
    a = make_action("x", cpu=1, trajectory="t")
    g.submitted(a, 0.0, residual=True)  # its first action: no gap yet
    g.ended(a, "n0", 1.0)
    assert g.submitted(a, 3.0, residual=True) is True  # the first gap publishes both
    g.ended(a, "n0", 4.0)
    # a second gap equal to the first: the mean stays (its band), the sample republishes (1 of 2 new)
    assert g.submitted(a, 6.0, residual=False) == "n0"
    g.ended(a, "n0", 7.0)
    assert g.submitted(a, 9.0, residual=True) is True


def test_the_planner_reads_the_residual_view_as_it_reads_the_mean_one():
    reward = make_action("R", cpu={"min": 1, "max": 16}, t1=32.0, serial=0.0, cls="reward")
    quiet = {"n0": {f"t{i}": (0.0, make_action(f"s{i}", cpu=1, t1=2.0, trajectory=f"t{i}", cls="shell"))
                    for i in range(8)}}
    # quiet 0.5 s of gaps of 0.5 s: the residual is 0, as the mean gap's: the same headroom
    for gaps in (None, ResidualGaps((0.5 + 1e-9,))):
        snap = one_node_snapshot([reward], upcoming=UpcomingView(quiet, 0.5, 0.5, 32, gaps))
        assert {d.action.id: dict(d.units) for d in plan(snap).dispatches} == {"R": {"cpu": 8}}


def test_arrival_gap_is_validated_and_configurable():
    with pytest.raises(ValueError, match="arrival_gap"):
        PolicyParams(arrival_gap="median")
    cfg = parse_config({"scheduler": {"arrival_gap": "mean"},
                        "cpu_nodes": [{"name": "n0", "cores": 2, "memory_mb": 1024}]})
    assert cfg.arrival_gap == "mean"
    with pytest.raises(ConfigError) as e:
        parse_config({"scheduler": {"arrival_gap": "soon"},
                      "cpu_nodes": [{"name": "n0", "cores": 2, "memory_mb": 1024}]})
    assert e.value.field == "scheduler.arrival_gap"
