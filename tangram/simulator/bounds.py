"""Lower bounds on mean ACT that stay informative when the cluster is overloaded.

The per-action bound (every action at its fastest feasible allocation, never
queued) says nothing once queueing dominates. The pooled bound relaxes the
cluster instead of the queue: per resource type, one machine with the
cluster's total units, every action's work (its smallest unit-seconds over
its feasible allocations, true durations) divisible across all of them at
perfect efficiency, served by preemptive shortest-remaining-first, which
minimises the sum of flow times on one machine for given arrivals. No real
policy can do better on the same arrivals: a real cluster has less freedom
(nodes, chunks, non-preemption, a DoP limit per action, efficiency < 1).

Arrivals are the submit times of the run being bounded (a trajectory's next
action arrives after its previous one ends), so the bound belongs to that
run; ``mean ACT / bound`` is how far that run is from the best any scheduler
could do with its arrivals.

The pooled bound sees cores, not memory: where trajectories queue for the
memory their sandboxes reserve for their whole life, the memory bound
(:func:`memory_wait_bound`) adds what any scheduler must make first actions
wait, from the trajectories' scripts alone (fastest lifetimes, the nodes'
sandbox slots), independent of the run's policy.
"""
from __future__ import annotations

import heapq
import math
from typing import Any, Sequence


def srpt_flow_sum(arrivals: Sequence[float], sizes: Sequence[float]) -> float:
    """Sum of flow times (completion - arrival) of preemptive SRPT on one machine."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    heap: list[tuple[float, int]] = []
    t, k, n, total = 0.0, 0, len(order), 0.0
    while k < n or heap:
        if not heap:
            t = max(t, arrivals[order[k]])
        while k < n and arrivals[order[k]] <= t:
            j = order[k]
            heapq.heappush(heap, (sizes[j], j))
            k += 1
        rem, j = heapq.heappop(heap)
        next_arrival = arrivals[order[k]] if k < n else math.inf
        if t + rem <= next_arrival:
            t += rem
            total += t - arrivals[j]
        else:
            heapq.heappush(heap, (rem - (next_arrival - t), j))
            t = next_arrival
    return total


def pooled_bound_mean(groups: dict[str, tuple[list[float], list[float]]], capacity: dict[str, float]) -> float:
    """Mean over all actions of the pooled SRPT flow time, per resource type.

    ``groups[rtype] = (arrivals, works)`` with works in unit-seconds; each
    action belongs to one group (the resource it is scheduled on).
    """
    total, count = 0.0, 0
    for rtype, (arrivals, works) in groups.items():
        cap = capacity.get(rtype) or 0
        if not arrivals or cap <= 0:
            continue
        total += srpt_flow_sum(arrivals, [w / cap for w in works])
        count += len(arrivals)
    return total / count if count else 0.0


# --------------------------------------------------------------------------- #
# memory: a trajectory holds its sandbox's memory from its first CPU action to its end


def memory_wait_bound(releases: Sequence[float], holds: Sequence[float], slots: int, start: float = 0.0) -> float:
    """A lower bound on the total time trajectories wait for memory.

    Trajectory ``i`` may take a memory slot no earlier than ``releases[i]``
    (its first CPU action's earliest submission) and then holds it at least
    ``holds[i]`` seconds (its fastest remaining life); a node holds ``slots``
    trajectories in all (every node's count summed). Its wait is its start
    minus its release. Two relaxations, the larger is returned:

    * all released at ``start``: shortest-hold-first on ``slots`` identical
      machines minimises the sum of starts (SPT is optimal for the sum of
      completion times on identical machines, and a start is a completion
      less its fixed hold); minus what the real releases already account for.
    * the slots pooled into one machine ``slots`` times faster, preemptive
      SRPT with the real releases: every real schedule, its holds cut to
      their minimum, is one of its processor-sharing schedules.
    """
    n = len(holds)
    if n <= slots or slots <= 0:
        return 0.0  # every trajectory can take a slot when it is released
    spt_starts, lane = 0.0, [0.0] * slots
    for j, h in enumerate(sorted(holds)):  # sorted jobs round-robin over the machines
        spt_starts += lane[j % slots]
        lane[j % slots] += h
    spt = spt_starts - sum(r - start for r in releases)
    pooled = srpt_flow_sum(releases, [h / slots for h in holds]) - sum(holds)
    return max(0.0, spt, pooled)


def memory_makespan_bound(releases: Sequence[float], holds: Sequence[float], slots: int, start: float = 0.0) -> float:
    """A lower bound on the time from ``start`` until every trajectory has ended:
    the slots' total work spread evenly, or the latest release plus its hold."""
    if not holds or slots <= 0:
        return 0.0
    spread = min(releases) - start + sum(holds) / slots
    return max(spread, max(r + h for r, h in zip(releases, holds)) - start)


def memory_script(items: Sequence[Any], step_start: float) -> tuple[float, float] | None:
    """(earliest placement, fewest seconds held) of a trajectory that reserves memory: its first CPU
    action's arrival had nothing queued, and its hold from there at every action's fastest run
    (``items``: the simulator's, with ``gen_s``, ``lb`` and ``cls.rtype``); None without a CPU action."""
    t = step_start
    for k, it in enumerate(items):
        t += it.gen_s
        if it.cls.rtype == "cpu":
            return t, it.lb + sum(i.gen_s + i.lb for i in items[k + 1:])
        t += it.lb
    return None
