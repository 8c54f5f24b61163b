"""Sweep -> fit -> store: what ``tangram profile`` does.

Configuration, as YAML (``tangram profile --config sweep.yaml``)::

    out: profiles.json            # the profile store (``--out`` overrides)
    executor: auto                # auto (docker if image else local) | local | docker | subprocess
    max_cv_error: 1.0             # classes noisier than this are reported unfit
    defaults: {repeats: 3, warmups: 1, dops: [1, 2, 4]}
    classes:
      more-itertools:
        command: python -m pytest -q -p no:cacheprovider -n ${parallel_num} tests
        workdir: /data/suites/more-itertools-10.5.0
      attrs:
        command: pytest -q -n ${parallel_num} tests
        image: tangram-sandbox:latest
        timeout_s: 600

``classes`` may also be a list of objects with a ``name`` key. Omitted
``dops`` default to 1, 2, 4, ... up to the cores available.
"""
from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from profiling.fit import DEFAULT_MAX_CV_ERROR, FitResult, Unfit, fit_class, summarize
from profiling.store import ProfileStore, StoreError, entry_from_fit
from profiling.sweep import ClassOutcome, ClassSpec, SampleLog, make_executor, samples_path, sweep

_SPEC_KEYS = {"command", "workdir", "image", "dops", "repeats", "warmups", "timeout_s", "env"}


@dataclass(slots=True)
class SweepConfig:
    classes: list[ClassSpec]
    out: str | None = None
    executor: str = "auto"
    max_cv_error: float = DEFAULT_MAX_CV_ERROR
    extra: dict[str, Any] = field(default_factory=dict)


def parse_config(doc: Mapping[str, Any], *, source: str = "config") -> SweepConfig:
    if not isinstance(doc, Mapping):
        raise ValueError(f"{source}: expected a mapping at the top level")
    defaults = dict(doc.get("defaults") or {})
    unknown = set(defaults) - _SPEC_KEYS
    if unknown:
        raise ValueError(f"{source}: defaults: unknown keys {sorted(unknown)}")
    raw = doc.get("classes")
    if isinstance(raw, Mapping):
        items = [(str(k), v or {}) for k, v in raw.items()]
    elif isinstance(raw, list):
        items = []
        for i, v in enumerate(raw):
            if not isinstance(v, Mapping) or "name" not in v:
                raise ValueError(f"{source}: classes[{i}]: needs a 'name'")
            items.append((str(v["name"]), {k: x for k, x in v.items() if k != "name"}))
    else:
        raise ValueError(f"{source}: 'classes' must be a mapping or a list")
    if not items:
        raise ValueError(f"{source}: no classes to profile")
    specs = []
    for name, body in items:
        if isinstance(body, str):
            body = {"command": body}
        unknown = set(body) - _SPEC_KEYS
        if unknown:
            raise ValueError(f"{source}: classes.{name}: unknown keys {sorted(unknown)}")
        merged = {**defaults, **body}
        if "command" not in merged:
            raise ValueError(f"{source}: classes.{name}: 'command' is required")
        if "env" in merged:
            merged["env"] = {str(k): str(v) for k, v in (merged["env"] or {}).items()}
        try:
            specs.append(ClassSpec(name=name, **merged))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: classes.{name}: {exc}") from None
    return SweepConfig(classes=specs, out=doc.get("out"), executor=str(doc.get("executor", "auto")),
                       max_cv_error=float(doc.get("max_cv_error", DEFAULT_MAX_CV_ERROR)))


def load_config(path: str) -> SweepConfig:
    import yaml

    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return parse_config(doc, source=path)


@dataclass(slots=True)
class ProfileRun:
    store: ProfileStore | None
    outcomes: list[ClassOutcome]
    fits: dict[str, FitResult | Unfit]
    wrote: bool
    exit_code: int


def fit_outcomes(outcomes: list[ClassOutcome], *, max_cv_error: float) -> dict[str, FitResult | Unfit]:
    fits: dict[str, FitResult | Unfit] = {}
    for o in outcomes:
        if o.error is not None:
            continue
        dops = o.spec.dop_list()
        fits[o.spec.name] = fit_class(o.samples, feasible=range(1, max(dops) + 1), max_cv_error=max_cv_error)
    return fits


