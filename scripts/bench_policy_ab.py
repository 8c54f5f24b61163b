#!/usr/bin/env python3
"""The policy of this checkout against the policy of an earlier commit, side by side in one process.

On a shared machine whose speed changes between runs, only times taken in the
same process, round by round, compare two versions. This script loads
``tangram/policy`` of ``--base`` (a git revision) beside the working tree's as a
package of its own (``_base_policy``; the rest of ``tangram`` is shared), then:

* rounds (default): for each size of ``scripts/bench_scheduler.py``, both plans
  of the same engine snapshot, alternating which goes first, CPU time of each;
  the dispatches must be equal (it stops if they are not: a speed-up must not
  change a decision);
* ``--simulate W B``: a simulator run of workload ``W`` at batch ``B`` whose every
  round is planned by both (the run follows this checkout's plan, and the two
  plans must be equal), CPU time of each summed.

Prints one JSON object: per size (or for the run) the median per-round ratio
new / base with p10-p90, or the ratio of the summed times. The base's ACT
estimate runs the installed compiled walk when its ``walk.py`` is unchanged, and
its own, compiled here with Cython, when it is not (``estimate_compiled`` says
which each side ran). A base whose policy compiles the modules of a round whole
(``compiled.NATIVE``) has them compiled here too, by this checkout's setup.py
(``policy_compiled`` lists, per side, the modules that ran compiled): both sides
run compiled, with this checkout's build settings.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

BASE = "_base_policy"


def load_base(rev: str, into: Path):
    """``tangram/policy`` at ``rev`` as the package ``_base_policy`` (imports of it rewritten)."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "tangram/policy"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    pkg = into / BASE
    (into / "tangram" / "policy").rename(pkg)
    # its walk: the installed compiled module when the base's source is the same, else the base's source;
    # its walk on C arrays (walk_arrays.pyx, when it has one) likewise, the installed one only beside
    # the installed walk (it is that walk's copy)
    same_walk = (pkg / "walk.py").read_bytes() == (ROOT / "tangram/policy/walk.py").read_bytes()
    arrays = pkg / "walk_arrays.pyx"
    same_arrays = same_walk and arrays.exists() and \
        arrays.read_bytes() == (ROOT / "tangram/policy/walk_arrays.pyx").read_bytes()
    keep = r"walk\b|walk_arrays\b" if same_arrays else r"walk\b"
    for f in pkg.glob("*.py"):
        text = f.read_text()
        text = re.sub(rf"\btangram\.policy\.(?!{keep})", f"{BASE}.", text)
        text = text.replace("from tangram.policy import", f"from {BASE} import")
        f.write_text(text)
    if not same_walk:
        est = pkg / "estimate.py"
        est.write_text(est.read_text().replace("_hot = walk_module()", f"_hot = walk_module('{BASE}.walk')"))
    native = _native_of(pkg)
    if not same_walk or (arrays.exists() and not same_arrays) or native:
        _compile_base(pkg, walk=not same_walk, arrays=arrays.exists() and not same_arrays, native=native)
    for name in [m for m in sys.modules if m == BASE or m.startswith(BASE + ".")]:
        del sys.modules[name]  # an earlier call's base
    sys.path.insert(0, str(into))
    import importlib
    importlib.invalidate_caches()  # the libraries just built in a directory imported from before
    return importlib.import_module(f"{BASE}.schedule"), importlib.import_module(f"{BASE}.estimate")


def _native_of(pkg: Path) -> tuple[str, ...]:
    """The modules the base's policy compiles whole (its ``compiled.NATIVE``; none before it had them)."""
    for node in ast.parse((pkg / "compiled.py").read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        if any(getattr(t, "id", None) == "NATIVE" for t in targets):
            return tuple(ast.literal_eval(node.value))
    return ()


def _compile_base(pkg: Path, walk: bool = True, arrays: bool = False, native: tuple[str, ...] = ()) -> None:
    """Build the base's ``walk.py`` (with its ``walk.pxd``), its ``walk_arrays.pyx`` and/or its
    ``native`` modules with setup.py's own extensions and build command (this checkout's
    directives), which record each digest beside it, rewritten as the base's own ``compiled.py``
    checks it, so that both sides run compiled; what cannot be built the base runs as its source,
    and ``estimate_compiled`` / ``policy_compiled`` say so."""
    paths = (repr(f"{BASE}/walk.py") if walk else "None", repr(f"{BASE}/walk_arrays.pyx") if arrays else "None",
             repr(tuple(f"{BASE}/{name}.py" for name in native)))
    build = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from setuptools import setup; "
             "from setup import OptionalBuildExt, extensions; "
             "sys.argv[1:] = ['-q', 'build_ext', '--inplace']; "
             f"setup(ext_modules=extensions({', '.join(paths)}), cmdclass={{'build_ext': OptionalBuildExt}})")
    done = subprocess.run([sys.executable, "-c", build], cwd=pkg.parent, capture_output=True, text=True)
    _record_as_the_base_judges(pkg)
    for wanted, name in ((walk, "walk"), (arrays, "walk_arrays"), *((True, n) for n in native)):
        if wanted and (done.returncode != 0 or not any(pkg.glob(f"{name}.*.so.sha256"))):
            print(f"the base's {name} was not compiled: {done.stderr.strip()[-400:]}", file=sys.stderr)


