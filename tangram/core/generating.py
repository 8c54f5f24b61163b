"""Trajectories in generation: placed on a node, with no action waiting or running.

Their LLM is writing the next action, which will ask the node for units in a
moment. The engine records when each went quiet and its last action, and
measures how long generation takes (the gap between a trajectory's last
action ending and its next one arriving); the policy sees, per node, when
each one's next action is expected (``Snapshot.upcoming``).
"""
from __future__ import annotations

from itertools import islice
from operator import itemgetter
from typing import Mapping

from tangram.core.gaps import GapSample, ResidualGaps
from tangram.core.model import Action


class Generating:
    """Bookkeeping of the quiet trajectories, per node, and of the generation gap."""

    __slots__ = ("_active", "_done", "_generated", "_since", "_fixed", "_fixed_cpu", "_gap_sum", "_gap_n",
                 "_published_gap", "_gaps")

    # the gap the policy sees is republished when the mean moves by more than this share of it:
    # an arrival's own spread around the gap is far wider (generation times of cv 0.8 in the
    # built-in workloads), and each republication re-decides the groups that read arrivals
    PUBLISH_BAND = 0.1

    def __init__(self) -> None:
        self._active: dict[str, int] = {}  # trajectory -> its waiting and running actions
        self._done: dict[str, int] = {}  # trajectory -> its actions that have ended (its progress)
        self._generated: dict[str, float] = {}  # trajectory -> seconds it was quiet between its actions
        self._since: dict[str, tuple[float, str | None]] = {}  # quiet trajectory -> (quiet since, node)
        # node -> trajectory -> (quiet since, last action), for those whose last action had a fixed
        # demand: an elastic next action takes what is free when it comes, a fixed one needs its units
        self._fixed: dict[str, dict[str, tuple[float, Action]]] = {}
        self._fixed_cpu: dict[str, int] = {}  # node -> the CPU units of its _fixed trajectories' last actions
        self._gap_sum = 0.0
        self._gap_n = 0
        self._published_gap: float | None = None
        self._gaps = GapSample(band=self.PUBLISH_BAND)  # the recent gaps, for arrival_gap "residual"

    @property
    def mean_gap_s(self) -> float | None:
        """Mean seconds from a trajectory's last action ending to its next one arriving (None: none seen)."""
        return self._gap_sum / self._gap_n if self._gap_n else None

    @property
    def published_gap_s(self) -> float | None:
        """The mean gap as the policy sees it (``Snapshot.upcoming``): republished on a move of
        more than ``PUBLISH_BAND`` of it."""
        return self._published_gap

    def done(self, trajectory: str) -> int:
        """How many of ``trajectory``'s actions have ended so far."""
        return self._done.get(trajectory, 0)

    def order_inputs(self, trajectory: str | None, now: float, params) -> tuple[int, float]:
        """``(done, generated_s)`` of ``trajectory`` as the order key reads them (``order.params_key``),
        each only when its knob (``params.progress_s``, ``params.generation_credit``) is on."""
        if trajectory is None:
            return 0, 0.0
        return (self.done(trajectory) if params.progress_s else 0,
                self.generated_s(trajectory, now) if params.generation_credit else 0.0)

    def generated_s(self, trajectory: str, now: float) -> float:
        """Seconds ``trajectory`` has spent in generation between its actions, up to ``now`` (its
        current quiet spell included): what ``PolicyParams.generation_credit`` weighs."""
        total = self._generated.get(trajectory, 0.0)
        quiet = self._since.get(trajectory)
        return total + (now - quiet[0]) if quiet is not None and now > quiet[0] else total

    def submitted(self, a: Action, now: float, residual: bool = False) -> str | bool:
        """``a`` was queued; returns whose expected arrivals changed: True, every node's (the
        published gap, :attr:`published_gap_s`, moved; ``residual``: the published recent gaps,
        :attr:`published_gaps`), a node, that node's (its trajectory was quiet there), or False."""
        t = a.trajectory
        if t is None:
            return False
        self._active[t] = self._active.get(t, 0) + 1
        quiet = self._since.pop(t, None)
        if quiet is not None:
            since, node = quiet
            gap = now - since
            self._gap_sum += gap
            self._generated[t] = self._generated.get(t, 0.0) + gap
            self._gap_n += 1
            if node is not None:
                self._unfix(node, t)
            gaps_moved = self._gaps.add(gap)
            mean, published = self._gap_sum / self._gap_n, self._published_gap
            mean_moved = published is None or abs(mean - published) > self.PUBLISH_BAND * published
            if mean_moved:
                self._published_gap = mean
            if gaps_moved if residual else mean_moved:
                return True
            return node if node is not None else False
        return False

    def ended(self, a: Action, node: str | None, now: float) -> bool:
        """``a`` left the engine (finished, failed or cancelled); ``node``: where its trajectory is placed.
        True when its trajectory joined ``node``'s expected arrivals."""
        t = a.trajectory
        if t is None or t not in self._active:  # its trajectory closed while it ran: nothing more comes from it
            return False
        self._done[t] = self._done.get(t, 0) + 1
        left = self._active[t] - 1
        if left > 0:
            self._active[t] = left
            return False
        self._active.pop(t, None)
        fixed = node is not None and not a.scalable
        self._since[t] = (now, node if fixed else None)
        if fixed:
            self._fixed.setdefault(node, {})[t] = (now, a)
            if "cpu" in a.demands:
                self._fixed_cpu[node] = self._fixed_cpu.get(node, 0) + a.demands["cpu"].min
        return fixed

    def renamed(self, old: str, new: str) -> None:
        """``old``'s ended actions and generation become ``new``'s (a rollout named before it had an
        environment, ``new``, which has none of its own yet); its quiet spell goes on under ``new``."""
        if new in self._active or new in self._done:
            return  # the environment has a history of its own: nothing is merged into it
        if (done := self._done.pop(old, 0)) > 0:
            self._done[new] = done
        if (gen := self._generated.pop(old, None)) is not None:
            self._generated[new] = gen
        quiet = self._since.get(old)
        if quiet is not None and quiet[1] is None and old not in self._active:  # placed nowhere, nothing in flight
            self._since[new] = self._since.pop(old)

    def busy(self, trajectory: str) -> bool:
        """An action of ``trajectory`` is in the engine (queued or running)."""
        return trajectory in self._active

    def closed(self, trajectory: str) -> None:
        """The trajectory ended: nothing more will come from it."""
        self._active.pop(trajectory, None)
        self._done.pop(trajectory, None)
        self._generated.pop(trajectory, None)
        quiet = self._since.pop(trajectory, None)
        if quiet is not None and quiet[1] is not None:
            self._unfix(quiet[1], trajectory)

    def _unfix(self, node: str, trajectory: str) -> None:
        _, a = self._fixed[node].pop(trajectory)
        if "cpu" in a.demands:
            left = self._fixed_cpu[node] - a.demands["cpu"].min
            if left:
                self._fixed_cpu[node] = left
            else:
                del self._fixed_cpu[node]

    def expected_cpu(self) -> Mapping[str, int]:
        """node -> the CPU units its trajectories in generation are expected to ask for next (each its
        last action's, fixed; those whose last action was elastic take what is free): kept as they
        come and go, read on every completion while a restartable run is out (core/restarts.py)."""
        return self._fixed_cpu

    @property
    def published_gaps(self) -> ResidualGaps | None:
        """The recent gaps as the policy sees them under ``arrival_gap`` "residual"."""
        return self._gaps.published

    def view(self, now: float, limit: int, residual: bool = False) -> "UpcomingView":
        return UpcomingView(self._fixed, self._published_gap, now, limit, self._gaps.published if residual else None)


