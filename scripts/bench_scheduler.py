#!/usr/bin/env python3
"""Latency of scheduling rounds through the engine, and how it grows.

Every size is a real :class:`Engine` holding a real queue (its lanes, its
placements, its running set). Two measures per size, taken side by side
(the sizes interleaved, so machine noise hits them alike):

* ``round_*``: one full round, ``engine.snapshot()`` + the policy, in a state
  where ``candidates`` actions can start and ``queued`` wait; wall-clock, and
  ``round_cpu_*`` the CPU time the round's thread spent (on a loaded machine
  a round longer than the OS's time slice is preempted, so wall-clock ratios
  between sizes there measure the time slice more than the round);
* ``event_*``: a stream of completions and arrivals through the engine
  (``complete()`` / ``submit()``, each with its round, or its skipped round).

Sizes (``SIZES``): 256 cores / 64 candidates / 2,000 queued (the contract's
``round_median_ms``), 1,024 cores / 256 candidates / 8,000 queued, a node
whose memory is taken by placed trajectories with 2,000 and 20,000
unplaced trajectories queued behind (heads blocked on memory), and the
paper's CPU testbed: 15 nodes of 256 cores, 960 candidates, 30,000 queued.
Prints one JSON object with ``--json``; ``estimate_compiled`` says whether the
ACT estimate's hot loops ran compiled (``tangram/policy/walk.py``, built by
``setup.py``), ``estimate_on_c_arrays`` whether its walk ran on C arrays
(``tangram/policy/walk_arrays.pyx``, built beside it), ``policy_compiled`` which of the
round's modules ran compiled whole (``compiled.NATIVE``). ``--against-source`` also times
every size's round with the estimate's plain-Python loops (the rest as it runs),
interleaved round by round in this process, and reports the per-round ratio
compiled / source (``against_source``); ``scripts/bench_policy_ab.py --base`` a
commit from before ``compiled.NATIVE`` compares the whole policy compiled against
its plain source.

Garbage collection: the objects that exist once the script has imported what it
needs are frozen, as ``tangram serve`` freezes its own once it listens
(``tangram/service/gc_pauses.py``); the queues built after are collected as usual.
A full collection that falls inside a round is part of that round's time
(``round_p99_ms``), but it scans the queues of all four sizes this process holds
(~11 objects per queued action, 32,000 actions), more than one service's engine
would: each size reports how many of its rounds held one
(``rounds_with_full_collection``) and its p99 without their pauses
(``round_p99_without_gc_ms``), and ``gc`` the collections of the whole
measurement.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tangram.policy.estimate as estimate  # noqa: E402
from tangram.core.engine import Engine  # noqa: E402
from tangram.policy import compiled  # noqa: E402
from tangram.core.model import Action, Elasticity  # noqa: E402
from tangram.managers.base import CountingManager  # noqa: E402
from tangram.policy.schedule import plan  # noqa: E402
from tangram.policy.snapshot import Plan, PolicyParams  # noqa: E402

from tangram.service.gc_pauses import GcPauses, freeze_startup_objects  # noqa: E402

TRAJ_MEM_MB = 8192  # one sandbox's memory, as in the cpu-contended workload
OLDEST = 2  # the generation whose collection scans every tracked object of the process
PAUSES: GcPauses | None = None  # the service's own pause counters, open while main() measures


def _full_collections() -> tuple[int, float]:
    """Full collections so far and their seconds (PAUSES' counters, as /metrics shows them)."""
    return sum(PAUSES.counts[OLDEST]), PAUSES.sums[OLDEST]


def _hold(_snap) -> Plan:
    return Plan()  # set-up only: queue actions without starting them


def _elastic(i: int, rng: random.Random, lo: int, options: int, **kw) -> Action:
    return Action.build(
        f"a{i}", {"cpu": {"min": lo, "max": lo + options - 1}},
        t1_s=rng.uniform(5.0, 120.0), elasticity=Elasticity.amdahl(rng.uniform(0.01, 0.3)),
        action_class=f"suite{i % 8}", **kw)


class Size:
    """One engine in a state where ``candidates`` can start and ``queued`` wait."""

    def __init__(self, *, cores: int, nodes: int, candidates: int, queued: int, options: int, blocked: bool, seed: int):
        self.spec = {"cores": cores, "nodes": nodes, "candidates": candidates, "queued": queued,
                     "options": options, "blocked_on_memory": blocked}
        self.rng = random.Random(seed)
        self.clock = 0.0
        per_node = cores // nodes
        caps = {}
        for n in range(nodes):
            caps[f"cpu@n{n}"] = per_node
            # blocked: memory for exactly the placed trajectories (one per candidate)
            caps[f"mem@n{n}"] = (candidates // nodes) * TRAJ_MEM_MB if blocked else 1 << 30
        self.engine = Engine([CountingManager(caps)], clock=lambda: self.clock, params=PolicyParams(), policy=plan)
        self.min_units = cores // candidates  # the candidates' minimums exactly fill the cores
        self.options = options
        self.next_id = 0
        self.blocked = blocked
        eng = self.engine
        if blocked:
            # place one trajectory per candidate (it keeps its memory), then queue behind them
            for t in range(candidates):
                eng.submit(self._action(trajectory=f"placed{t}", mem_mb=TRAJ_MEM_MB, units=1))
            for rec in list(eng.running.values()):
                eng.complete(rec.id)
            eng.policy = _hold
            for t in range(queued):
                eng.submit(self._action(trajectory=f"waiting{t}", mem_mb=TRAJ_MEM_MB, units=1))
            for t in range(candidates):
                eng.submit(self._action(trajectory=f"placed{t}"))
        else:
            eng.policy = _hold
            for _ in range(queued):
                eng.submit(self._action())
        eng.policy = plan
        self.rounds: list[float] = []
        self.round_cpu: list[float] = []
        self.round_gc: list[float] = []  # ms of full collections inside each round
        self.events: list[float] = []
        self.scheduled = 0

    def _action(self, *, units: int | None = None, **kw) -> Action:
        self.next_id += 1
        if units is not None:
            return Action.build(f"a{self.next_id}", {"cpu": units}, action_class="shell", **kw)
        return _elastic(self.next_id, self.rng, self.min_units, self.options, **kw)

    def measure_round(self) -> None:
        eng = self.engine
        c0, t0 = time.thread_time(), time.perf_counter()
        g0 = PAUSES.sums[OLDEST]  # read inside the timed span: a collection is subtracted only from its round
        p = eng.policy(eng.snapshot())
        g1 = PAUSES.sums[OLDEST]
        t1, c1 = time.perf_counter(), time.thread_time()
        self.rounds.append((t1 - t0) * 1e3)
        self.round_gc.append((g1 - g0) * 1e3)
        self.round_cpu.append((c1 - c0) * 1e3)
        self.scheduled = len(p.dispatches)

    def start_stream(self) -> None:
        self.engine.schedule()  # start the candidates: from now on events stream through the engine
        self.counts_at_start = (self.engine.rounds, self.engine.rounds_skipped)

    def measure_event(self) -> None:
        """One completion (the oldest running action) or one arrival, alternating."""
        eng = self.engine
        self.clock += 0.01
        if len(self.events) % 2 == 0 and eng.running:
            rec = next(iter(eng.running.values()))
            t0 = time.perf_counter()
            eng.complete(rec.id)
        else:
            if self.blocked and len(self.events) % 4 == 1:
                a = self._action(trajectory=f"late{self.next_id}", mem_mb=TRAJ_MEM_MB, units=1)
            elif self.blocked:  # the next action of a placed trajectory
                a = self._action(trajectory=f"placed{self.rng.randrange(self.spec['candidates'])}")
            else:
                a = self._action()
            t0 = time.perf_counter()
            eng.submit(a)
        self.events.append((time.perf_counter() - t0) * 1e3)

    def result(self) -> dict:
        r, e, c = sorted(self.rounds), sorted(self.events), sorted(self.round_cpu)
        rounds_run, rounds_skipped = self.stream_rounds()
        without_gc = sorted(t - g for t, g in zip(self.rounds, self.round_gc))
        return {
            **self.spec,
            "round_median_ms": round(statistics.median(r), 4),
            "round_p99_ms": round(_p99(r), 4),
            "round_min_ms": round(r[0], 4),
            "round_cpu_median_ms": round(statistics.median(c), 4),
            "round_cpu_p99_ms": round(_p99(c), 4),
            "rounds_with_full_collection": sum(1 for g in self.round_gc if g > 0),
            "round_p99_without_gc_ms": round(_p99(without_gc), 4),
            "scheduled": self.scheduled,
            "event_median_ms": round(statistics.median(e), 4) if e else None,
            "event_p99_ms": round(_p99(e), 4) if e else None,
            "events": len(e),
            "rounds_run": rounds_run,  # during the stream
            "rounds_skipped": rounds_skipped,
        }

    def stream_rounds(self) -> tuple[int, int]:
        """Rounds run and skipped during the stream (kept once the engine is dropped)."""
        eng = self.engine
        if eng is None:
            return self._stream_rounds
        return eng.rounds - self.counts_at_start[0], eng.rounds_skipped - self.counts_at_start[1]

    def drop_engine(self) -> None:
        """Keep the stream's round counts, let the engine and its queue go (a later size measured
        alone should not share its heap)."""
        self._stream_rounds = self.stream_rounds()
        self.engine = None


def _measure_together(args, specs: list[dict]) -> tuple[list[Size], list[dict] | None]:
    """Rounds, then a stream of events, of ``specs``' engines in turn (they share the machine's noise);
    each Size keeps its measures and drops its engine once done."""
    sizes = [Size(seed=args.seed, **s) for s in specs]
    for s in sizes:
        s.measure_round()  # warm caches
        s.rounds.clear()
        s.round_cpu.clear()
        s.round_gc.clear()
    for _ in range(args.repeats):  # interleaved: the sizes share the machine's noise
        for s in sizes:
            s.measure_round()
    # before the stream: the same states as the rounds above
    against = against_source(sizes, args.repeats) if args.against_source else None
    for s in sizes:
        s.start_stream()
    for _ in range(args.events):
        for s in sizes:
            s.measure_event()
    for s in sizes:
        s.drop_engine()
    return sizes, against


def compiled_modules(compiled_module) -> list[str]:
    """The modules of a round that ``compiled_module`` (a ``tangram/policy/compiled.py``) reports
    running compiled; none for a policy from before they were (bench_policy_ab.py's base)."""
    native = getattr(compiled_module, "native_modules", None)
    return sorted(name for name, yes in native().items() if yes) if native is not None else []


def _p99(xs: list[float]) -> float:
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def _ratios(a: list[float], b: list[float]) -> dict:
    """Per-repeat ratios b/a (taken in the same pass), with their spread."""
    rs = sorted(y / x for x, y in zip(a, b) if x > 0)
    return {"median": round(statistics.median(rs), 3), "p10": round(rs[int(0.1 * len(rs))], 3),
            "p90": round(rs[int(0.9 * len(rs))], 3)}


def against_source(sizes: list[Size], repeats: int) -> list[dict]:
    """Per size: CPU time of a full round with the estimate's loops as running and as the plain
    source, alternating which goes first, and the per-round ratio (running / source)."""
    running, running_walk, source = estimate._hot, estimate._walk, compiled.source_module("walk")
    out = []
    try:
        for s in sizes:
            eng = s.engine
            times: dict[str, list[float]] = {"running": [], "source": []}
            for i in range(repeats + 1):
                order = (("running", running, running_walk), ("source", source, source.walk))
                for tag, mod, walk in (order if i % 2 else order[::-1]):
                    estimate._hot, estimate._walk = mod, walk
                    snap = eng.snapshot()
                    c0 = time.thread_time()
                    eng.policy(snap)
                    if i:  # the first pair warms both
                        times[tag].append((time.thread_time() - c0) * 1e3)
            out.append({"cores": s.spec["cores"], "queued": s.spec["queued"],
                        "blocked_on_memory": s.spec["blocked_on_memory"],
                        "round_cpu_median_ms": round(statistics.median(times["running"]), 4),
                        "source_round_cpu_median_ms": round(statistics.median(times["source"]), 4),
                        "ratio": _ratios(times["source"], times["running"])})
    finally:
        estimate._hot, estimate._walk = running, running_walk
    return out


SIZES = (
    dict(cores=256, nodes=1, candidates=64, queued=2000, options=32, blocked=False),
    dict(cores=1024, nodes=1, candidates=256, queued=8000, options=32, blocked=False),
    dict(cores=256, nodes=1, candidates=64, queued=2000, options=32, blocked=True),
    dict(cores=256, nodes=1, candidates=64, queued=20000, options=32, blocked=True),
    # the paper's CPU testbed, 15 nodes x 256 cores; actions free to go to any node, so every
    # candidate's node is chosen among the 15 (tangram/policy/node_rank.py). Measured after the
    # others, not between them: its 11 ms rounds evicted the small rounds' data from the CPU's
    # caches and its heap lengthened their collections (the 256-core round 0.36 -> 0.55-0.61 ms).
    dict(cores=3840, nodes=15, candidates=960, queued=30000, options=32, blocked=False),
)
INTERLEAVED = 4  # the first sizes, measured round by round in turn


def size_specs(smoke: bool = False) -> list[dict]:
    """The sizes measured (bench_policy_ab.py compares the same), queues 10x shorter for a smoke run."""
    return [{**s, "queued": s["queued"] // 10} if smoke else dict(s) for s in SIZES]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeats", type=int, default=100, help="full rounds measured per size")
    ap.add_argument("--events", type=int, default=2000, help="stream events measured per size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="queues 10x shorter: checks the script runs")
    ap.add_argument("--against-source", action="store_true",
                    help="also time each size's round with the estimate's plain-Python loops, side by side")
    args = ap.parse_args(argv)

    specs = size_specs(args.smoke)
    global PAUSES
    frozen = freeze_startup_objects()  # as `tangram serve` does once built: the imports, not the queues
    PAUSES = GcPauses()
    try:
        out = _measure(args, specs, frozen)
    finally:  # a test runs main() in its own process: leave it as found
        PAUSES.close()
        gc.unfreeze()
    if args.json:
        print(json.dumps(out))
    else:
        for r in out["sizes"]:
            print(f"{r['cores']:>5} cores, {r['candidates']:>4} candidates, {r['queued']:>6} queued"
                  f"{' (blocked on memory)' if r['blocked_on_memory'] else '':<21}: round median "
                  f"{r['round_median_ms']:.3f} ms, p99 {r['round_p99_ms']:.3f} ms "
                  f"(CPU {r['round_cpu_median_ms']:.3f} ms), {r['scheduled']} scheduled; "
                  f"event median {r['event_median_ms']:.3f} ms, p99 {r['event_p99_ms']:.3f} ms")
        print("growth:", json.dumps(out["growth"]))
        print("full collections:", json.dumps(out["gc"]))
        print("estimate compiled:", out["estimate_compiled"])
        for r in out.get("against_source", ()):
            print(f"{r['cores']:>5} cores, {r['queued']:>6} queued: round CPU {r['round_cpu_median_ms']:.3f} ms "
                  f"against {r['source_round_cpu_median_ms']:.3f} ms with the plain-Python estimate "
                  f"(per-round ratio {json.dumps(r['ratio'])})")
    return 0


def _measure(args, specs: list[dict], frozen: int) -> dict:
    full_before = _full_collections()
    sizes, against = _measure_together(args, specs[:INTERLEAVED])
    for spec in specs[INTERLEAVED:]:  # alone, once the others are measured and dropped from the heap
        more, more_against = _measure_together(args, [spec])
        sizes += more
        if against is not None:
            against += more_against
    results = [s.result() for s in sizes]
    n_full, full_s = (now - before for now, before in zip(_full_collections(), full_before))
    base, big, blk2k, blk20k, testbed = sizes
    out = {
        "round_median_ms": results[0]["round_median_ms"],
        "round_p99_ms": results[0]["round_p99_ms"],
        "round_cpu_median_ms": results[0]["round_cpu_median_ms"],
        "target_median_ms": 0.5,
        "estimate_compiled": bool(estimate._hot.COMPILED),
        "estimate_on_c_arrays": estimate._walk is not estimate._hot.walk,  # walk_arrays.pyx, built
        # the modules of a round setup.py compiled whole that ran compiled (compiled.NATIVE)
        "policy_compiled": compiled_modules(compiled),
        "sizes": results,
        "gc": {  # the process's full collections while measuring (all sizes' queues in one heap)
            "frozen_at_start": frozen,
            "full_collections": n_full,
            "full_pause_total_ms": round(full_s * 1e3, 3),
            "full_pause_mean_ms": round(full_s * 1e3 / n_full, 3) if n_full else None,
        },
        "growth": {
            "cores_4x": _ratios(base.rounds, big.rounds),  # target <= 4
            "queued_10x_blocked": _ratios(blk2k.rounds, blk20k.rounds),  # target <= 2
            "queued_10x_blocked_events": _ratios(blk2k.events, blk20k.events),
            "cores_4x_cpu": _ratios(base.round_cpu, big.round_cpu),  # the same, in CPU time
            "queued_10x_blocked_cpu": _ratios(blk2k.round_cpu, blk20k.round_cpu),
            # 15x the cores and candidates on 15 nodes (no target: the are on one node);
            # medians of rounds measured apart, not per-repeat ratios
            "testbed_15x_nodes": {"ratio_of_medians": round(statistics.median(testbed.rounds)
                                                            / statistics.median(base.rounds), 3)},
        },
    }
    if against is not None:
        out["against_source"] = against
    return out


if __name__ == "__main__":
    sys.exit(main())