def _record_as_the_base_judges(pkg: Path) -> None:
    """Rewrite each record this checkout's setup.py left beside a base library with the digest the
    base's own ``compiled.py`` checks (an older one covers other inputs, e.g. no directives):
    otherwise the base would judge its fresh libraries stale and run its sources."""
    if not (pkg / "compiled.py").exists():
        return  # nothing of the base judges them but this checkout's compiled.py
    spec = importlib.util.spec_from_file_location("_base_policy_compiled", pkg / "compiled.py")
    own = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(own)  # the standard library only, as setup.py loads this checkout's
    for record in pkg.glob("*.so.sha256"):
        short = record.name.split(".", 1)[0]
        source = pkg / f"{short}.py" if (pkg / f"{short}.py").exists() else pkg / f"{short}.pyx"
        record.write_text(own.source_digest(source) + "\n")


def _same(pa, pb) -> bool:
    """Every field of the two plans: dispatches (action, node, units, pools, memory placed,
    estimate), what could not start, and the held groups with the classes their inputs read."""
    def key(p):
        return ([(d.action.id, d.node, dict(d.units), dict(d.pools), d.place_mem_mb, d.estimated_s)
                 for d in p.dispatches], list(p.unfit.items()), dict(p.holdouts), p.holdout_classes)
    return key(pa) == key(pb)


def _ratios(base: list[float], new: list[float]) -> dict | None:
    rs = sorted(n / b for b, n in zip(base, new) if b > 0)
    if not rs:
        return None  # no round took measurable time on the base's side
    return {"median": round(statistics.median(rs), 3), "p10": round(rs[len(rs) // 10], 3),
            "p90": round(rs[9 * len(rs) // 10], 3)}


def rounds(base_plan, new_plan, repeats: int, seed: int, smoke: bool = False) -> list[dict]:
    from bench_scheduler import Size, size_specs
    specs = size_specs(smoke)
    out = []
    for spec in specs:
        eng = Size(seed=seed, **spec).engine
        times: dict[str, list[float]] = {"base": [], "new": []}
        for i in range(repeats + 1):
            snap = eng.snapshot()
            plans = {}
            for tag, plan in ((("base", base_plan), ("new", new_plan)) if i % 2 else
                              (("new", new_plan), ("base", base_plan))):
                c0 = time.thread_time()
                plans[tag] = plan(snap)
                if i:  # the first pair warms both
                    times[tag].append((time.thread_time() - c0) * 1e3)
            if not _same(plans["base"], plans["new"]):
                raise SystemExit(f"the two policies planned differently at {spec}")
        out.append({"cores": spec["cores"], "queued": spec["queued"], "blocked_on_memory": spec["blocked"],
                    "base_round_cpu_median_ms": round(statistics.median(times["base"]), 4),
                    "new_round_cpu_median_ms": round(statistics.median(times["new"]), 4),
                    "ratio": _ratios(times["base"], times["new"])})
    return out


def simulate(base_plan, new_plan, workload: str, batch: int, seed: int) -> dict:
    import tangram.simulator.policies as policies
    from tangram.simulator.sim import simulate as run
    from tangram.simulator.workload import load_workload
    spent = {"base": 0.0, "new": 0.0}
    calls = [0]

    def both(snap):
        calls[0] += 1
        plans = {}
        for tag, plan in ((("base", base_plan), ("new", new_plan)) if calls[0] % 2 else
                          (("new", new_plan), ("base", base_plan))):
            c0 = time.thread_time()
            plans[tag] = plan(snap)
            spent[tag] += time.thread_time() - c0
        if not _same(plans["base"], plans["new"]):
            raise SystemExit(f"the two policies planned differently in round {calls[0]}")
        return plans["new"]

    init = policies.PolicySpec.__init__

    def with_both(self, *a, **kw):
        init(self, *a, **kw)
        if self.plan is policies.elastic_plan:
            object.__setattr__(self, "plan", both)

    policies.PolicySpec.__init__ = with_both
    try:
        run(load_workload(workload).with_batch(batch), "tangram", seed=seed)
    finally:
        policies.PolicySpec.__init__ = init
    return {"workload": workload, "batch": batch, "rounds": calls[0], "base_policy_cpu_s": round(spent["base"], 3),
            "new_policy_cpu_s": round(spent["new"], 3),
            "ratio": round(spent["new"] / spent["base"], 3) if spent["base"] > 0 else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision whose tangram/policy is compared")
    ap.add_argument("--repeats", type=int, default=300, help="rounds per size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--simulate", nargs=2, metavar=("WORKLOAD", "BATCH"),
                    help="compare inside a simulator run instead of on the benchmark's sizes")
    ap.add_argument("--smoke", action="store_true", help="queues 10x shorter: checks the script runs")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base_schedule, base_estimate = load_base(args.base, Path(tmp))
        import tangram.policy.estimate as estimate
        from bench_scheduler import compiled_modules
        from tangram.policy import compiled
        from tangram.policy.schedule import plan as new_plan
        out = {"base": args.base, "estimate_compiled": {"base": bool(base_estimate._hot.COMPILED),
                                                        "new": bool(estimate._hot.COMPILED)},
               # the walk on C arrays (walk_arrays.pyx): a base from before it has none
               "estimate_on_c_arrays": {"base": getattr(base_estimate, "_walk", base_estimate._hot.walk)
                                        is not base_estimate._hot.walk,
                                        "new": estimate._walk is not estimate._hot.walk},
               "policy_compiled": {"base": compiled_modules(sys.modules.get(f"{BASE}.compiled")),
                                   "new": compiled_modules(compiled)}}
        if args.simulate:
            out["simulate"] = simulate(base_schedule.plan, new_plan, args.simulate[0], int(args.simulate[1]),
                                       args.seed)
        else:
            out["sizes"] = rounds(base_schedule.plan, new_plan, args.repeats, args.seed, args.smoke)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
