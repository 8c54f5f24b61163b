"""Summaries, the comparison table and the chart of the demo."""
from __future__ import annotations

import statistics
from pathlib import Path

from tangram.demo.rollout import RolloutResult


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def summarize(r: RolloutResult, cores: int) -> dict:
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


def ratios(tangram: dict, baseline: dict) -> dict:
    def ratio(key: str) -> float | None:
        return round(baseline[key] / tangram[key], 3) if tangram.get(key) else None

    return {
        "mean_act": ratio("mean_act_s"),
        "p99_act": ratio("p99_act_s"),
        "step_time": ratio("step_time_s"),
    }


def print_table(console, summaries: dict[str, dict], rat: dict | None) -> None:
    from rich.table import Table

    t = Table(title="Agentic-coding rollout on this machine")
    cols = [("mean ACT", "mean_act_s"), ("p50 ACT", "p50_act_s"), ("p99 ACT", "p99_act_s"),
            ("mean queue", "mean_queue_s"), ("mean exec", "mean_exec_s"), ("step time", "step_time_s")]
    t.add_column("policy")
    for name, _ in cols:
        t.add_column(f"{name} (s)", justify="right")
    t.add_column("core util", justify="right")
    t.add_column("reward DoP", justify="right")
    for policy, s in summaries.items():
        t.add_row(policy, *(f"{s[k]:.2f}" for _, k in cols), f"{100 * s['core_utilisation']:.0f}%",
                  f"{s.get('reward_mean_dop', 0):.1f}")
    console.print(t)
    if rat:
        console.print(
            f"trajectory / tangram: mean ACT {rat['mean_act']}x, p99 ACT {rat['p99_act']}x, "
            f"step time {rat['step_time']}x"
        )


def write_chart(path: Path, summaries: dict[str, dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(summaries)
    metrics = [("mean ACT", "mean_act_s"), ("p99 ACT", "p99_act_s"), ("mean queue", "mean_queue_s"),
               ("step time", "step_time_s")]
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    width = 0.8 / max(1, len(policies))
    for i, p in enumerate(policies):
        xs = [j + i * width for j in range(len(metrics))]
        bars = ax.bar(xs, [summaries[p][k] for _, k in metrics], width, label=p)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks([j + width * (len(policies) - 1) / 2 for j in range(len(metrics))])
    ax.set_xticklabels([m for m, _ in metrics])
    ax.set_ylabel("seconds")
    ax.set_title("ARL-Tangram demo: action-level vs trajectory-level allocation")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
