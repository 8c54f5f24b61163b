"""Scheduling policy: pure functions over a read-only snapshot (DESIGN.md §4).

Public, stable API: :func:`arrange`, :class:`UnitsOperator`,
:class:`ChunkOperator`, :class:`Arrangement`.
"""
from tangram.policy.compiled import install_native_finder

install_native_finder()  # before any module it judges is imported (tangram/policy/compiled.py)

from tangram.policy.arrange import (  # noqa: E402
    Arrangement,
    ChunkOperator,
    UnitsOperator,
    arrange,
    packable,
    prefix_table,
)

__all__ = ["Arrangement", "ChunkOperator", "UnitsOperator", "arrange", "packable", "prefix_table"]
