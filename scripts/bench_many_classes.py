#!/usr/bin/env python3
"""Cost of an action through the engine when every action names its own class, against one class.

A client may put anything in ``class`` (a per-request id, by mistake or not); the per-class
estimates must not make each completion cost more as classes accumulate. Each size runs an engine
with an 8-slot API pool, submitting and completing N actions, once with N classes and once with
one, interleaved; prints one JSON object with ``--json`` (microseconds per action, and the ratio).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram.core.engine import Engine  # noqa: E402
from tangram.core.model import Action  # noqa: E402
from tangram.managers.base import CountingManager  # noqa: E402


def run(n: int, unique: bool) -> float:
    now = [0.0]
    eng = Engine([CountingManager({"api:x": 8})], clock=lambda: now[0])
    t0 = time.perf_counter()
    completed = 0
    for i in range(n):
        started = eng.submit(Action.build(f"a{i}", {"api:x": 1}, action_class=f"c{i}" if unique else "c"))
        now[0] += 0.01
        for s in started:
            eng.complete(s.record.action.id)
            completed += 1
    elapsed = time.perf_counter() - t0
    assert not eng.waiting and not eng.running and completed == n  # every action ran
    return elapsed / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[5_000, 20_000, 40_000])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = []
    for n in args.sizes:
        one, many = run(n, unique=False), run(n, unique=True)
        out.append({"actions": n, "one_class_us_per_action": round(one, 1),
                    "class_per_action_us_per_action": round(many, 1), "ratio": round(many / one, 3)})
    result = {"sizes": out}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