def run_profile(config: SweepConfig, out: str, *, progress: bool = True, restart: bool = False,
                console=None, err_console=None) -> ProfileRun:
    """Sweep every class, fit, merge into the store at ``out``; report on the consoles."""
    from rich.console import Console

    console = console or Console()
    err_console = err_console or Console(stderr=True)
    log_path = samples_path(out)
    existed = log_path.exists()
    if restart and existed:
        log_path.unlink()
        existed = False
    log = SampleLog(log_path)
    executors: dict[str, Any] = {}

    def executor_for(spec: ClassSpec):
        kind = config.executor if config.executor != "auto" else ("docker" if spec.image else "local")
        if kind not in executors:
            executors[kind] = make_executor(kind, spec)
        return executors[kind]

    async def go():
        try:
            if progress:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

                with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), console=err_console, transient=False) as bar:
                    return await sweep(config.classes, executor_for, log, progress=bar)
            return await sweep(config.classes, executor_for, log)
        finally:
            for ex in executors.values():
                await ex.close()

    outcomes = asyncio.run(go())
    failed = [o for o in outcomes if o.error is not None]
    for o in failed:
        err_console.print(f"[bold red]error[/]: {o.error}", highlight=False, markup=True)
        if o.error.stderr:
            sys.stderr.write(o.error.stderr.rstrip() + "\n")
            sys.stderr.flush()
    fits = fit_outcomes(outcomes, max_cv_error=config.max_cv_error)
    if not existed and log_path.exists() and not log.records:
        log_path.unlink()
    if not fits:  # every class failed: write nothing
        if not existed and log_path.exists() and not any(r for r in log.records):
            log_path.unlink()
        return ProfileRun(None, outcomes, fits, False, 1)
    new = ProfileStore()
    for o in outcomes:
        f = fits.get(o.spec.name)
        if f is None:
            continue
        measured = {d: [s.seconds for s in o.samples if s.dop == d] for d in sorted({s.dop for s in o.samples})}
        if isinstance(f, FitResult):
            new.put(o.spec.name, entry_from_fit(f, measured=measured, command=o.spec.command,
                                                workdir=o.spec.workdir, image=o.spec.image))
        else:
            new.put_unfit(o.spec.name, f.reason, samples=f.samples, dops=f.dops,
                          measured={str(d): xs for d, xs in measured.items()}, command=o.spec.command)
    store = new
    if os.path.exists(out):
        try:
            store = ProfileStore.load(out).merge(new)
        except (StoreError, OSError) as exc:
            err_console.print(f"[yellow]warning[/]: {out} is not a readable profile store ({exc}); replacing it")
    store.save(out)
    print_fit_table(console, store, only=[o.spec.name for o in outcomes if o.spec.name in fits])
    unfit = [n for n, f in fits.items() if isinstance(f, Unfit)]
    for n in unfit:
        err_console.print(f"[bold yellow]unfit[/]: class {n!r}: {fits[n].reason}")
    return ProfileRun(store, outcomes, fits, True, 1 if (failed or unfit) else 0)


def print_fit_table(console, store: ProfileStore, only: list[str] | None = None) -> None:
    from rich.table import Table

    names = [n for n in (only or sorted(set(store.classes) | set(store.unfit)))]
    t = Table(title="calibrated profiles")
    for col in ("class", "model", "T1 (s)", "E(m) at measured DoPs", "s", "CV err", "samples"):
        t.add_column(col)
    for n in names:
        if n in store.classes:
            e = store.classes[n]
            dops = e.get("dops") or sorted(int(k) for k in e["efficiency"])
            eff = "  ".join(f"{d}:{e['efficiency'].get(str(d), float('nan')):.2f}" for d in dops)
            s = e.get("serial_fraction")
            cv = e.get("cv_error")
            t.add_row(n, str(e.get("model", "?")), f"{e['t1_s']:.3f}", eff, "-" if s is None else f"{s:.3f}",
                      "-" if cv is None else f"{cv:.3f}", str(e["samples"]))
        elif n in store.unfit:
            u = store.unfit[n]
            t.add_row(n, "[yellow]unfit[/]", "-", str(u.get("reason", "")), "-", "-", str(u.get("samples", "-")))
    console.print(t)


def measured_summary(entry: Mapping[str, Any]) -> dict[int, dict[str, float]]:
    from profiling.fit import Sample

    meas = entry.get("measured") or {}
    return summarize(Sample(int(d), float(x)) for d, xs in meas.items() for x in xs)
