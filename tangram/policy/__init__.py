"""Scheduling policy: pure functions over a read-only snapshot (DESIGN.md §4).

Public, stable API: :func:`arrange`, :class:`UnitsOperator`,
:class:`ChunkOperator`, :class:`Arrangement`.
"""
from tangram.policy.arrange import (
    Arrangement,
    ChunkOperator,
    UnitsOperator,
    arrange,
    packable,
    prefix_table,
)

__all__ = ["Arrangement", "ChunkOperator", "UnitsOperator", "arrange", "packable", "prefix_table"]
