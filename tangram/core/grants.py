"""What a manager hands out and an executor acts on.

These types sit at the bottom, beside the action model, so that managers
(which produce them) and executors (which consume them) never import each
other: a :class:`Chunk` of GPU devices, the core list of a CPU grant in the
kernel's cpulist format, and the :class:`CacheDecision` of a GPU node's
service cache (evict these, restore that).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Union


@dataclass(frozen=True, slots=True, order=True)
class Chunk:
    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def devices(self) -> range:
        return range(self.start, self.end)

    def buddy(self) -> "Chunk":
        return Chunk(self.start ^ self.size, self.size)


# What ResourceManager.allocate returns for one pool: the exclusive core ids of a CPU
# pool, the buddy chunk of a GPU pool, or a plain unit count (memory MiB, API slots,
# a counting manager's cores)
Cores = tuple[int, ...]
Grant = Union[Cores, Chunk, int]


def cores_of(grant: Grant) -> Cores:
    """The core ids a grant pins (none for a plain count)."""
    return tuple(sorted(grant)) if isinstance(grant, tuple) else ()


def devices_of(grant: Grant) -> tuple[int, ...]:
    """The GPU devices a grant holds (none unless it is a chunk)."""
    return tuple(grant.devices) if isinstance(grant, Chunk) else ()


# ---------------------------------------------------------------------- #
# CPU core lists

def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's list format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def format_cpulist(cores: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpulist`, as cpuset files and Docker expect it."""
    return _fmt(sorted(cores))


def _fmt(cores: list[int]) -> str:
    parts: list[str] = []
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        parts.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(parts)


# ---------------------------------------------------------------------- #
# GPU services

MIB = 2 ** 20  # device memory is counted in MiB
GB = 10 ** 9  # link bandwidth is quoted in GB/s


def restore_seconds(mb_per_device: float, gbps: float, overhead_s: float = 0.0) -> float:
    """Seconds to restore a service onto a chunk: every device loads its ``mb_per_device`` MiB
    in parallel over its own host link at ``gbps`` GB/s, after a fixed ``overhead_s``.

    The one formula the GPU executors, the simulator and the policy's
    restore estimates share (memory in MiB, bandwidth in decimal GB/s).
    """
    return overhead_s + mb_per_device * MIB / (gbps * GB)


def service_name(model: str, dop: int) -> str:
    """``"rm@dop2"``: a model at one DoP is its own service."""
    return f"{model}@dop{int(dop)}"


def parse_service(name: str) -> tuple[str, int]:
    """Inverse of :func:`service_name`; ``("rm", 2)`` for ``"rm@dop2"``."""
    model, sep, dop = name.rpartition("@dop")
    if not sep or not model or not dop.isdigit():
        raise ValueError(f"not a service name (model@dopK): {name!r}")
    return model, int(dop)


@dataclass(frozen=True, slots=True)
class Instance:
    """A service resident on a chunk of devices."""

    service: str
    chunk: Chunk
    mb_per_device: int


@dataclass(frozen=True, slots=True)
class CacheDecision:
    """What the executor must do before running an action on ``chunk``.

    On a hit ``evict`` is empty and nothing moves. On a miss: drop the device
    copies of ``evict`` (in that order), then restore ``service`` from its CPU
    master onto the chunk's devices, then report it with ``restored``.
    """

    holder: str
    service: str | None
    chunk: Chunk
    hit: bool
    evict: tuple[Instance, ...] = ()
    restore_mb_per_device: int = 0

    @property
    def devices(self) -> range:
        return self.chunk.devices

    @property
    def model(self) -> str | None:
        return None if self.service is None else parse_service(self.service)[0]

    @property
    def dop(self) -> int:
        return self.chunk.size
