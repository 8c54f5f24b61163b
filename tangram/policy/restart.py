"""When to stop a straggling elastic run and start it again at a wider DoP.

An elastic action's DoP is fixed when it starts (pytest-xdist cannot add workers to a running
session). One that started at a narrow DoP while a queue stood keeps it after the queue has
drained, and if its own duration is in its class's long tail it runs alone on an idle node and
sets the step. Such a run can only be stopped and run again from the start. The policy knows
its class's mean single-unit duration ``T1`` and the spread of its runs, not this run's length,
so it reasons on the class's distribution (lognormal, the usual model of task durations): a run
that has done work ``x`` (in ``T1`` seconds) has ``T1 > x``, and is expected to need
``E[T1 - x | T1 > x]`` more. Started again at DoP ``M`` it needs ``E[T1 | T1 > x] / speedup(M)``.
A run is restarted when that is at most ``gain`` of its expected time left where it is.

Only actions their submitter marked ``restartable`` are considered (a reward that reads its
environment and changes nothing a second run depends on, such as a test suite).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

_SQRT2 = math.sqrt(2.0)


def _upper_tail(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / _SQRT2)


def expected_beyond(mean: float, cv: float, x: float) -> float | None:
    """``E[T | T > x]`` for a lognormal ``T`` of this mean and coefficient of variation.

    None where the lognormal is degenerate (cv 0) and ``x`` is past its one value.
    """
    if x <= 0:
        return mean
    if cv <= 0:
        return mean if x < mean else None
    s2 = math.log1p(cv * cv)
    s = math.sqrt(s2)
    mu = math.log(mean) - s2 / 2
    z = (math.log(x) - mu) / s
    if z < 30.0:  # math.erfc keeps its relative precision this far out (P(Z > 30) ~ 5e-198)
        return mean * _upper_tail(z - s) / _upper_tail(z)
    # beyond, both tails underflow: their ratio from the asymptotic series of the Mills ratio
    return mean * math.exp(s * z - s2 / 2) * _mills(z - s) / _mills(z)


def _mills(t: float) -> float:
    """P(Z > t) / pdf(t) for large t, the asymptotic series' first four terms."""
    u = 1.0 / (t * t)
    return (1.0 - u + 3.0 * u * u - 15.0 * u * u * u) / t


def restart_dop(*, mean_t1: float, cv: float, speedup: Callable[[int], float], dop: int,
                elapsed_s: float, options: Sequence[int], gain: float) -> int | None:
    """The DoP among ``options`` (those the free units allow, ascending) to start a run again at,
    or None to leave it: the one that ends it soonest, if that is at most ``gain`` of its
    expected time left at ``dop`` after ``elapsed_s``."""
    if gain <= 0 or not options or options[-1] <= dop:
        return None
    now = speedup(dop)
    done = elapsed_s * now  # the T1 seconds of work this run has done
    total = expected_beyond(mean_t1, cv, done)
    if total is None or total <= done:
        return None
    left = (total - done) / now
    best = max(options, key=speedup)
    again = total / speedup(best)
    return best if best > dop and again <= gain * left else None
