"""``tangram version``."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("version", help="print the version")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from tangram import __version__

    print(__version__)
    return 0
