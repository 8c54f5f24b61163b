"""Measure this machine before the demo: do its cores give a parallel speedup, and how busy is it?

The answer decides what the demo can show: without speedup an elastic reward cannot run
faster at a higher DoP, and on a busy machine run-to-run noise hides small differences.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Sequence


def _spin(core: int, n: int) -> float:
    """A fixed amount of pure-Python work pinned to ``core``; its wall time."""
    os.sched_setaffinity(0, {core})
    t = time.perf_counter()
    x = 0
    for i in range(n):
        x += i * i
    return time.perf_counter() - t


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        vals = [float(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)  # idle + iowait
    return sum(vals) - idle, sum(vals)


def measure(cores: Sequence[int], work: int = 3_000_000) -> dict:
    """Parallel speedup of ``len(cores)`` pinned CPU-bound processes over one, and how busy the
    machine was just before (share of all CPUs' time not idle, load average). ~2-4 s."""
    cores = list(cores)
    b0, t0 = _cpu_times()
    time.sleep(0.5)
    b1, t1 = _cpu_times()
    busy = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
    load1 = os.getloadavg()[0]
    import multiprocessing

    with ProcessPoolExecutor(max_workers=len(cores), mp_context=multiprocessing.get_context("fork")) as pool:
        list(pool.map(_spin, cores, [work // 10] * len(cores)))  # warm the workers
        alone = pool.submit(_spin, cores[0], work).result()
        together = max(pool.map(_spin, cores, [work] * len(cores)))
    speedup = len(cores) * alone / together if together > 0 else 1.0
    return {"cores": len(cores), "cpu_count": os.cpu_count(), "busy_before": round(busy, 3),
            "load_avg_1m": round(load1, 2), "one_process_s": round(alone, 6),
            "all_processes_s": round(together, 6), "parallel_speedup": round(speedup, 2)}


def explain(m: dict) -> list[str]:
    """What the measurement means for the comparison, in plain sentences."""
    n, s = m["cores"], m["parallel_speedup"]
    lines = [f"{n} CPU-bound processes, one per core, do {s:.2f}x the work of one (ideal {n}x); "
             f"the machine was {100 * m['busy_before']:.0f}% busy before the demo (load average {m['load_avg_1m']})."]
    if n < 2:
        lines.append("One core: no action can run elastically, so the policies differ only in how they queue.")
    elif s < 0.75 * n:
        lines.append(f"These cores do not scale (about {s:.1f} cores of throughput): a reward at a higher DoP is "
                     "not faster here, so Tangram can gain only by using the cores pods leave idle during "
                     "LLM generation. Expect small differences; the projection below shows the cluster scale.")
    else:
        lines.append("These cores scale: an elastic reward at a higher DoP finishes faster when cores are free.")
    if m["busy_before"] > 0.3 or m["load_avg_1m"] > 0.5 * n:
        lines.append("Other work shares this machine: each run sees a different load, so compare medians and "
                     "treat differences inside the spread (min..max over runs) as noise.")
    return lines
