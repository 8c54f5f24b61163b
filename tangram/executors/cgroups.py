"""cgroup backends of the local executor: one group per action with its cores (cpuset) and CFS quota.

v1 (one directory per hierarchy) and v2 (one unified directory); the process
joins its groups itself (:meth:`_Group.join_prefix`). See
:mod:`tangram.executors.local` for when each is used.
"""
from __future__ import annotations

import errno
import os

from tangram.core.grants import format_cpulist

CGROUP_V1, CGROUP_V2 = "cgroup-v1", "cgroup-v2"
JOIN_FAILED = 125  # exit code of the prefix when the process cannot join its group


def write_control(path: str, value: str) -> None:
    """One write(2) of ``value`` to a cgroup control file (a buffered write may split it)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _cpulist(cores) -> str:
    return format_cpulist(cores)



class _Group:
    __slots__ = ("dirs", "procs_files")

    def __init__(self, dirs: list[str]):
        self.dirs = dirs
        self.procs_files = [os.path.join(d, "cgroup.procs") for d in dirs]

    def join_prefix(self) -> str:
        writes = " && ".join(f"echo $$ > {f}" for f in self.procs_files)
        return (f"{{ {writes}; }} 2>/dev/null || {{ echo 'tangram: cannot join the action cgroup' >&2; "
                f"exit {JOIN_FAILED}; }}\n")

    def pids(self) -> list[int]:
        out: set[int] = set()
        for f in self.procs_files:
            try:
                out.update(int(x) for x in _read(f).split())
            except (OSError, ValueError):
                pass
        return sorted(out)


class _CgroupV1:
    kind = CGROUP_V1

    def __init__(self, parent: str, period_us: int):
        self.period_us = period_us
        cpu_root = next((p for p in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")
                         if os.path.exists(os.path.join(p, "cpu.cfs_quota_us"))), None)
        cpuset_root = "/sys/fs/cgroup/cpuset"
        if cpu_root is None or not os.path.exists(os.path.join(cpuset_root, "cpuset.cpus")):
            raise OSError(errno.ENOENT, "no cgroup v1 cpuset and cpu hierarchies")
        self.cpuset = os.path.join(cpuset_root, parent)
        self.cpu = os.path.join(cpu_root, parent)
        self.parents = (self.cpuset, self.cpu)
        os.makedirs(self.cpuset, exist_ok=True)
        os.makedirs(self.cpu, exist_ok=True)
        # a v1 cpuset child starts empty: give the parent the root's cpus and mems
        write_control(os.path.join(self.cpuset, "cpuset.cpus"), _read(os.path.join(cpuset_root, "cpuset.cpus")))
        self.mems = _read(os.path.join(cpuset_root, "cpuset.mems"))
        write_control(os.path.join(self.cpuset, "cpuset.mems"), self.mems)

    def create(self, name: str, cores, quota_cpus: float | None) -> _Group:
        """A cpuset group, plus a cpu group only when there is a quota to enforce.

        Joining a v1 hierarchy costs a task migration (~0.1-0.5 ms for cpuset,
        ~1-2 ms for cpu under load): a CFS quota of at least the number of
        exclusive cores limits nothing the cpuset does not, so the caller
        passes None then and the process stays in the root cpu group.
        """
        s = os.path.join(self.cpuset, name)
        c = os.path.join(self.cpu, name) if quota_cpus is not None else None
        group = _Group([s] + ([c] if c else []))
        os.mkdir(s)
        try:
            write_control(os.path.join(s, "cpuset.mems"), self.mems)  # mems before cpus/tasks
            write_control(os.path.join(s, "cpuset.cpus"), _cpulist(cores))
            if c is not None:
                os.mkdir(c)
                write_control(os.path.join(c, "cpu.cfs_period_us"), str(self.period_us))
                write_control(os.path.join(c, "cpu.cfs_quota_us"), str(max(int(quota_cpus * self.period_us), 1000)))
        except BaseException:
            self.remove(group)
            raise
        return group

    @staticmethod
    def remove(group: _Group) -> bool:
        ok = True
        for d in group.dirs:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                ok = False
        return ok


class _CgroupV2:
    kind = CGROUP_V2

    def __init__(self, parent: str, period_us: int, root: str = "/sys/fs/cgroup"):
        self.period_us = period_us
        ctrls = _read(os.path.join(root, "cgroup.controllers")).split()
        if "cpuset" not in ctrls or "cpu" not in ctrls:
            raise OSError(errno.ENOENT, f"cgroup v2 at {root} lacks cpuset/cpu controllers ({ctrls})")
        write_control(os.path.join(root, "cgroup.subtree_control"), "+cpuset +cpu")
        self.parent = os.path.join(root, parent)
        self.parents = (self.parent,)
        os.makedirs(self.parent, exist_ok=True)
        write_control(os.path.join(self.parent, "cgroup.subtree_control"), "+cpuset +cpu")

    def create(self, name: str, cores, quota_cpus: float | None) -> _Group:
        d = os.path.join(self.parent, name)
        group = _Group([d])
        os.mkdir(d)
        try:
            write_control(os.path.join(d, "cpuset.cpus"), _cpulist(cores))
            if quota_cpus is not None:
                write_control(os.path.join(d, "cpu.max"), f"{max(int(quota_cpus * self.period_us), 1000)} {self.period_us}")
        except BaseException:
            self.remove(group)
            raise
        return group

    remove = staticmethod(_CgroupV1.remove)
