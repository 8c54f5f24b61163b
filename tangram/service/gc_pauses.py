"""The service process's garbage collections: its startup objects frozen, every pause measured.

CPython's full (oldest-generation) collection scans every GC-tracked object the process holds,
and the event loop stands still while it runs: every action, HTTP request and round waits.
A service that loaded torch and transformers holds ~225,000 such objects from its imports alone
(one full collection: ~130 ms on this project's 2-core machine; ~21 ms without them), none of
which ever becomes garbage. ``tangram serve`` freezes what exists once it is built, before it
listens (:func:`freeze_startup_objects`, ``gc.freeze()``): frozen objects are skipped by every
later collection and still freed by reference counting if they go, but one that ends in a
reference cycle is never freed: that is bounded by what exists at start (the imports, config,
executors, environments restored from the state), once. What the queue holds stays
collected as usual (~11 tracked objects per queued action: at 8,000 queued a full collection
still takes ~15 ms); ``tangram_gc_pause_seconds`` shows what the collections cost, per
generation, so an operator sees a pause before it is a mystery in the ACT.

The pauses are counted into plain integers inside ``gc.callbacks`` (a callback may run inside
any allocation, where taking a lock such as a prometheus metric's could deadlock) and turned
into a histogram when scraped.
"""
from __future__ import annotations

import bisect
import gc
import time

# seconds: a young collection is tens of microseconds, a full one with a large queue tens of ms
PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_GENERATIONS = 3


def freeze_startup_objects() -> int:
    """Collect once, then move every object left to the permanent generation, which no later
    collection scans; returns how many are frozen. Call it once the service is built."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Measures each collection of this process while open (several may be, one per app)."""

    def __init__(self) -> None:
        # per generation: counts per bucket of PAUSE_BUCKETS (the last: above them all), their sum
        self.counts = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(_GENERATIONS)]
        self.sums = [0.0] * _GENERATIONS
        self._started = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        gen = info["generation"]
        if 0 <= gen < _GENERATIONS:
            self.counts[gen][bisect.bisect_left(PAUSE_BUCKETS, pause)] += 1
            self.sums[gen] += pause

    def close(self) -> None:
        try:
            gc.callbacks.remove(self._on_collection)
        except ValueError:
            pass  # closed already

    def collect(self):
        """Prometheus collector protocol: the pause histogram and the frozen-object count."""
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        hist = HistogramMetricFamily("tangram_gc_pause_seconds",
                                     "Garbage collections of the service process (the event loop stops meanwhile)",
                                     labels=["generation"])
        for gen in range(_GENERATIONS):
            counts, total, cumulative = self.counts[gen], 0, []
            for bound, n in zip([*map(str, PAUSE_BUCKETS), "+Inf"], counts):
                total += n
                cumulative.append((bound, total))
            hist.add_metric([str(gen)], cumulative, self.sums[gen])
        yield hist
        yield GaugeMetricFamily("tangram_gc_frozen_objects",
                                "Objects frozen at startup, which no collection scans", value=gc.get_freeze_count())
