"""The shape every demo workload reports in (``tangram demo --json``, last line)::

    {"workload": "coding",
     "policies": {NAME: {"mean_act_s", "p50_act_s", "p99_act_s", "step_time_s",   # medians over runs
                         "spread": {METRIC: [min, max]}, "runs": [per-run summary, ...],
                         "runs_without": {FIELD: n}, ...}},                       # runs where FIELD was None
     "ratios": {BASELINE: {"mean_act": x, "p99_act": x, "step_time": x,          # baseline / reference
                           "within_spread": {"mean_act": bool, ...},             # the min..max overlap
                           "verdict": {"mean_act": "better" | "worse" | "equal" | "within noise" | "one run"},
                           "runs": [n reference, n baseline]}},
     "reference": "tangram", "projection": {...} | null, ...}

A workload builds one per-run summary dict per run (its own extra fields are
kept), and :func:`policy_entry` / :func:`compare` / :func:`document` do the rest.

A verdict ("better"/"worse", from the reference's side) needs at least 2 runs of
each policy and their min..max not overlapping; anything else is within noise.
"""
from __future__ import annotations

import statistics
from typing import Any, Iterable, Mapping, Sequence

from tangram.runtime.stats import percentile as _nearest_rank

# metric key in a run summary -> its name in ratios; lower is better for all of them
HEADLINE = {"mean_act_s": "mean_act", "p50_act_s": "p50_act", "p99_act_s": "p99_act", "step_time_s": "step_time"}
MIN_RUNS = 2  # runs of each policy a verdict needs: one run's min..max is one point, no spread


def percentile(xs: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]), the runtime's; 0.0 for no samples."""
    v = _nearest_rank(sorted(xs), q)
    return 0.0 if v is None else v


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def policy_entry(runs: list[Mapping[str, Any]], summed: Sequence[str] = ()) -> dict[str, Any]:
    """The medians over ``runs`` of every numeric field (``failed`` and the ``summed`` counts: their sums),
    the headline metrics' [min, max], the runs. A field that is None in some runs (a teacher none of
    whose actions succeeded) is the median of the runs that have it; ``runs_without`` counts the others."""
    if not runs:
        raise ValueError("a policy needs at least one run")
    keys: list[str] = []
    for r in runs:
        keys += [k for k, v in r.items() if k not in keys and (_number(v) or v is None)]
    out: dict[str, Any] = {}
    without: dict[str, int] = {}
    for k in keys:
        vals = [r[k] for r in runs if _number(r.get(k))]
        if len(vals) < len(runs):
            without[k] = len(runs) - len(vals)
        if not vals:
            if any(k in r for r in runs):
                out[k] = None  # no run had a value: said, not dropped
            continue
        if k == "failed" or k in summed:
            out[k] = round(sum(vals), 4)
            continue
        med = statistics.median(vals)
        if all(isinstance(v, int) for v in vals) and float(med).is_integer():
            out[k] = int(med)  # counts stay counts
        else:
            out[k] = round(med, 4)
    if without:
        out["runs_without"] = without
    out["spread"] = {k: [round(min(r[k] for r in runs), 4), round(max(r[k] for r in runs), 4)]
                     for k in HEADLINE if all(_number(r.get(k)) for r in runs)}
    out["runs"] = [dict(r) for r in runs]
    return out


def _overlap(ref: Mapping[str, Any], other: Mapping[str, Any], key: str) -> bool:
    """The two policies' runs' min..max on ``key`` overlap."""
    (a_lo, a_hi), (b_lo, b_hi) = ref["spread"][key], other["spread"][key]
    return a_lo <= b_hi and b_lo <= a_hi


def judge(ref: Mapping[str, Any], other: Mapping[str, Any], key: str) -> str:
    """The reference against ``other`` on ``key`` (lower is better): "better", "worse", "equal",
    "within noise" (the runs' min..max overlap) or "one run" (a policy with fewer than 2 runs)."""
    if ref[key] == other[key]:
        return "equal"
    if min(len(ref.get("runs", ())), len(other.get("runs", ()))) < MIN_RUNS:
        return "one run"
    if _overlap(ref, other, key):
        return "within noise"
    return "better" if ref["spread"][key][1] < other["spread"][key][0] else "worse"


def compare(policies: Mapping[str, Mapping[str, Any]], reference: str) -> dict[str, dict[str, Any]]:
    """Per baseline: median(baseline) / median(reference) per headline metric (> 1: the reference's is
    lower), whether the two policies' run ranges overlap, and the verdict (:func:`judge`)."""
    ref = policies[reference]
    out: dict[str, dict[str, Any]] = {}
    for name, p in policies.items():
        if name == reference:
            continue
        r: dict[str, Any] = {}
        within: dict[str, bool] = {}
        verdicts: dict[str, str] = {}
        for key, short in HEADLINE.items():
            if key not in p.get("spread", {}) or key not in ref.get("spread", {}):
                continue
            r[short] = round(p[key] / ref[key], 3) if ref[key] > 0 else None
            within[short] = _overlap(ref, p, key)
            verdicts[short] = judge(ref, p, key)
        r["within_spread"] = within
        r["verdict"] = verdicts
        r["runs"] = [len(ref.get("runs", ())), len(p.get("runs", ()))]
        out[name] = r
    return out


def document(workload: str, policies: Mapping[str, Mapping[str, Any]], *, reference: str,
             projection: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"workload": workload, "reference": reference, "policies": dict(policies),
            "ratios": compare(policies, reference), "projection": projection, **extra}


def _ratio(x: float) -> str:
    s = f"{x:.2f}"
    return f"{x:.3f}" if s == "1.00" and x != 1.0 else s  # never "1.00x" for a ratio that is not 1


def verdict(name: str, r: Mapping[str, Any], reference: str = "tangram") -> str:
    """One plain sentence on a baseline's ratios."""
    parts = []
    for short, label in (("mean_act", "mean ACT"), ("p99_act", "p99 ACT"), ("step_time", "step time")):
        x = r.get(short)
        if x is None:
            continue
        v = r.get("verdict", {}).get(short, "within noise")
        why = {"better": f"{reference} better", "worse": f"{reference} worse", "equal": "equal",
               "within noise": "within noise: the runs' min..max overlap",
               "one run": "within noise: one run, no spread"}[v]
        parts.append(f"{label} {_ratio(x)}x ({why})")
    return f"{name} / {reference}: " + "; ".join(parts)


def one_run_note(runs: int) -> str | None:
    """What to say when a policy ran once: its min..max is one point, so no verdict is possible."""
    if runs >= MIN_RUNS:
        return None
    return ("one run per policy: its min..max is a single point, so no difference is a verdict "
            f"(every one is within noise); run --repeats {MIN_RUNS + 1} or more for one")
