"""The state of one resource pool, as a manager reports it and the policy reads it.

It sits below both: managers produce :class:`PoolState` values and the
policy consumes them, so neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass

from tangram.core.model import NODE_LOCAL_TYPES


def pool_name(rtype: str, node: str | None) -> str:
    """``cpu@node0`` for node-local types, the type itself (``api:x``) otherwise."""
    return f"{rtype}@{node}" if rtype in NODE_LOCAL_TYPES else rtype


@dataclass(frozen=True, slots=True)
class PoolState:
    """One pool as its manager sees it right now.

    ``chunks`` (GPU pools only) lists the sizes of the free buddy chunks;
    ``resident`` names the services whose state is on this pool's devices
    (GPU affinity), ``idle`` the resident instances whose whole chunk is
    free now, one entry per instance: an action of that service started at
    that DoP here would be a cache hit (None: not reported; the policy then
    takes every resident service for one idle instance). What runs on the pool is not here: the engine knows it
    and hands it to the policy as ``Snapshot.running``.
    """

    name: str
    rtype: str
    node: str | None
    capacity: int
    free: int
    chunks: tuple[int, ...] | None = None
    resident: frozenset[str] = frozenset()
    idle: tuple[str, ...] | None = None

    @property
    def chunked(self) -> bool:
        return self.chunks is not None
