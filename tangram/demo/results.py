"""The shape every demo workload reports in (``tangram demo --json``, last line)::

    {"workload": "coding",
     "policies": {NAME: {"mean_act_s", "p50_act_s", "p99_act_s", "step_time_s",   # medians over runs
                         "spread": {METRIC: [min, max]}, "runs": [per-run summary, ...], ...}},
     "ratios": {BASELINE: {"mean_act": x, "p99_act": x, "step_time": x,          # baseline / reference
                           "within_spread": {"mean_act": bool, ...}}},
     "reference": "tangram", "projection": {...} | null, ...}

A workload builds one per-run summary dict per run (its own extra fields are
kept), and :func:`policy_entry` / :func:`compare` / :func:`document` do the rest.
"""
from __future__ import annotations

import statistics
from typing import Any, Iterable, Mapping, Sequence

# metric key in a run summary -> its name in ratios; lower is better for all of them
HEADLINE = {"mean_act_s": "mean_act", "p50_act_s": "p50_act", "p99_act_s": "p99_act", "step_time_s": "step_time"}


def percentile(xs: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    if not s:
        return 0.0
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def policy_entry(runs: list[Mapping[str, Any]], summed: Sequence[str] = ()) -> dict[str, Any]:
    """The medians over ``runs`` of every numeric field (``failed`` and the ``summed`` counts: their sums),
    the headline metrics' [min, max], the runs."""
    if not runs:
        raise ValueError("a policy needs at least one run")
    numeric = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out: dict[str, Any] = {}
    for k in numeric:
        vals = [r[k] for r in runs if k in r]
        med = statistics.median(vals)
        if all(isinstance(v, int) for v in vals) and float(med).is_integer():
            med = int(med)  # counts stay counts
        if k == "failed" or k in summed:
            out[k] = round(sum(vals), 4)
        else:
            out[k] = med if isinstance(med, int) else round(med, 4)
    out["spread"] = {k: [round(min(r[k] for r in runs), 4), round(max(r[k] for r in runs), 4)]
                     for k in HEADLINE if k in runs[0]}
    out["runs"] = [dict(r) for r in runs]
    return out


def compare(policies: Mapping[str, Mapping[str, Any]], reference: str) -> dict[str, dict[str, Any]]:
    """Per baseline: median(baseline) / median(reference) per headline metric (> 1: the reference is
    better), and whether the two policies' run ranges overlap (then the difference is within the spread)."""
    ref = policies[reference]
    out: dict[str, dict[str, Any]] = {}
    for name, p in policies.items():
        if name == reference:
            continue
        r: dict[str, Any] = {}
        within: dict[str, bool] = {}
        for key, short in HEADLINE.items():
            if key not in p or key not in ref:
                continue
            r[short] = round(p[key] / ref[key], 3) if ref[key] > 0 else None
            (a_lo, a_hi), (b_lo, b_hi) = ref["spread"][key], p["spread"][key]
            within[short] = a_lo <= b_hi and b_lo <= a_hi
        r["within_spread"] = within
        out[name] = r
    return out


def document(workload: str, policies: Mapping[str, Mapping[str, Any]], *, reference: str,
             projection: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"workload": workload, "reference": reference, "policies": dict(policies),
            "ratios": compare(policies, reference), "projection": projection, **extra}


def verdict(name: str, r: Mapping[str, Any], reference: str = "tangram") -> str:
    """One plain sentence on a baseline's ratios."""
    parts = []
    for short, label in (("mean_act", "mean ACT"), ("p99_act", "p99 ACT"), ("step_time", "step time")):
        x = r.get(short)
        if x is None:
            continue
        if r["within_spread"].get(short):
            parts.append(f"{label} {x:.2f}x (within the spread: no measurable difference)")
        else:
            parts.append(f"{label} {x:.2f}x ({reference} {'better' if x > 1 else 'worse'})")
    return f"{name} / {reference}: " + "; ".join(parts)
