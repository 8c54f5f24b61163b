"""A stale profile heals online: the observed T1 reaches the policy's DoP choice and estimates.

The workload: a node of 8 cores; each round a non-scalable action of known
duration holds half of it for 5 s, then an elastic action (Amdahl, 5%
serial, true T1 60 s) arrives. With the true profile the policy waits the
5 s for all 8 cores (10.1 s at DoP 8, 15.1 s in all) rather than start at
DoP 4 now (17.25 s). A profile 3x too optimistic (T1 20 s) makes DoP 4 now
look better (5.75 s); after ``refine_after`` runs the engine uses the
observed T1, and the choices and estimates must match the true profile's.
"""
from __future__ import annotations

import pytest

from tangram.core.engine import Engine
from tangram.core.estimator import DurationEstimator
from tangram.core.model import Action, Elasticity
from tangram.managers.base import CountingManager
from tests.helpers import FakeClock

TRUE_T1 = 60.0
ELASTICITY = Elasticity.amdahl(0.05)
CORES = 8
BLOCKER_S = 5.0


def _rounds(profile_t1: float, n: int, estimator: DurationEstimator | None = None) -> list[tuple[int, float]]:
    """(DoP, estimated seconds) of the elastic action in each of ``n`` rounds; runs take their true time."""
    clock = FakeClock()
    eng = Engine([CountingManager({"cpu@n0": CORES, "mem@n0": 10_000})], clock=clock, estimator=estimator)
    out = []
    for i in range(n):
        blocker = Action.build(f"b{i}", {"cpu": CORES // 2}, action_class="blocker", t1_s=BLOCKER_S)
        eng.submit(blocker)
        suite = Action.build(f"s{i}", {"cpu": {"min": 1, "max": CORES}}, action_class="suite",
                             t1_s=profile_t1, elasticity=ELASTICITY)
        started = eng.submit(suite)
        if not any(s.action.id == suite.id for s in started):  # it waits for the whole node
            clock.advance(BLOCKER_S)
            started = eng.complete(blocker.id)
        s = next(s for s in started if s.action.id == suite.id)
        true_s = ELASTICITY.duration(TRUE_T1, s.dispatch.dop)
        if blocker.id in eng.running:  # both run; the blocker ends first
            clock.advance(BLOCKER_S)
            eng.complete(blocker.id)
            clock.advance(true_s - BLOCKER_S)
        else:
            clock.advance(true_s)
        eng.complete(suite.id)
        eng.check_invariants()
        out.append((s.dispatch.dop, s.dispatch.estimated_s))
    return out


def test_the_true_profile_waits_for_the_whole_node():
    dops = [d for d, _ in _rounds(TRUE_T1, 4)]
    assert dops == [CORES] * 4


def test_a_profile_three_times_too_optimistic_converges_to_the_true_choices():
    est = DurationEstimator(refine_after=3)
    truth = _rounds(TRUE_T1, 8)
    seen = _rounds(TRUE_T1 / 3, 8, est)
    # before any run: the optimistic profile starts at half the node and underestimates 3x
    assert seen[0][0] == CORES // 2
    assert seen[0][1] == pytest.approx(ELASTICITY.duration(TRUE_T1 / 3, CORES // 2))
    # after refine_after runs the observed T1 is used: same DoP and estimate as the true profile
    assert est.refined_t1("suite") == pytest.approx(TRUE_T1, rel=1e-6)
    for (dop, estimate), (true_dop, true_estimate) in zip(seen[3:], truth[3:]):
        assert dop == true_dop == CORES
        assert estimate == pytest.approx(true_estimate, rel=0.01)


def test_refinement_waits_for_enough_runs():
    est = DurationEstimator(refine_after=5)
    seen = _rounds(TRUE_T1 / 3, 5, est)
    assert [d for d, _ in seen] == [CORES // 2] * 5  # four observed runs are not enough yet


def _suite(t1: float) -> Action:
    return Action.build("s", {"cpu": {"min": 1, "max": CORES}}, action_class="suite", t1_s=t1, elasticity=ELASTICITY)


def _observe(est: DurationEstimator, t1s) -> None:
    for t1 in t1s:  # runs at DoP 1: the observed T1 is the run's time
        est.observe(_suite(TRUE_T1), 1, t1)


def test_noisy_runs_around_an_accurate_profile_do_not_replace_it():
    # lognormal-like draws of a class whose profile is right (mean 60 s): three runs average 80 s,
    # well within their own spread, so the profile stands
    est = DurationEstimator(refine_after=3)
    _observe(est, [30.0, 150.0, 60.0])
    assert est.refined_t1("suite") == pytest.approx(80.0)
    assert est.refine(_suite(TRUE_T1)).t1_s == TRUE_T1


def test_a_stale_profile_heals_once_the_runs_say_so_beyond_their_noise():
    est = DurationEstimator(refine_after=3)
    draws = [55.0, 70.0, 62.0, 48.0, 66.0, 59.0]  # mean 60 s, sd 7.7 s
    _observe(est, draws[:3])
    # a profile 3x too optimistic is 14 standard errors off after three runs: replaced
    assert est.refine(_suite(TRUE_T1 / 3)).t1_s == pytest.approx(sum(draws[:3]) / 3)
    # one 5% off is not (about one standard error), not even after six runs
    _observe(est, draws[3:])
    assert est.refine(_suite(TRUE_T1 * 1.05)).t1_s == TRUE_T1 * 1.05
    # with no margin every refined class takes its observed mean, as before
    loose = DurationEstimator(refine_after=3, refine_margin=0.0)
    _observe(loose, draws[:3])
    assert loose.refine(_suite(TRUE_T1 * 1.05)).t1_s == pytest.approx(sum(draws[:3]) / 3)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_bad_refine_margin_is_refused(bad):
    with pytest.raises(ValueError, match="refine_margin"):
        DurationEstimator(refine_margin=bad)


def test_an_estimator_of_plain_means_has_a_standard_error_too():
    est = DurationEstimator(min_weight=0.0)  # no EMA: the plain mean of every run
    for t1 in (55.0, 70.0, 62.0):
        est.observe(_suite(TRUE_T1), 1, t1)
    assert est.refine(_suite(TRUE_T1 / 3)).t1_s == pytest.approx(62.33, rel=1e-3)
