"""Per-run summaries, the comparison table and the chart of the demo."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Mapping

from tangram.demo.results import HEADLINE, one_run_note, percentile, verdict
from tangram.demo.rollout import RolloutResult

LABELS = {"tangram": "tangram", "ray-tasks": "Ray tasks", "trajectory": "pods (trajectory)"}
COLORS = {"tangram": "tab:blue", "ray-tasks": "tab:orange", "trajectory": "tab:green"}


def summarize(r: RolloutResult, cores: int) -> dict:
    """One run's numbers (the ``runs`` entries of the JSON shape)."""
    acts = [s.act_s for s in r.samples]
    busy = sum(s.exec_s * s.dop for s in r.samples)
    out = {
        "actions": len(acts),
        "mean_act_s": statistics.fmean(acts) if acts else 0.0,
        "p50_act_s": percentile(acts, 50),
        "p99_act_s": percentile(acts, 99),
        "mean_queue_s": statistics.fmean(s.queued_s for s in r.samples) if acts else 0.0,
        "mean_exec_s": statistics.fmean(s.exec_s for s in r.samples) if acts else 0.0,
        "step_time_s": r.step_time_s,
        "core_utilisation": busy / (cores * r.step_time_s) if r.step_time_s > 0 else 0.0,
        "mean_reward": statistics.fmean(r.rewards) if r.rewards else 0.0,
        "failed": sum(not s.ok for s in r.samples),
    }
    for kind in ("shell", "reward"):
        ks = [s for s in r.samples if s.kind == kind]
        if ks:
            out[f"{kind}_mean_act_s"] = statistics.fmean(s.act_s for s in ks)
            out[f"{kind}_mean_dop"] = statistics.fmean(s.dop for s in ks)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def print_table(console, policies: Mapping[str, Mapping[str, Any]], ratios: Mapping[str, Any],
                reference: str = "tangram") -> None:
    from rich.table import Table

    runs = max(len(p["runs"]) for p in policies.values())
    t = Table(title=f"Agentic-coding rollout on this machine: medians of {runs} interleaved runs \\[min..max]")
    t.add_column("policy")
    for key, name in (("mean_act_s", "mean ACT"), ("p50_act_s", "p50 ACT"), ("p99_act_s", "p99 ACT"),
                      ("step_time_s", "step time")):
        t.add_column(f"{name} (s)", justify="right")
    t.add_column("mean queue (s)", justify="right")
    t.add_column("core util", justify="right")
    t.add_column("reward DoP", justify="right")
    t.add_column("failed (sum)", justify="right")
    for name, p in policies.items():
        cells = [f"{p[k]:.2f} [{p['spread'][k][0]:.2f}..{p['spread'][k][1]:.2f}]" for k in HEADLINE]
        t.add_row(LABELS.get(name, name), *cells, f"{p['mean_queue_s']:.2f}", f"{100 * p['core_utilisation']:.0f}%",
                  f"{p.get('reward_mean_dop', 0):.1f}", f"{p['failed']} of {sum(r['actions'] for r in p['runs'])}")
    console.print(t)
    console.print(f"every column but failed: the median of the {runs} runs \\[min..max]; failed: actions failed, summed "
                  "over the runs (a failed action's ACT, often short, is in the means and percentiles)")
    console.print("ratios are baseline / tangram (> 1: tangram lower, i.e. better; every metric: lower is better); "
                  "better/worse only where both ran at least twice and their min..max do not overlap")
    note = one_run_note(min(len(p["runs"]) for p in policies.values()))
    if note:
        console.print(f"[yellow]{note}[/]")
    for name, r in ratios.items():
        console.print("  " + verdict(LABELS.get(name, name), r, reference))


def print_projection(console, proj: Mapping[str, Any]) -> None:
    _projection_table(console, proj, "the measured actions and elasticity on the simulator")
    if proj.get("if_scaling"):
        _projection_table(console, proj["if_scaling"], "the same, IF the suite scaled (Amdahl serial fraction "
                                                      f"{proj['if_scaling']['inputs']['serial_fraction']}, a guess)")


