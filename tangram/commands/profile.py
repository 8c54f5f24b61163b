"""``tangram profile``: offline sweeps that calibrate elasticity profiles.

    tangram profile --name NAME --command 'pytest -n ${parallel_num}' --workdir DIR \\
                    --dop 1,2 --repeats 3 --out profiles.json
    tangram profile --config sweep.yaml [--out profiles.json]
    tangram profile report --store profiles.json --out plots/

Exit status: 0 when every class was measured and fitted; 1 when a command
failed (its stderr is printed, nothing is written for it) or a class is
unfit (kept under ``unfit`` in the store, with the reason); 2 on bad usage.
"""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("profile", help="profile action classes (DoP sweeps) and fit elasticity models",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", choices=("run", "report"), default="run",
                   help="run a sweep (default) or report on a store")
    p.add_argument("--config", help="YAML sweep description (see profiling/pipeline.py)")
    p.add_argument("--name", help="action class name (single-class sweep)")
    p.add_argument("--command", help="command to profile; ${parallel_num} is replaced by the DoP")
    p.add_argument("--workdir", help="the command's working directory (a local directory)")
    p.add_argument("--image", help="run in this Docker image instead of a local directory")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the command (repeatable)")
    p.add_argument("--dop", help="DoPs to try, comma-separated (default 1,2,4,... up to the cores available)")
    p.add_argument("--repeats", type=int, help="measured runs per DoP (default 3)")
    p.add_argument("--warmups", type=int, help="unmeasured runs before the first point (default 1)")
    p.add_argument("--timeout", type=float, dest="timeout_s", help="seconds per run before it counts as failed")
    p.add_argument("--executor", choices=("auto", "local", "docker", "subprocess"),
                   help="where commands run (default auto: docker with --image, else local)")
    p.add_argument("--max-cv-error", type=float, help="report classes noisier than this as unfit (default 1.0)")
    p.add_argument("--restart", action="store_true", help="discard the samples of an earlier, interrupted sweep")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", help="run: the profile store (JSON) to write/merge; report: the plot directory")
    p.add_argument("--store", help="report: the profile store to read")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    if args.mode == "report":
        return _report(args, err)
    try:
        config = _config_from(args)
    except (ValueError, OSError) as exc:
        err.print(f"[bold red]tangram profile[/]: {exc}", highlight=False)
        return 2
    out = args.out or config.out
    if not out:
        err.print("[bold red]tangram profile[/]: --out FILE (or 'out:' in the config) is required")
        return 2
    from profiling.pipeline import run_profile

    progress = not args.no_progress
    try:
        result = run_profile(config, out, progress=progress, restart=args.restart, err_console=err)
    except KeyboardInterrupt:
        err.print(f"interrupted: the samples measured so far are in {out}.samples.jsonl; "
                  "rerun the same command to resume", highlight=False)
        return 130
    if result.wrote:
        err.print(f"wrote {out}", highlight=False)
    return result.exit_code


def _config_from(args):
    from profiling.pipeline import SweepConfig, load_config
    from profiling.sweep import ClassSpec

    overrides = {k: getattr(args, k) for k in ("repeats", "warmups", "timeout_s") if getattr(args, k) is not None}
    dops = None
    if args.dop:
        try:
            dops = [int(x) for x in args.dop.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError(f"--dop: expected comma-separated integers, got {args.dop!r}") from None
    env = {}
    for item in args.env:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ValueError(f"--env: expected KEY=VALUE, got {item!r}")
        env[k] = v
    if args.config:
        if args.command or args.name:
            raise ValueError("--config and --name/--command are exclusive")
        config = load_config(args.config)
        for spec in config.classes:
            for k, v in overrides.items():
                setattr(spec, k, v)
            if dops:
                spec.dops = sorted(set(dops))
            spec.env = {**spec.env, **env}
            spec.__post_init__()
    else:
        if not args.name or not args.command:
            raise ValueError("give --config FILE, or --name and --command")
        config = SweepConfig(classes=[ClassSpec(name=args.name, command=args.command, workdir=args.workdir,
                                                image=args.image, dops=dops, env=env, **overrides)])
    if args.executor:
        config.executor = args.executor
    if args.max_cv_error is not None:
        config.max_cv_error = args.max_cv_error
    return config


def _report(args, err) -> int:
    from rich.console import Console

    from profiling.pipeline import print_fit_table
    from profiling.report import write_report
    from profiling.store import ProfileStore, StoreError

    if not args.store or not args.out:
        err.print("[bold red]tangram profile report[/]: --store FILE and --out DIR are required")
        return 2
    try:
        store = ProfileStore.load(args.store)
    except (StoreError, OSError) as exc:
        err.print(f"[bold red]tangram profile report[/]: {exc}", highlight=False)
        return 1
    paths = write_report(store, args.out)
    print_fit_table(Console(), store)
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
