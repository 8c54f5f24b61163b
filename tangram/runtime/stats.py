"""What the runtime reports about itself: counts, ACT percentiles, queue and utilisation per pool."""
from __future__ import annotations

import math
from collections import deque
from typing import Any

from tangram.core.engine import Engine
from tangram.executors.base import SUCCEEDED
from tangram.managers.gpu import GpuManager

_RECENT = 10_000  # samples kept per class for percentiles
# classes kept for percentiles, the one whose last success is oldest dropped beyond: a class name comes
# from the client, and 10,000 samples of each of an unbounded number of classes is unbounded memory
# (at most 256 x 10,000 samples now, ~80 MB if every class filled its window)
MAX_CLASSES = 256


class RuntimeStats:
    """Counters and recent samples, fed once per finished action."""

    def __init__(self, max_classes: int = MAX_CLASSES) -> None:
        self.counts: dict[tuple[str, str], int] = {}  # (kind, status) -> n
        self.max_classes = max_classes
        self.classes_dropped = 0
        self._act: dict[str, deque[float]] = {}  # least recently succeeded first
        self._overhead: deque[float] = deque(maxlen=_RECENT)

    def record(self, kind: str, action_class: str, status: str, act_s: float, overhead_s: float) -> None:
        key = (kind, status)
        self.counts[key] = self.counts.get(key, 0) + 1
        if status == SUCCEEDED:
            samples = self._act.pop(action_class, None)
            if samples is None:
                samples = deque(maxlen=_RECENT)
                if len(self._act) >= self.max_classes:
                    del self._act[next(iter(self._act))]
                    self.classes_dropped += 1
            self._act[action_class] = samples  # now the most recently succeeded
            samples.append(act_s)
            self._overhead.append(overhead_s)

    def report(self, eng: Engine, environments: int) -> dict[str, Any]:
        """Queue length and utilisation per pool, ACT percentiles per action class."""
        pools = eng.pool_states()
        waiting_by_pool: dict[str, int] = {name: 0 for name in pools}
        for rec in eng.waiting.values():
            a = rec.action
            bound = eng.placement.get(a.trajectory) if a.trajectory else None
            for rtype in a.demands:
                if rtype.startswith("api:"):
                    if rtype in waiting_by_pool:
                        waiting_by_pool[rtype] += 1
                    continue
                for name, p in pools.items():
                    if p.rtype == rtype and (bound is None or p.node == bound):
                        waiting_by_pool[name] += 1
        out_pools = {}
        for name, p in pools.items():
            used = p.capacity - p.free
            out_pools[name] = {
                "type": p.rtype, "node": p.node, "capacity": p.capacity, "free": p.free, "used": used,
                "utilisation": (used / p.capacity) if p.capacity else 0.0,
                "queue_length": waiting_by_pool.get(name, 0),
            }
        classes = {}
        for cls, samples in self._act.items():
            xs = sorted(samples)
            classes[cls] = {"count": len(xs), "act_p50_s": percentile(xs, 50), "act_p90_s": percentile(xs, 90),
                            "act_p99_s": percentile(xs, 99), "mean_exec_s": eng.estimator.mean_duration(cls)}
        ov = sorted(self._overhead)
        return {
            "queue_length": len(eng.waiting),
            "running": len(eng.running),
            "environments": environments,
            "pools": out_pools,
            "classes": classes,
            "classes_dropped": self.classes_dropped,  # times a class's samples were dropped (max_classes)
            "overhead": {"p50_s": percentile(ov, 50), "p99_s": percentile(ov, 99), "samples": len(ov)},
            "actions": {f"{k}:{s}": n for (k, s), n in sorted(self.counts.items())},
            "restarts": eng.runs_restarted,  # straggling runs stopped and started again wider (PolicyParams.restart_gain)
            "starts_refused": eng.starts_refused,  # planned starts a manager refused (left waiting; a bug: see the log)
            **({"gpu": gpu} if (gpu := gpu_stats(eng)) is not None else {}),
        }


def gpu_stats(eng: Engine) -> dict[str, Any] | None:
    """The GPU service cache's counters (:meth:`GpuManager.stats`), None without GPU nodes."""
    for m in eng.managers:
        inner = getattr(m, "inner", m)  # a NodeGate (scale-out) wraps the manager
        if isinstance(inner, GpuManager):
            return inner.stats()
    return None


def percentile(sorted_xs: list[float], q: float) -> float | None:
    """The nearest-rank percentile of an already sorted list (None when empty)."""
    if not sorted_xs:
        return None
    k = min(len(sorted_xs) - 1, max(0, math.ceil(q / 100 * len(sorted_xs)) - 1))
    return sorted_xs[k]