def _projection_table(console, proj: Mapping[str, Any], what: str) -> None:
    from rich.table import Table

    inp = proj["inputs"]
    t = Table(title=f"SIMULATED projection: {proj['trajectories']} trajectories on {proj['cores']} cores "
                    f"({proj['cpu_nodes']} nodes), {what}")
    t.add_column("policy (simulated as)")
    for name in ("mean ACT (s)", "p99 ACT (s)", "step time (s)", "ratio mean ACT", "ratio step time"):
        t.add_column(name, justify="right")
    for name, p in proj["policies"].items():
        r = proj["ratios"].get(name, {})
        as_ = f" ({p['simulated_as']})" if p["simulated_as"] != name else ""  # say it only where it differs
        t.add_row(f"{LABELS.get(name, name)}{as_}", f"{p['mean_act_s']:.2f}",
                  f"{p['p99_act_s']:.2f}", f"{p['step_time_s']:.2f}",
                  f"{r['mean_act']:.2f}x" if r else "-", f"{r['step_time']:.2f}x" if r else "-")
    console.print(t)
    console.print(f"  inputs: shell actions {inp['shell_s']['mean']:.2f} s mean (cv {inp['shell_s']['cv']}, "
                  f"{inp['shell_source']}); reward {inp['reward_t1_s']:.2f} s at DoP 1 ({inp['reward_t1_source']}); "
                  f"Amdahl serial fraction {inp['serial_fraction']} ({inp['serial_fraction_source']})")
    if inp["serial_fraction"] > 0.5:
        console.print("  With this elasticity a reward gains nothing from more cores, so this projection shows "
                      "pooling alone; measure the suite where cores scale (tangram demo --calibrate) or pass "
                      "--project-serial-fraction.")


def write_chart(path: Path, policies: Mapping[str, Mapping[str, Any]], ratios: Mapping[str, Any],
                projection: Mapping[str, Any] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(policies)
    metrics = [("mean ACT", "mean_act_s", "mean_act"), ("p99 ACT", "p99_act_s", "p99_act"),
               ("step time", "step_time_s", "step_time")]
    panels = []
    if projection:
        panels.append((projection, "the measured action durations and elasticity on the simulator"))
        if projection.get("if_scaling"):
            sf = projection["if_scaling"]["inputs"]["serial_fraction"]
            panels.append((projection["if_scaling"], f"the same IF the suite scaled (serial fraction {sf}, a guess)"))
    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(7.5 * (1 + len(panels)), 4.6), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(1, len(names))
    for i, p in enumerate(names):
        xs = [j + i * width for j in range(len(metrics))]
        med = [policies[p][k] for _, k, _ in metrics]
        lo = [policies[p][k] - policies[p]["spread"][k][0] for _, k, _ in metrics]
        hi = [policies[p]["spread"][k][1] - policies[p][k] for _, k, _ in metrics]
        bars = ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=LABELS.get(p, p), color=COLORS.get(p))
        labels = [f"{v:.1f}s" if p not in ratios else f"{v:.1f}s\n{ratios[p][r]:.2f}x"
                  for v, (_, _, r) in zip(med, metrics)]
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)  # room for the labels above the whiskers
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(metrics))])
    ax.set_xticklabels([m for m, _, _ in metrics])
    ax.set_ylabel("seconds (lower is better)")
    ax.set_title("measured on this machine: median, bars = min..max over runs\n"
                 "labels: seconds and baseline / tangram (> 1x: tangram better)", fontsize=9)
    ax.legend(fontsize=8)
    for ax2, (proj, what) in zip(axes[0][1:], panels):
        pn = list(proj["policies"])
        w = 0.8 / max(1, len(pn))
        for i, p in enumerate(pn):
            xs = [j + i * w for j in range(len(metrics))]
            vals = [proj["policies"][p][k] for _, k, _ in metrics]
            bars = ax2.bar(xs, vals, w, label=LABELS.get(p, p), hatch="//", alpha=0.8, color=COLORS.get(p))
            r = proj["ratios"].get(p)
            ax2.bar_label(bars, labels=[f"{v:.1f}s" if not r else f"{v:.1f}s\n{r[m]:.2f}x"
                                        for v, (_, _, m) in zip(vals, metrics)], fontsize=7, padding=2)
        ax2.set_ylim(0, ax2.get_ylim()[1] * 1.15)
        ax2.set_xticks([j + w * (len(pn) - 1) / 2 for j in range(len(metrics))])
        ax2.set_xticklabels([m for m, _, _ in metrics])
        ax2.set_ylabel("seconds (lower is better)")
        ax2.set_title(f"SIMULATED: {proj['trajectories']} trajectories on {proj['cores']} cores\n{what}", fontsize=9)
        ax2.legend(fontsize=8)
    fig.suptitle("ARL-Tangram demo: action-level (tangram) vs Ray tasks vs per-trajectory pods", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
