"""When a trajectory in generation is expected to submit its next action (``Snapshot.upcoming``).

The engine measures the generation gap: from a trajectory's action ending to its next one
arriving. A quiet trajectory is expected some time after it went quiet; two models of when:

* ``"mean"``: the mean gap after it went quiet, now once overdue. With gaps of high spread (an
  LLM writing for 2 s or for 60 s) most of a busy node's quiet trajectories are overdue at any
  moment, and each is expected *now*, for as long as it stays quiet: the policy keeps units free
  for arrivals that do not come that soon (docs/scheduling.md, "Expected arrivals").
* ``"residual"``: the measured gaps' mean beyond the time it has been quiet,
  ``E[G - q | G > q]`` over the recent gaps ``G`` (the mean residual life). A trajectory quiet
  for longer than every recent gap is not expected: nothing measured says when it comes.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from itertools import accumulate

ARRIVAL_GAPS = ("mean", "residual")
GAP_WINDOW = 1024  # the recent gaps kept: enough for a mean residual, bounded whatever the run's length


class ResidualGaps:
    """The recent gaps, sorted, as one publication: :meth:`residual` reads them. Compared by
    identity: the holdouts' inputs name the publication they read (``UpcomingView.inputs``)."""

    __slots__ = ("_gaps", "_suffix")

    def __init__(self, sorted_gaps: tuple[float, ...]) -> None:
        self._gaps = sorted_gaps
        # suffix[i]: the sum of the gaps from the i-th on (summed from the last, as a loop would)
        self._suffix = list(accumulate(reversed(sorted_gaps), initial=0.0))[::-1]

    def __len__(self) -> int:
        return len(self._gaps)

    def residual(self, quiet_s: float) -> float | None:
        """Expected seconds until a trajectory quiet for ``quiet_s`` submits, or None when it has
        been quiet longer than every recent gap."""
        i = bisect_right(self._gaps, quiet_s)
        n = len(self._gaps) - i
        if n == 0:
            return None
        return max(0.0, self._suffix[i] / n - quiet_s)


class GapSample:
    """The last ``window`` gaps, republished as a :class:`ResidualGaps` once the gaps measured since
    the last publication are more than ``band`` of the sample (every gap while it is small)."""

    __slots__ = ("_recent", "_sorted", "_new", "_band", "published")

    def __init__(self, window: int = GAP_WINDOW, band: float = 0.1) -> None:
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        self._recent: deque[float] = deque(maxlen=window)  # in the order measured
        self._sorted: list[float] = []  # the same gaps, sorted
        self._new = 0  # gaps measured since the last publication
        self._band = band
        self.published: ResidualGaps | None = None

    def add(self, gap: float) -> bool:
        """Record one gap; True when it republished (every node's expected arrivals moved)."""
        if len(self._recent) == self._recent.maxlen:
            del self._sorted[bisect_left(self._sorted, self._recent[0])]
        self._recent.append(gap)
        insort(self._sorted, gap)
        self._new += 1
        if self.published is not None and self._new <= self._band * len(self._sorted):
            return False
        self.published = ResidualGaps(tuple(self._sorted))
        self._new = 0
        return True
