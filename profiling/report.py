"""``tangram profile report``: one PNG per class and a short table.

Each plot shows the measured durations per DoP (mean with min/max error bars,
the raw samples as faint dots) and the fitted curve ``T(m) = T1 / (E(m) m)``
over every DoP the store has an efficiency for; the title names the model,
``T1``, the serial fraction (Amdahl) and the cross-validated error.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from profiling.store import ProfileStore


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "class"


def plot_class(name: str, entry: dict, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from profiling.pipeline import measured_summary

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    summ = measured_summary(entry)
    if summ:
        ds = sorted(summ)
        means = [summ[d]["mean"] for d in ds]
        lo = [summ[d]["mean"] - summ[d]["min"] for d in ds]
        hi = [summ[d]["max"] - summ[d]["mean"] for d in ds]
        ax.errorbar(ds, means, yerr=[lo, hi], fmt="o", capsize=4, color="C0", label="measured (mean, min-max)")
        for d, xs in (entry.get("measured") or {}).items():
            ax.scatter([int(d)] * len(xs), xs, s=10, alpha=0.35, color="C0")
    if "efficiency" in entry and "t1_s" in entry:
        eff = {int(k): float(v) for k, v in entry["efficiency"].items()}
        ms = sorted(eff)
        ax.plot(ms, [entry["t1_s"] / (eff[m] * m) for m in ms], "-", color="C1",
                label=f"fit: {entry.get('model', '?')}")
        ax.plot(ms, [entry["t1_s"] / m for m in ms], ":", color="grey", label="linear speedup")
        title = f"{name}: {entry.get('model', '?')}, T1={entry['t1_s']:.2f}s"
        if entry.get("serial_fraction") is not None:
            title += f", s={entry['serial_fraction']:.3f}"
        if entry.get("cv_error") is not None:
            title += f", CV err={entry['cv_error']:.3f}"
    else:
        title = f"{name}: unfit ({entry.get('reason', '')})"
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("DoP m (cores)")
    ax.set_ylabel("duration (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(store: ProfileStore, out_dir: str | os.PathLike) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, entry in sorted(store.classes.items()):
        p = out / f"{_safe(name)}.png"
        plot_class(name, entry, p)
        written.append(p)
    for name, entry in sorted(store.unfit.items()):
        if entry.get("measured"):
            p = out / f"{_safe(name)}.unfit.png"
            plot_class(name, entry, p)
            written.append(p)
    return written
