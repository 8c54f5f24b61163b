"""CPU manager, allocate-on-execution (DESIGN.md §5).

Per node it owns two pools:

* ``cpu@<node>``: cores. A grant is an explicit, exclusive tuple of core ids
  held by one action while it executes (holder = action id).
* ``mem@<node>``: MiB reserved per trajectory for its whole life (holder =
  trajectory id); a grant is the number of MiB.

Core choice is mechanical (the policy already chose the node and the count):
prefer cores of one NUMA domain, and inside it adjacent core ids, so that a
``pytest -n 4`` shares caches and memory bandwidth. See :func:`choose_cores`.

Topology comes from :func:`discover_local_node` (sysfs NUMA ``cpulist``
files, the affinity of this process, ``/proc/meminfo`` and the memory cgroup
limit) or from configuration (:class:`CpuNode`).
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from tangram.core.errors import invariant
from tangram.core.grants import format_cpulist, parse_cpulist  # re-exported
from tangram.core.model import Action
from tangram.managers.base import AllocationError, ResourceManager
from tangram.core.pools import PoolState


@dataclass(frozen=True, slots=True)
class CpuNode:
    """One CPU node: its usable cores, their NUMA domains and its memory."""

    name: str
    cores: Sequence[int]
    numa: Sequence[Sequence[int]] | None = None
    memory_mb: int = 0

    def validate(self, field: str = "node") -> None:
        if not isinstance(self.name, str) or not self.name or "@" in self.name:
            raise ValueError(f"{field}.name: must be a non-empty string without '@', got {self.name!r}")
        cores = list(self.cores)
        if not cores:
            raise ValueError(f"{field}.cores: a node needs at least one core")
        for c in cores:
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                raise ValueError(f"{field}.cores: core ids must be non-negative integers, got {c!r}")
        if len(set(cores)) != len(cores):
            raise ValueError(f"{field}.cores: duplicate core ids")
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) or self.memory_mb < 0:
            raise ValueError(f"{field}.memory_mb: must be a non-negative integer, got {self.memory_mb!r}")
        if self.numa is not None:
            seen: list[int] = []
            for i, dom in enumerate(self.numa):
                if not list(dom):
                    raise ValueError(f"{field}.numa[{i}]: empty NUMA domain")
                seen.extend(dom)
            if sorted(seen) != sorted(cores):
                raise ValueError(f"{field}.numa: the domains must partition the cores exactly "
                                 f"(cores {format_cpulist(cores)}, domains cover {format_cpulist(seen)})")

    def domains(self) -> list[list[int]]:
        if self.numa is None:
            return [sorted(self.cores)]
        return [sorted(d) for d in self.numa]


# ---------------------------------------------------------------------- #
# topology discovery

def _memory_mb(meminfo: str, cgroup_limits: Iterable[str]) -> int:
    with open(meminfo) as f:
        m = re.search(r"^MemTotal:\s+(\d+)\s*kB", f.read(), re.M)
    total = int(m.group(1)) // 1024 if m else 0
    for path in cgroup_limits:  # a container's limit is smaller than the host's RAM
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw) // (1 << 20)) if total else int(raw) // (1 << 20)
    return total


def _cgroup_memory_limit_files() -> list[str]:
    files = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return files
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            files.append(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        elif ctrls == "":
            files.append(f"/sys/fs/cgroup{path}/memory.max")
    return files


def discover_local_node(name: str = "local", *, memory_mb: int | None = None,
                        sysfs: str = "/sys/devices/system/node", meminfo: str = "/proc/meminfo") -> CpuNode:
    """This machine as a :class:`CpuNode`.

    Cores are those this process may run on (``os.sched_getaffinity(0)``, so a
    container's or a cpuset's restriction is honoured), grouped by the NUMA
    domains of ``<sysfs>/node*/cpulist`` (domains left empty are dropped; cores
    in no domain form one more). Memory is ``MemTotal`` capped by the memory
    cgroup limit, unless ``memory_mb`` is given.
    """
    cores = sorted(os.sched_getaffinity(0))
    usable = set(cores)
    numa: list[list[int]] = []
    paths = sorted(glob.glob(os.path.join(sysfs, "node[0-9]*", "cpulist")),
                   key=lambda p: int(re.search(r"node(\d+)", p).group(1)))
    for path in paths:
        try:
            with open(path) as f:
                dom = [c for c in parse_cpulist(f.read()) if c in usable]
        except (OSError, ValueError):
            continue
        if dom:
            numa.append(dom)
    covered = {c for d in numa for c in d}
    rest = [c for c in cores if c not in covered]
    if rest:
        numa.append(rest)
    if memory_mb is None:
        memory_mb = _memory_mb(meminfo, _cgroup_memory_limit_files())
    node = CpuNode(name=name, cores=tuple(cores), numa=tuple(tuple(d) for d in numa), memory_mb=memory_mb)
    node.validate("discover_local_node")
    return node


# ---------------------------------------------------------------------- #
# core choice

def choose_cores(domains: Sequence[Sequence[int]], free: set[int], units: int) -> tuple[int, ...] | None:
    """Pick ``units`` free cores: one NUMA domain if possible, adjacent ids preferred.

    1. Domains that can hold the whole request are tried best-fit first
       (fewest free cores), so large free domains stay whole for large actions.
    2. Inside a domain: the shortest run of consecutive free ids that is long
       enough (best fit again, so long runs are not fragmented); if no run is,
       the window of ``units`` free cores with the smallest span.
    3. If no single domain fits, the request spans domains, taking the most
       free domains first, each in id order.
    Returns None when fewer than ``units`` cores are free.
    """
    if units > len(free):
        return None
    fitting = []
    for i, dom in enumerate(domains):
        f = [c for c in dom if c in free]
        if len(f) >= units:
            fitting.append((len(f), i, f))
    if fitting:
        _, _, f = min(fitting)
        return _within(sorted(f), units)
    taken: list[int] = []
    by_free = sorted(([c for c in dom if c in free] for dom in domains), key=lambda f: -len(f))
    for f in by_free:
        for c in sorted(f):
            if len(taken) == units:
                break
            taken.append(c)
    return tuple(sorted(taken))


def _within(f: list[int], units: int) -> tuple[int, ...]:
    runs: list[tuple[int, int]] = []  # (start index, length) of consecutive ids
    i = 0
    while i < len(f):
        j = i
        while j + 1 < len(f) and f[j + 1] == f[j] + 1:
            j += 1
        runs.append((i, j - i + 1))
        i = j + 1
    fits = [(length, start) for start, length in runs if length >= units]
    if fits:
        _, start = min(fits)
        return tuple(f[start:start + units])
    best = min(range(len(f) - units + 1), key=lambda k: (f[k + units - 1] - f[k], k))
    return tuple(f[best:best + units])


# ---------------------------------------------------------------------- #
# the manager

class _Node:
    __slots__ = ("spec", "domains", "free_cores", "cores_of", "mem_of", "mem_used")

    def __init__(self, spec: CpuNode):
        self.spec = spec
        self.domains = spec.domains()
        self.free_cores: set[int] = set(spec.cores)
        self.cores_of: dict[str, tuple[int, ...]] = {}
        self.mem_of: dict[str, int] = {}
        self.mem_used = 0


class CpuManager(ResourceManager):
    """Exclusive core sets per action and memory reservations per trajectory."""

    def __init__(self, nodes: Iterable[CpuNode] | CpuNode | None = None):
        if nodes is None:
            nodes = [discover_local_node()]
        elif isinstance(nodes, CpuNode):
            nodes = [nodes]
        self._nodes: dict[str, _Node] = {}
        self._pools: dict[str, tuple[str, _Node]] = {}  # pool -> (kind, node)
        for i, spec in enumerate(nodes):
            if not isinstance(spec, CpuNode):
                raise ValueError(f"nodes[{i}]: expected a CpuNode, got {type(spec).__name__}")
            spec.validate(f"nodes[{i}]")
            if spec.name in self._nodes:
                raise ValueError(f"nodes[{i}].name: node {spec.name!r} configured twice")
            n = _Node(spec)
            self._nodes[spec.name] = n
            self._pools[f"cpu@{spec.name}"] = ("cpu", n)
            self._pools[f"mem@{spec.name}"] = ("mem", n)
        if not self._nodes:
            raise ValueError("nodes: at least one node is needed")

    @property
    def nodes(self) -> Mapping[str, CpuNode]:
        return {name: n.spec for name, n in self._nodes.items()}

    def _lookup(self, pool: str) -> tuple[str, _Node]:
        got = self._pools.get(pool)
        if got is None:
            raise AllocationError(f"unknown pool {pool!r} (this manager owns {sorted(self._pools)})")
        return got

    def pool_states(self) -> Iterable[PoolState]:
        for name, n in self._nodes.items():
            yield PoolState(name=f"cpu@{name}", rtype="cpu", node=name,
                            capacity=len(n.spec.cores), free=len(n.free_cores))
            yield PoolState(name=f"mem@{name}", rtype="mem", node=name,
                            capacity=n.spec.memory_mb, free=n.spec.memory_mb - n.mem_used)

    def allocate(self, pool: str, units: int, holder: str, action: Action | None = None) -> Any:
        kind, n = self._lookup(pool)
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise AllocationError(f"{pool}: units must be a positive integer, got {units!r}")
        if kind == "cpu":
            if holder in n.cores_of:
                raise AllocationError(f"{pool}: {holder!r} already holds cores {n.cores_of[holder]}")
            cores = choose_cores(n.domains, n.free_cores, units)
            if cores is None:
                raise AllocationError(f"{pool}: {units} cores requested, {len(n.free_cores)} free")
            n.free_cores.difference_update(cores)
            n.cores_of[holder] = cores
            return cores
        if holder in n.mem_of:
            raise AllocationError(f"{pool}: {holder!r} already reserves {n.mem_of[holder]} MiB")
        free = n.spec.memory_mb - n.mem_used
        if units > free:
            raise AllocationError(f"{pool}: {units} MiB requested, {free} free")
        n.mem_of[holder] = units
        n.mem_used += units
        return units

    def regrant(self, pool: str, units: int, holder: str, held: int, action: Action | None = None) -> Any:
        """``holder``'s cores of ``pool`` made ``units``: the ones it holds stay its own (a restart's old
        process is still being killed on them) and free ones are added, or the highest go back."""
        kind, n = self._lookup(pool)
        old = n.cores_of.get(holder) if kind == "cpu" else None
        if old is None:
            raise AllocationError(f"{pool}: {holder!r} holds no cores to change")
        if units <= len(old):
            cores = tuple(sorted(old)[:units])
        else:
            near = [d for d in n.domains if not set(d).isdisjoint(old)]  # its own NUMA domains first
            extra = (choose_cores(near, n.free_cores.intersection(c for d in near for c in d), units - len(old))
                     or choose_cores(n.domains, n.free_cores, units - len(old)))
            if extra is None:
                raise AllocationError(f"{pool}: {units - len(old)} more cores requested, {len(n.free_cores)} free")
            cores = tuple(sorted((*old, *extra)))
        n.free_cores.update(set(old) - set(cores))
        n.free_cores.difference_update(cores)
        n.cores_of[holder] = cores
        return cores

    def release(self, pool: str, holder: str) -> bool:
        got = self._pools.get(pool)
        if got is None:
            return False
        kind, n = got
        if kind == "cpu":
            cores = n.cores_of.pop(holder, None)
            if cores is None:
                return False
            n.free_cores.update(cores)
            return True
        mb = n.mem_of.pop(holder, None)
        if mb is None:
            return False
        n.mem_used -= mb
        return True

    def check_invariants(self) -> None:
        for name, n in self._nodes.items():
            allocated: list[int] = [c for cs in n.cores_of.values() for c in cs]
            invariant(len(allocated) == len(set(allocated)), f"cpu@{name}: a core is granted twice")
            invariant(not (set(allocated) & n.free_cores), f"cpu@{name}: a granted core is also free")
            invariant(set(allocated) | n.free_cores == set(n.spec.cores), f"cpu@{name}: cores lost or invented")
            invariant(len(allocated) + len(n.free_cores) == len(n.spec.cores), f"cpu@{name}: free + allocated != capacity")
            invariant(sum(n.mem_of.values()) == n.mem_used, f"mem@{name}: holders disagree with the books")
            invariant(0 <= n.mem_used <= n.spec.memory_mb, f"mem@{name}: {n.mem_used} MiB used of {n.spec.memory_mb}")

    def held(self) -> Mapping[str, Mapping[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name, n in self._nodes.items():
            out[f"cpu@{name}"] = dict(n.cores_of)
            out[f"mem@{name}"] = dict(n.mem_of)
        return out
