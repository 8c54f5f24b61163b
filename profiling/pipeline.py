"""Sweep -> fit -> store: what ``tangram profile`` does.

Configuration, as YAML (``tangram profile --config sweep.yaml``)::

    out: profiles.json            # the profile store (``--out`` overrides)
    executor: auto                # auto (docker if image else local) | local | docker | subprocess
                                  # (a class with an image needs docker or auto)
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

``classes`` may also be a list of objects with a ``name`` key; a class may
be just its command string. Omitted ``dops`` default to 1, 2, 4, ... up to the
cores available. :mod:`profiling.config` checks all of it before anything
runs: an unknown or misspelt key, a wrong type, a duplicate class name is an
error naming the key.
"""
from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from profiling.config import EXECUTOR_KINDS, SweepConfig, load_config, parse_config  # noqa: F401 - re-exported
from profiling.fit import FitResult, Unfit, fit_class, summarize
from profiling.store import ProfileStore, StoreError, entry_from_fit
from profiling.sweep import ClassOutcome, ClassSpec, SampleLog, available_cores, make_executor, samples_path, sweep


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
    from rich.markup import escape  # messages quote user input: never read it as markup

    console = console or Console()
    err_console = err_console or Console(stderr=True)
    problem = preflight(config, out)
    if problem is not None:  # before a sweep that may take hours, not after it
        err_console.print(f"[bold red]error[/]: {escape(problem)}", highlight=False)
        return ProfileRun(None, [], {}, False, 2)
    ncores = len(available_cores())
    for spec in config.classes:  # measured all the same (a small box's curve), but never silently
        over = [d for d in spec.dop_list() if d > ncores]
        if over:
            err_console.print(f"[yellow]warning[/]: {escape(spec.name)}: DoP {', '.join(map(str, over))} run on the "
                              f"{ncores} cores available: those samples measure oversubscription, and the fit's "
                              f"E(m) there is not what {max(over)} free cores would give", highlight=False)
    log_path = samples_path(out)
    existed = log_path.exists()
    if restart and existed:
        log_path.unlink()
        existed = False
    log = SampleLog(log_path)
    executors: dict[tuple[str, str | None], Any] = {}

    def executor_for(spec: ClassSpec):
        kind = executor_kind(config, spec)
        key = (kind, spec.image if kind == "docker" else None)  # a docker executor accepts only its images
        if key not in executors:
            executors[key] = make_executor(kind, spec)
        return executors[key]

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
                try:
                    await ex.close()
                except Exception as exc:  # noqa: BLE001 - the samples are measured: do not lose them
                    err_console.print(f"[yellow]warning[/]: closing the {ex.name} executor: {exc}", highlight=False)

    outcomes = asyncio.run(go())
    failed = [o for o in outcomes if o.error is not None]
    for o in failed:
        err_console.print(f"[bold red]error[/]: {escape(str(o.error))}", highlight=False, markup=True)
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
    try:  # read again: another run may have written it during the sweep
        store = ProfileStore.load(out).merge(new) if os.path.exists(out) else new
    except (StoreError, OSError) as exc:  # it became unreadable meanwhile: never overwrite what we cannot read
        err_console.print(f"[bold red]error[/]: {escape(f'{out} not written: {exc}')}; the samples are in "
                          f"{escape(str(log_path))}, rerun to fit them once the store is fixed", highlight=False)
        return ProfileRun(None, outcomes, fits, False, 1)
    store.save(out)
    print_fit_table(console, store, only=[o.spec.name for o in outcomes if o.spec.name in fits])
    unfit = [n for n, f in fits.items() if isinstance(f, Unfit)]
    for n in unfit:
        err_console.print(f"[bold yellow]unfit[/]: class {n!r}: {fits[n].reason}")
    return ProfileRun(store, outcomes, fits, True, 1 if (failed or unfit) else 0)


def executor_kind(config: SweepConfig, spec: ClassSpec) -> str:
    return config.executor if config.executor != "auto" else ("docker" if spec.image else "local")


def preflight(config: SweepConfig, out: str) -> str | None:
    """Why this sweep cannot run or its result could not be stored, or None."""
    if config.executor not in EXECUTOR_KINDS:
        return f"executor: must be one of {', '.join(EXECUTOR_KINDS)}, got {config.executor!r}"
    for spec in config.classes:
        kind = executor_kind(config, spec)
        if spec.image and kind != "docker":
            return (f"classes.{spec.name}.image: the {kind} executor runs commands on this machine and cannot "
                    f"run image {spec.image!r}; use executor docker (or auto), or drop the image")
    if os.path.exists(out):
        try:
            ProfileStore.load(out)
        except (StoreError, OSError) as exc:
            return (f"{out}: cannot read the existing profile store, so it is left as it is ({exc}); "
                    "fix or move it, or choose another --out")
    return None


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
