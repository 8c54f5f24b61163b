#!/usr/bin/env python3
"""What the local executor's sandbox costs per action: ``true`` (and a short ``python3 -c``) run
through :class:`LocalExecutor` with ``sandbox="sandbox"`` and ``sandbox="none"``, interleaved in the
same run (the machine is shared and noisy), on one pinned core. Prints JSON: per mode the median and
p90 wall time of one exec call over ``--n`` calls per round, and the sandbox/none ratio of medians per
round (its spread over ``--rounds`` rounds)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tangram.executors.base import Placement  # noqa: E402
from tangram.executors.local import LocalExecutor  # noqa: E402


async def main_async(n: int, rounds: int) -> dict:
    core = sorted(os.sched_getaffinity(0))[-1]
    out: dict = {"n_per_round": n, "rounds": rounds, "core": core, "commands": {}}
    with tempfile.TemporaryDirectory(prefix="tangram-bench-sandbox-") as tmp:
        exs = {mode: LocalExecutor(os.path.join(tmp, mode), sandbox=mode) for mode in ("sandbox", "none")}
        for ex in exs.values():
            await ex.create_environment("e", memory_mb=512)
        try:
            for label, cmd in (("true", "true"), ("python3 -c pass", "python3 -c pass")):
                samples = {m: [] for m in exs}
                ratios = []
                for _ in range(rounds):
                    per = {m: [] for m in exs}
                    for i in range(n):
                        for mode, ex in (exs.items() if i % 2 == 0 else reversed(list(exs.items()))):
                            t = time.perf_counter()
                            r = await ex.exec("e", cmd, Placement(f"{mode}-{i}", "local", dop=1, cores=(core,)))
                            per[mode].append(time.perf_counter() - t)
                            assert r.status == "succeeded", r
                    for m in exs:
                        samples[m] += per[m]
                    ratios.append(statistics.median(per["sandbox"]) / statistics.median(per["none"]))
                out["commands"][label] = {
                    **{m: {"median_ms": round(1e3 * statistics.median(v), 2),
                           "p90_ms": round(1e3 * sorted(v)[int(0.9 * (len(v) - 1))], 2)} for m, v in samples.items()},
                    "ratio_sandbox_over_none": {"median": round(statistics.median(ratios), 2),
                                                "min": round(min(ratios), 2), "max": round(max(ratios), 2)},
                }
        finally:
            for ex in exs.values():
                await ex.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=30, help="calls per mode per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one JSON object (default: indented)")
    a = p.parse_args()
    r = asyncio.run(main_async(a.n, a.rounds))
    print(json.dumps(r) if a.json else json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
