"""Local executor: the embedded default, no Docker needed (DESIGN.md §5).

* An environment is a working directory under ``root`` (a temp dir by
  default) that persists across the actions of its trajectory.
* Every action is one ``bash -c <command>`` process in its own session and
  process group, ``cwd`` = the environment directory, ``TANGRAM_DOP`` = its DoP.
* Isolation, chosen once (``details["isolation"]`` says which was used):

  - ``cgroup-v1`` / ``cgroup-v2``: when the hierarchy is writable, a cpuset
    group (the action's cores) and a cpu group (CFS quota) per action under a
    ``tangram`` parent, removed after the action. The process joins them
    itself before running anything: the command is prefixed with
    ``echo $$ > <group>/cgroup.procs`` (a bash builtin: no extra exec, and no
    window in which the command or a child it forks runs outside the group).
    Measured on a 2-core v1 box: group create ~0.1 ms, join ~0.2 ms, rmdir
    ~0.03 ms. The cgroup also tracks every descendant, even one that left the
    process group with ``setsid``, so a kill leaves nothing behind.
  - ``affinity``: ``sched_setaffinity`` (cores only, no quota). The event-loop
    thread sets its own affinity around the (synchronous) fork so the child
    inherits it from its first instruction; a lock keeps concurrent spawns
    from interleaving. Cheaper than a ``preexec_fn`` (which disables vfork).
  - ``none``: no cores given in the placement.

* A timeout or a cancellation kills the whole process group (SIGTERM, then
  SIGKILL after ``kill_grace_s``) and everything left in the action's cgroup
  before returning. Background processes left by a command that exited are
  killed too: after an action its cores are free again.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from typing import Any, Mapping

from tangram.executors.base import (
    CANCELLED,
    FAILED,
    SUCCEEDED,
    TIMEOUT,
    EnvironmentExecutor,
    ExecResult,
    Placement,
)

log = logging.getLogger(__name__)

CGROUP_V1, CGROUP_V2, AFFINITY, NONE = "cgroup-v1", "cgroup-v2", "affinity", "none"
_ISOLATIONS = ("auto", "cgroup", AFFINITY, NONE)
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_JOIN_FAILED = 125  # exit code of the prefix when the process cannot join its group


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _cpulist(cores) -> str:
    from tangram.managers.cpu import format_cpulist

    return format_cpulist(cores)


def _proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of ``pid`` from /proc, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pgid: int, group: "_Group | None") -> bool:
    """Whether a non-zombie process remains in the action's group or process group.

    Zombies do not count: they run nothing, and where PID 1 does not reap
    orphans they would otherwise keep ``killpg(pgid, 0)`` succeeding forever.
    """
    if group is not None:  # every descendant is in the cgroup, even one that called setsid
        pids = group.pids()
    else:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    for pid in pids:
        st = _proc_state(pid)
        if st is not None and st[0] not in ("Z", "X") and (group is not None or st[1] == pgid):
            return True
    return False


# ---------------------------------------------------------------------- #
# cgroup backends: create a group with cores + quota, join prefix, pids, remove

class _Group:
    __slots__ = ("dirs", "procs_files")

    def __init__(self, dirs: list[str]):
        self.dirs = dirs
        self.procs_files = [os.path.join(d, "cgroup.procs") for d in dirs]

    def join_prefix(self) -> str:
        writes = " && ".join(f"echo $$ > {f}" for f in self.procs_files)
        return (f"{{ {writes}; }} 2>/dev/null || {{ echo 'tangram: cannot join the action cgroup' >&2; "
                f"exit {_JOIN_FAILED}; }}\n")

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
        os.makedirs(self.cpuset, exist_ok=True)
        os.makedirs(self.cpu, exist_ok=True)
        # a v1 cpuset child starts empty: give the parent the root's cpus and mems
        _write(os.path.join(self.cpuset, "cpuset.cpus"), _read(os.path.join(cpuset_root, "cpuset.cpus")))
        self.mems = _read(os.path.join(cpuset_root, "cpuset.mems"))
        _write(os.path.join(self.cpuset, "cpuset.mems"), self.mems)

    def create(self, name: str, cores, quota_cpus: float | None) -> _Group:
        s, c = os.path.join(self.cpuset, name), os.path.join(self.cpu, name)
        group = _Group([s, c])
        os.mkdir(s)
        try:
            _write(os.path.join(s, "cpuset.mems"), self.mems)  # mems before cpus/tasks
            _write(os.path.join(s, "cpuset.cpus"), _cpulist(cores))
            os.mkdir(c)
            if quota_cpus is not None:
                _write(os.path.join(c, "cpu.cfs_period_us"), str(self.period_us))
                _write(os.path.join(c, "cpu.cfs_quota_us"), str(max(int(quota_cpus * self.period_us), 1000)))
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
        _write(os.path.join(root, "cgroup.subtree_control"), "+cpuset +cpu")
        self.parent = os.path.join(root, parent)
        os.makedirs(self.parent, exist_ok=True)
        _write(os.path.join(self.parent, "cgroup.subtree_control"), "+cpuset +cpu")

    def create(self, name: str, cores, quota_cpus: float | None) -> _Group:
        d = os.path.join(self.parent, name)
        group = _Group([d])
        os.mkdir(d)
        try:
            _write(os.path.join(d, "cpuset.cpus"), _cpulist(cores))
            if quota_cpus is not None:
                _write(os.path.join(d, "cpu.max"), f"{max(int(quota_cpus * self.period_us), 1000)} {self.period_us}")
        except BaseException:
            self.remove(group)
            raise
        return group

    remove = staticmethod(_CgroupV1.remove)


# ---------------------------------------------------------------------- #

class _Collector(asyncio.SubprocessProtocol):
    """Output buffers (capped) and two futures: the leader exited, the pipes closed.

    ``Process.wait()`` of asyncio also waits for the pipes' EOF, which a
    background child of the command can hold open: the protocol's
    ``process_exited`` tells the leader's exit apart.
    """

    def __init__(self, limit: int):
        loop = asyncio.get_running_loop()
        self.limit = limit
        self.out = bytearray()
        self.err = bytearray()
        self.exited = loop.create_future()
        self.pipes_closed = loop.create_future()
        self._open = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        buf = self.out if fd == 1 else self.err
        room = self.limit - len(buf)
        if room > 0:
            buf += data[:room]

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open.discard(fd)
        if not self._open and not self.pipes_closed.done():
            self.pipes_closed.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


class LocalExecutor(EnvironmentExecutor):
    """Working directories and pinned processes on this machine.

    ``isolation``: ``"auto"`` (cgroups when writable, else affinity),
    ``"cgroup"`` (fail if cgroups are not writable), ``"affinity"`` (force the
    ``sched_setaffinity`` fallback) or ``"none"``.
    """

    name = "local"

    def __init__(self, root: str | None = None, *, isolation: str = "auto", cgroup_parent: str = "tangram",
                 kill_grace_s: float = 0.5, cfs_period_us: int = 100_000, max_output_bytes: int = 8 << 20,
                 base_env: Mapping[str, str] | None = None):
        if isolation not in _ISOLATIONS:
            raise ValueError(f"isolation: must be one of {_ISOLATIONS}, got {isolation!r}")
        if not kill_grace_s >= 0:
            raise ValueError(f"kill_grace_s: must be >= 0, got {kill_grace_s!r}")
        if not 1000 <= cfs_period_us <= 1_000_000:
            raise ValueError(f"cfs_period_us: must be within [1000, 1000000], got {cfs_period_us!r}")
        if not cgroup_parent or _SAFE.search(cgroup_parent):
            raise ValueError(f"cgroup_parent: must be a plain directory name, got {cgroup_parent!r}")
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="tangram-envs-")
        os.makedirs(self.root, exist_ok=True)
        self.requested_isolation = isolation
        self.cgroup_parent = cgroup_parent
        self.kill_grace_s = float(kill_grace_s)
        self.cfs_period_us = int(cfs_period_us)
        self.max_output_bytes = int(max_output_bytes)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.allowed_cores = frozenset(os.sched_getaffinity(0))
        self._envs: dict[str, str] = {}
        self._cg: _CgroupV1 | _CgroupV2 | None = None
        self._isolation: str | None = None  # resolved on first use
        self.isolation_reason = ""
        self._tag = f"p{os.getpid()}-{id(self) % 100000}"
        self._seq = 0
        self._stale: list[_Group] = []
        self._spawn_lock = asyncio.Lock()

    # ------------------------------------------------------------------ #
    # isolation

    @property
    def isolation(self) -> str:
        """The isolation this executor uses for pinned actions (resolved once)."""
        if self._isolation is None:
            self._isolation = self._resolve_isolation()
        return self._isolation

    def _resolve_isolation(self) -> str:
        req = self.requested_isolation
        if req in (AFFINITY, NONE):
            self.isolation_reason = "forced by the isolation argument"
            log.info("local executor: isolation %s (%s)", req, self.isolation_reason)
            return req
        errors = []
        for backend in (_CgroupV2, _CgroupV1):
            try:
                self._cg = backend(self.cgroup_parent, self.cfs_period_us)
                self.isolation_reason = "cgroup hierarchy writable"
                log.info("local executor: isolation %s under %r", backend.kind, self.cgroup_parent)
                return backend.kind
            except OSError as e:
                errors.append(f"{backend.kind}: {e}")
        if req == "cgroup":
            raise RuntimeError(f"isolation: cgroups requested but not writable ({'; '.join(errors)})")
        self.isolation_reason = "; ".join(errors)
        log.warning("local executor: cgroups not writable, falling back to sched_setaffinity (%s)",
                    self.isolation_reason)
        return AFFINITY

    # ------------------------------------------------------------------ #
    # environments

    def env_dir(self, env_id: str) -> str:
        d = self._envs.get(env_id)
        if d is None:
            raise ValueError(f"env_id: unknown environment {env_id!r} (call create_environment first)")
        return d

    async def create_environment(self, env_id: str, *, image: str | None = None, memory_mb: int = 0,
                                 labels: Mapping[str, str] | None = None) -> None:
        if not isinstance(env_id, str) or not env_id or env_id in (".", "..") or _SAFE.search(env_id):
            raise ValueError(f"env_id: must be a non-empty name of [A-Za-z0-9_.-], got {env_id!r}")
        if env_id in self._envs:
            return
        d = os.path.join(self.root, env_id)
        os.makedirs(d, exist_ok=True)
        self._envs[env_id] = d

    async def destroy_environment(self, env_id: str) -> None:
        d = self._envs.pop(env_id, None)
        if d is not None:
            await asyncio.to_thread(shutil.rmtree, d, True)

    async def close(self) -> None:
        for env_id in list(self._envs):
            await self.destroy_environment(env_id)
        for g in list(self._stale):
            self._kill_group_pids(g, signal.SIGKILL)
            if self._cg is not None and self._cg.remove(g):
                self._stale.remove(g)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ #
    # exec

    def _check_placement(self, placement: Placement) -> list[int]:
        cores = list(placement.cores)
        bad = [c for c in cores if c not in self.allowed_cores]
        if bad:
            raise ValueError(f"placement.cores: cores {bad} are not available to this process "
                             f"(allowed {_cpulist(self.allowed_cores)})")
        if placement.cpu_quota is not None and not placement.cpu_quota > 0:
            raise ValueError(f"placement.cpu_quota: must be positive, got {placement.cpu_quota!r}")
        return cores

    async def exec(self, env_id: str, command: str, placement: Placement, *, timeout_s: float | None = None,
                   env: Mapping[str, str] | None = None) -> ExecResult:
        cwd = self.env_dir(env_id)
        if not isinstance(command, str):
            raise ValueError(f"command: must be a string, got {type(command).__name__}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout_s!r}")
        cores = self._check_placement(placement)
        quota = placement.cpu_quota if placement.cpu_quota is not None else (len(cores) or None)
        penv = dict(self.base_env)
        if env:
            penv.update(env)
        penv["TANGRAM_DOP"] = str(placement.dop)
        isolation = self.isolation if cores else NONE
        details: dict[str, Any] = {"isolation": isolation, "cores": cores, "cpu_quota": quota, "dop": placement.dop}

        t0 = time.perf_counter()
        group: _Group | None = None
        script = command
        if isolation in (CGROUP_V1, CGROUP_V2):
            self._seq += 1
            name = f"{self._tag}-{self._seq}-{_SAFE.sub('_', placement.action_id)[:40]}"
            group = self._cg.create(name, cores, quota)
            details["cgroup"] = group.dirs
            script = group.join_prefix() + command
        try:
            transport, proto = await self._spawn(script, cwd, penv, cores if isolation == AFFINITY else None)
        except BaseException:
            if group is not None:
                self._remove_group(group)
            raise
        pid = transport.get_pid()
        details["pid"] = pid
        log.debug("local exec %s pid %d isolation %s cores %s", placement.action_id, pid, isolation, cores)
        status, error = None, None
        try:
            try:
                # the leader's exit, not the pipes' EOF: a background child may hold them
                await asyncio.wait_for(asyncio.shield(proto.exited), timeout_s)
                rc = transport.get_returncode()
                status = SUCCEEDED if rc == 0 else FAILED
                error = None if rc == 0 else f"exit code {rc}"
            except asyncio.TimeoutError:
                status, error = TIMEOUT, f"killed after {timeout_s:g} s"
                await self._terminate(pid, proto, group)
        except asyncio.CancelledError:
            try:
                await self._terminate(pid, proto, group)
            finally:
                await self._cleanup(pid, transport, proto, group)
            raise
        await self._cleanup(pid, transport, proto, group)
        details["duration_s"] = time.perf_counter() - t0
        rc = transport.get_returncode()
        if group is not None and rc == _JOIN_FAILED and b"cannot join the action cgroup" in proto.err:
            status, error = FAILED, "could not join the action's cgroup"
        return ExecResult(status=status, exit_code=rc, stdout=proto.out.decode(errors="replace"),
                          stderr=proto.err.decode(errors="replace"), error=error, details=details)

    async def _spawn(self, script: str, cwd: str, env: dict, affinity: list[int] | None):
        loop = asyncio.get_running_loop()
        kw = dict(cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                  stderr=asyncio.subprocess.PIPE, start_new_session=True)
        factory = lambda: _Collector(self.max_output_bytes)  # noqa: E731
        if affinity is None:
            return await loop.subprocess_exec(factory, "bash", "-c", script, **kw)
        async with self._spawn_lock:  # the loop thread's affinity is borrowed for the fork
            saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, affinity)
            try:
                return await loop.subprocess_exec(factory, "bash", "-c", script, **kw)
            finally:
                os.sched_setaffinity(0, saved)

    # ------------------------------------------------------------------ #
    # killing

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> bool:
        try:
            os.killpg(pgid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    @staticmethod
    def _kill_group_pids(group: _Group | None, sig: int) -> int:
        if group is None:
            return 0
        n = 0
        for pid in group.pids():
            try:
                os.kill(pid, sig)
                n += 1
            except ProcessLookupError:
                pass
        return n

    async def _terminate(self, pgid: int, proto: "_Collector", group: _Group | None) -> None:
        """SIGTERM the group, SIGKILL after the grace; returns once the leader has exited."""
        try:
            self._signal_group(pgid, signal.SIGTERM)
            self._kill_group_pids(group, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(proto.exited), self.kill_grace_s)
            except asyncio.TimeoutError:
                pass
        finally:  # also when cancelled again meanwhile
            self._signal_group(pgid, signal.SIGKILL)
            self._kill_group_pids(group, signal.SIGKILL)
        await asyncio.shield(proto.exited)

    async def _cleanup(self, pgid: int, transport, proto: "_Collector", group: _Group | None) -> None:
        """Kill what the action left behind, wait until it is gone, collect output, remove the group."""
        # fast path: a command that left nothing costs one killpg returning ESRCH
        leftovers = self._signal_group(pgid, signal.SIGKILL)
        leftovers |= self._kill_group_pids(group, signal.SIGKILL) > 0
        if leftovers:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and _alive(pgid, group):
                self._signal_group(pgid, signal.SIGKILL)
                self._kill_group_pids(group, signal.SIGKILL)
                await asyncio.sleep(0.005)
        # output ends when the last writer is gone; an escaped daemon may keep a pipe open
        try:
            await asyncio.wait_for(asyncio.shield(proto.pipes_closed), 2.0)
        except asyncio.TimeoutError:
            log.warning("local executor: output pipes of pid %d still open after the kill", pgid)
        transport.close()
        if group is not None:
            self._remove_group(group)

    def _remove_group(self, group: _Group) -> None:
        if self._cg is not None and not self._cg.remove(group):
            self._kill_group_pids(group, signal.SIGKILL)
            if not self._cg.remove(group):
                log.warning("local executor: cgroup %s still busy, retried at close", group.dirs)
                self._stale.append(group)
