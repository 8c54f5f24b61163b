"""What the policy reads of the running estimates moves only when they move by more than a band:
smaller moves are noise, and each republication re-decides the held-out groups that read it."""
from __future__ import annotations

import pytest

from tangram.core.estimator import DurationEstimator
from tangram.core.generating import Generating
from tests.helpers import make_action


def test_a_class_estimate_is_republished_only_beyond_the_band():
    est = DurationEstimator(publish_band=0.1, publish_margin=0.0)  # the band alone
    a = make_action("a", cpu=1, cls="shell")
    assert est.observe(a, 1, 10.0) and est.class_estimates() == {"shell": 10.0}  # a new class: published
    view = est.class_estimates()
    assert not est.observe(a, 1, 11.0)  # mean 10.5: within 10% of 10
    assert est.class_estimates() is view and est.mean_duration("shell") == pytest.approx(10.5)
    assert view["shell"] == 10.0  # what the policy reads did not move
    assert est.observe(a, 1, 14.0)  # mean 11.67: beyond
    assert est.class_estimates()["shell"] == pytest.approx(35.0 / 3)
    assert not est.observe(a, 1, 0.0)  # no run to count


def test_band_zero_publishes_every_move_and_the_band_is_checked():
    est = DurationEstimator(publish_band=0.0, publish_margin=0.0)
    a = make_action("a", cpu=1, cls="shell")
    est.observe(a, 1, 1.0)
    assert est.observe(a, 1, 1.01) and est.class_estimates()["shell"] == pytest.approx(1.005)
    with pytest.raises(ValueError, match="publish_band"):
        DurationEstimator(publish_band=1.0)
    with pytest.raises(ValueError, match="publish_margin"):
        DurationEstimator(publish_margin=-1.0)


def test_a_noisy_class_is_republished_only_beyond_its_own_noise():
    est = DurationEstimator()  # 10% and 2 standard errors
    a = make_action("a", cpu=1, cls="tests")
    est.observe(a, 1, 10.0)
    # 10, 2, 30: mean 14 (40% above what was published) but a standard error of 8.3 s: noise
    assert not est.observe(a, 1, 2.0) and not est.observe(a, 1, 30.0)
    assert est.class_estimates()["tests"] == 10.0 and est.mean_duration("tests") == pytest.approx(14.0)
    # runs that agree move it: 10 then 14, 13, 14 (the mean 12, 12.33, 12.75; standard error 2, 1.2, 0.95)
    steady = DurationEstimator()
    steady.observe(a, 1, 10.0)
    assert not steady.observe(a, 1, 14.0) and not steady.observe(a, 1, 13.0)  # within two of them
    assert steady.observe(a, 1, 14.0)  # 2.75 beyond 10 is about three standard errors: a move
    assert steady.class_estimates()["tests"] == pytest.approx(12.75)


def test_the_generation_gap_is_republished_only_beyond_the_band():
    g = Generating()
    a = make_action("a", cpu=1, trajectory="t")

    def gap_of(now_quiet, now_back):  # its action ends (quiet), its next one comes back
        g.ended(a, "n0", now_quiet)
        return g.submitted(a, now_back)

    assert g.submitted(a, -1.0) is False  # its first action: no gap yet

    assert g.published_gap_s is None
    assert gap_of(0.0, 2.0) is True and g.published_gap_s == 2.0  # the first gap: every node's arrivals move
    assert gap_of(10.0, 12.3) == "n0"  # mean 2.15: within 10%; only n0 lost an expected arrival
    assert g.published_gap_s == 2.0 and g.mean_gap_s == pytest.approx(2.15)
    assert gap_of(20.0, 23.5) is True  # mean 2.6: beyond
    assert g.published_gap_s == pytest.approx(2.6)
    g.ended(a, "n0", 24.0)  # quiet again: expected back at 24 + the published gap
    view = g.view(25.0, 4)
    assert view.inputs("n0")[0] == pytest.approx(2.6)  # what the policy sees
    assert view["n0"][0][0] == pytest.approx(1.6)


def test_republishing_updates_one_read_only_view_in_place():
    """A republication writes one entry of the view snapshots read, never a copy of every class: a
    copy per new class made a client that names a class per action cost O(actions so far) per
    completion (scripts/bench_many_classes.py measures it)."""
    est = DurationEstimator(publish_band=0.0, publish_margin=0.0)
    view = est.class_estimates()
    for i in range(50):
        assert est.observe(make_action(f"a{i}", cpu=1, cls=f"c{i}"), 1, 1.0 + i)
        assert est.class_estimates() is view
    assert len(view) == 50 and view["c49"] == 50.0
    with pytest.raises(TypeError):
        view["c0"] = 0.0  # read only: only the estimator publishes


def test_the_estimator_keeps_the_most_recently_observed_classes():
    """A client naming a new class per action must not grow the estimator without bound: beyond
    ``max_classes`` the least recently observed class is dropped, and reported as moved."""
    est = DurationEstimator(max_classes=3)
    obs = lambda cls, s: est.observe(make_action(f"{cls}-{s}", cpu=1, cls=cls), 1, s)  # noqa: E731
    assert obs("a", 1.0) == ("a",) and obs("b", 2.0) == ("b",) and obs("c", 3.0) == ("c",)
    assert obs("a", 1.0) == ()  # a seen again (same mean: not republished): now the most recent
    assert obs("d", 4.0) == ("d", "b")  # b, the least recently observed, makes room
    assert dict(est.class_estimates()) == {"c": 3.0, "a": 1.0, "d": 4.0} and est.classes() == 3
    assert est.samples("b") == 0 and est.mean_duration("b") is None and est.samples("a") == 2
    for i in range(1000):
        obs(f"x{i}", 1.0)
    assert est.classes() == len(est.class_estimates()) == 3 and len(est._t1) <= 3
    with pytest.raises(ValueError, match="max_classes"):
        DurationEstimator(max_classes=0)
