"""Prometheus metrics of one service: its own CollectorRegistry (several apps per process in tests)."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tangram.runtime.stats import gpu_stats
from tangram.service.gc_pauses import GcPauses

_ACT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# overhead holds an environment's set-up too (a container or one-shot environment: seconds)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 2.5, 5,
                     10, 30)


class _PoolCollector:
    """Pool and queue gauges, read from the runtime at scrape time (never stale, no hot-path cost)."""

    def __init__(self, runtime: Any):
        self.runtime = runtime

    def collect(self):
        eng = self.runtime.engine
        cap = GaugeMetricFamily("tangram_pool_capacity", "Units of each pool", labels=["pool", "type"])
        free = GaugeMetricFamily("tangram_pool_free", "Free units of each pool", labels=["pool", "type"])
        for p in eng.pool_states().values():
            cap.add_metric([p.name, p.rtype], p.capacity)
            free.add_metric([p.name, p.rtype], p.free)
        yield cap
        yield free
        absorbed = CounterMetricFamily("tangram_api_upstream_429s_absorbed",
                                       "Upstream 429 answers re-queued instead of returned", labels=["pool"])
        for pool, n in self.runtime.upstream_429s_absorbed.items():
            absorbed.add_metric([pool], n)
        yield absorbed
        books = GaugeMetricFamily("tangram_api_quota_books", "1 for the books each API quota pool keeps now "
                                  "(adaptive: the arrival guess holds; conservative: withdrawn by a 429, or "
                                  "chosen; margin: arrival_margin_s stated)", labels=["pool", "books"])
        for m in eng.managers:
            books_of = getattr(m, "books", None)  # API managers only
            for pool, kind in (books_of() if books_of is not None else {}).items():
                books.add_metric([pool, kind], 1)
        yield books
        yield GaugeMetricFamily("tangram_queue_length", "Actions waiting for resources", value=len(eng.waiting))
        yield GaugeMetricFamily("tangram_running_actions", "Actions running now", value=len(eng.running))
        yield GaugeMetricFamily("tangram_environments", "Live environments",
                                value=len(self.runtime.environments()))
        yield CounterMetricFamily("tangram_runs_restarted", "Straggling restartable runs stopped and started "
                                  "again at a wider DoP (scheduler.restart_gain)", value=eng.runs_restarted)
        yield from _gpu_metrics(gpu_stats(eng))
        yield CounterMetricFamily("tangram_starts_refused", "Starts the policy planned that a manager refused or "
                                  "that raised; each is left waiting and logged (not 0: a bug)",
                                  value=eng.starts_refused)


def _gpu_metrics(st: dict | None):
    """The GPU service cache per node (``/v1/stats`` ``gpu``); a warm start's loads apart from requests'."""
    if st is None:
        return
    counts = {key: CounterMetricFamily(name, text, labels=["pool"]) for key, name, text in (
        ("hits", "tangram_gpu_cache_hits", "Model actions whose service was resident on their chunk"),
        ("misses", "tangram_gpu_cache_misses", "Model actions and warm loads whose service had to be restored"),
        ("evictions", "tangram_gpu_evictions", "Instances evicted to make room"),
        ("failed_restores", "tangram_gpu_failed_restores", "Restores that ended unconfirmed (error, timeout, cancel)"))}
    restores = CounterMetricFamily("tangram_gpu_restores", "Instances restored onto a chunk, by what asked "
                                   "(a request, or the node's warm start)", labels=["pool", "source"])
    seconds = CounterMetricFamily("tangram_gpu_restore_seconds", "Seconds spent restoring, by what asked",
                                  labels=["pool", "source"])
    warming = GaugeMetricFamily("tangram_gpu_warm_loading", "Warm-start loads under way", labels=["pool"])
    stopping = GaugeMetricFamily("tangram_gpu_chunks_stopping", "Chunks kept for a host that has not yet "
                                 "stopped a cancelled or timed-out call", labels=["pool"])
    for pool, s in sorted(st["nodes"].items()):
        for key, family in counts.items():
            family.add_metric([pool], s[key])
        restores.add_metric([pool, "request"], s["request_restores"])  # each its own sum: never decreases
        restores.add_metric([pool, "warm"], s["warm_loads"])
        seconds.add_metric([pool, "request"], s["request_restore_s"])
        seconds.add_metric([pool, "warm"], s["warm_restore_s"])
        warming.add_metric([pool], s["warming"])
        stopping.add_metric([pool], s["stopping"])
    yield from counts.values()
    yield restores
    yield seconds
    yield warming
    yield stopping


class _GateCollector:
    """The admission gate's books (``/v1/stats`` ``admission``): what waits before the engine, and what
    ended or was refused there without reaching it (not in ``tangram_actions``, which counts the
    engine's ends)."""

    def __init__(self, gate: Any):
        self.gate = gate

    def collect(self):
        st = self.gate.stats()
        yield GaugeMetricFamily("tangram_admission_held", "Actions held at the admission gate, not yet handed "
                                "to the engine (their callers see them waiting)", value=st["held"])
        refused = CounterMetricFamily("tangram_admission_refused", "Requests refused for now (429: a job's cap, "
                                      "503: the service's)", labels=["code"])
        for code, n in sorted(st["refused"].items()):
            refused.add_metric([str(code)], n)
        yield refused
        ended = CounterMetricFamily("tangram_admission_ended", "Held actions that ended at the gate (cancelled, "
                                    "or failed to be handed over)", labels=["status"])
        for status, n in sorted(st["ended_held"].items()):
            ended.add_metric([status], n)
        yield ended


class ServiceMetrics:
    def __init__(self, runtime: Any):
        self.registry = CollectorRegistry(auto_describe=False)
        self.actions = Counter("tangram_actions", "Finished actions", ["kind", "status"], registry=self.registry)
        self.act = Histogram("tangram_action_completion_seconds", "ACT: queueing + execution",
                             ["kind"], buckets=_ACT_BUCKETS, registry=self.registry)
        self.queued = Histogram("tangram_action_queued_seconds", "Time waiting for resources",
                                ["kind"], buckets=_ACT_BUCKETS, registry=self.registry)
        self.overhead = Histogram("tangram_action_overhead_seconds", "System time around the executor's run",
                                  buckets=_OVERHEAD_BUCKETS, registry=self.registry)
        self.registry.register(_PoolCollector(runtime))
        self.gc_pauses = GcPauses()
        self.registry.register(self.gc_pauses)
        runtime.listeners.append(self.observe)

    def watch_gate(self, gate: Any) -> None:
        self.registry.register(_GateCollector(gate))

    def close(self) -> None:
        self.gc_pauses.close()  # its callback is the process's: an app's end takes its own out

    def observe(self, job: Any, outcome: Any) -> None:
        t = outcome.timing
        self.actions.labels(job.kind, outcome.status).inc()
        self.act.labels(job.kind).observe(t.queued_s + t.exec_s + t.overhead_s)
        self.queued.labels(job.kind).observe(t.queued_s)
        self.overhead.observe(t.overhead_s)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