class UpcomingView(Mapping[str, tuple[tuple[float, Action], ...]]):
    """node -> ``(seconds until expected, last action)`` of its quiet trajectories whose last action
    had a fixed demand, soonest first, at most ``limit`` of them; computed on demand (the policy
    reads it for the CPU pools it arranges).

    Without ``gaps`` a trajectory is expected the mean generation gap after it went quiet (now,
    once overdue); with them, the recent gaps' mean beyond the time it has been quiet, and one
    quiet longer than every recent gap is not shown (tangram.core.gaps). Its next action is
    expected to be like its last (an agent's tool calls repeat). Empty until a gap has been
    measured: nothing is known yet of when actions come.
    """

    __slots__ = ("_quiet", "_gap", "_now", "_limit", "_gaps")

    def __init__(self, quiet: dict[str, dict[str, tuple[float, Action]]], gap: float | None, now: float, limit: int,
                 gaps: ResidualGaps | None = None):
        self._quiet = quiet
        self._gap = gap
        self._now = now
        self._limit = limit
        self._gaps = gaps

    def __getitem__(self, node: str) -> tuple[tuple[float, Action], ...]:
        if self._gap is None:
            raise KeyError(node)
        if self._gaps is not None:
            return tuple(sorted(((r, a) for r, _, a in self._residual(node)), key=itemgetter(0)))
        now, gap = self._now, self._gap
        # a node's quiet trajectories are kept in the order they went quiet: soonest expected first
        return tuple((max(0.0, since + gap - now), a) for since, a in islice(self._quiet[node].values(), self._limit))

    def _residual(self, node: str) -> list[tuple[float, float, Action]]:
        """``(seconds until expected, since, last action)`` of the first ``limit`` quiet trajectories,
        in the order they went quiet, that some recent gap outlasts. Those it skips are the longest
        quiet: each call passes over them at its start."""
        gaps, now, limit = self._gaps, self._now, self._limit
        out: list[tuple[float, float, Action]] = []
        if limit <= 0:
            return out
        for since, a in self._quiet[node].values():
            r = gaps.residual(now - since)
            if r is not None:
                out.append((r, since, a))
                if len(out) == limit:
                    break
        return out

    def get(self, node: str, default=None):
        return self[node] if (self._gap is not None and self._quiet.get(node)) else default

    def inputs(self, node: str) -> tuple:
        """``self[node]`` without the clock: the published gap (or recent gaps) and the visible
        ``(since, last action)``."""
        quiet = self._quiet.get(node)
        if not quiet or self._gap is None:
            return ()
        if self._gaps is not None:
            return self._gaps, tuple((since, a) for _, since, a in self._residual(node))
        return self._gap, tuple(islice(quiet.values(), self._limit))

    def __iter__(self):
        return iter(self._quiet if self._gap is not None else ())

    def __len__(self) -> int:
        return len(self._quiet) if self._gap is not None else 0
