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
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence


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
