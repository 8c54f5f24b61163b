"""The ``tangram`` command line: one subcommand per module, registered lazily.

Each entry names a module with a ``register(subparsers)`` function that adds
its subparser and sets ``func``; the module is imported only when listed, and
heavy imports stay inside ``func`` so ``tangram --help`` is fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# module paths, in the order they appear in --help
COMMAND_MODULES = (
    "tangram.commands.version",
    "tangram.commands.demo",
    "tangram.commands.serve",
    "datasets_patch.cli",
    "tangram.commands.profile",
    "tangram.commands.tune",
    "tangram.commands.simulate",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tangram",
        description="ARL-Tangram: action-level elastic resource management for agentic RL.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # an optional extra is missing: say so, keep the rest
            print(f"tangram: command module {name} unavailable: {exc}", file=sys.stderr)
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
