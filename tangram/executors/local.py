"""Local executor: the embedded default, no Docker needed (DESIGN.md §5).

* An environment is a working directory under ``root`` (a temp dir by
  default) that persists across the actions of its trajectory.
* Every action is one ``bash -c <command>`` process in its own session and
  process group, ``cwd`` = the environment directory, ``TANGRAM_DOP`` = its DoP.
* Sandbox (``ExecResult.isolation``: ``sandbox`` or ``none``): by default every
  command runs confined by bubblewrap (:mod:`tangram.executors.sandbox`): an
  unprivileged uid, no network but loopback (unless the executor allows it and
  the environment asks), a read-only toolchain, its environment directory and
  a private ``/tmp`` writable, nothing else of the host visible; memory
  (the environment's ``memory_mb``, else ``default_memory_mb``) and pids
  limits in cgroups of its own. ``sandbox="none"`` runs commands as the
  service's own user on the host: only for trusted code. A machine that
  cannot sandbox makes the constructor raise :class:`SandboxUnavailable`. A run bwrap itself
  could not start is ``failed`` with no exit code (:mod:`tangram.executors.bwrap_status`).
* Output is capped at ``max_output_bytes`` per stream while it streams;
  ``details["truncated"]`` says whether anything was dropped.
* CPU pinning, chosen once (``details["pinning"]`` says which was used):

  - ``cgroup-v1`` / ``cgroup-v2``: when the hierarchy is writable, a cpuset
    group (the action's cores) and a cpu group (CFS quota) per action under a
    ``tangram`` parent, removed after the action. On v1 the cpu group is made
    only when the quota is below the number of cores (``cpu_quota`` <
    ``len(cores)``): otherwise the exclusive cpuset already bounds the action
    and joining the cpu hierarchy would cost one more task migration. The process joins them
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
  killed too: after an action its cores are free again. What finds a process
  that left the process group (``setsid``) must not be something the command
  can undo: a cgroup (an unsandboxed action without cores still gets one, only
  to track it, when the hierarchy is writable); inside the sandbox, bubblewrap's
  PID namespace; an unsandboxed action without a cgroup runs as the init of a
  PID namespace of its own (``unshare``, when the machine allows it), whose init
  the executor finds and kills, so its processes die with it. Only where none of these exists are they found by
  ``TANGRAM_ACTION_TOKEN`` in their environment (a /proc scan on kill paths),
  which a command that clears its environment (``env -i``) escapes.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Mapping

from tangram.executors.base import (
    FAILED,
    SUCCEEDED,
    TIMEOUT,
    EnvironmentExecutor,
    ExecResult,
    Placement,
)
from tangram.executors import sandbox as sbx
from tangram.executors.owned_dirs import MARKS_DIR, OwnedMarks
from tangram.executors.cgroups import (
    CGROUP_V1,
    CGROUP_V2,
    JOIN_FAILED,
    _CgroupV1,
    _CgroupV2,
    _cpulist,
    _Group,
)
from tangram.executors.processes import (
    _Collector, _Tracker, cleanup_through_cancels, command_argv, finish_spawn, pid_namespace_mode,
    pid_namespace_prefix, sweep_dead_groups)

log = logging.getLogger(__name__)

AFFINITY, NONE = "affinity", "none"
_ISOLATIONS = ("auto", "cgroup", AFFINITY, NONE)
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_INSTANCES = itertools.count(1)  # unique group names per executor of this process


class SandboxUnavailable(RuntimeError):
    """This machine cannot run commands in the sandbox (no bwrap, no namespaces)."""


class LocalExecutor(EnvironmentExecutor):
    """Working directories and pinned processes on this machine.

    ``isolation``: ``"auto"`` (cgroups when writable, else affinity),
    ``"cgroup"`` (fail if cgroups are not writable), ``"affinity"`` (force the
    ``sched_setaffinity`` fallback) or ``"none"``.
    """

    name = "local"

    def __init__(self, root: str | None = None, *, isolation: str = "auto", cgroup_parent: str = "tangram",
                 kill_grace_s: float = 0.5, cfs_period_us: int = 100_000, max_output_bytes: int = 8 << 20,
                 base_env: Mapping[str, str] | None = None, sandbox: str = sbx.SANDBOX,
                 allow_network: bool = False, readonly: tuple[str, ...] = (), default_memory_mb: int = 4096,
                 pids_max: int = sbx.DEFAULT_PIDS_MAX):
        if sandbox not in (sbx.SANDBOX, sbx.NONE):
            raise ValueError(f"sandbox: must be {sbx.SANDBOX!r} or {sbx.NONE!r}, got {sandbox!r}")
        if sandbox == sbx.SANDBOX:
            ok, why = sbx.probe()
            if not ok:
                raise SandboxUnavailable(f"this machine cannot sandbox commands: {why}")
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
        self._marks = OwnedMarks(self.root)  # what this service made under root: all a restart may sweep
        self.requested_isolation = isolation
        self.cgroup_parent = cgroup_parent
        self.kill_grace_s = float(kill_grace_s)
        self.cfs_period_us = int(cfs_period_us)
        self.max_output_bytes = int(max_output_bytes)
        self.sandbox = sandbox
        self.allow_network = bool(allow_network)
        self.default_memory_mb = int(default_memory_mb)
        self.pids_max = int(pids_max)
        if sandbox == sbx.SANDBOX:
            # nothing of the service's own environment (tokens, keys) reaches a sandboxed command
            self.base_env = dict({"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
                                  "LANG": "C.UTF-8"} if base_env is None else base_env)
            self._sandbox = sbx.Sandbox(readonly=tuple(readonly))
            try:
                self._limits: sbx.Limits | None = sbx.Limits(f"{cgroup_parent}-limits")
                sweep_dead_groups(self._limits.parents)  # groups of dead executors (kill -9)
            except OSError as exc:
                self._limits = None
                log.warning("local executor: no memory/pids limits (cgroups not writable: %s)", exc)
            from tangram.executors import seccomp

            # asked here, once, and not by the first action on the event loop
            if self._sandbox.reports_status() is False:
                log.warning("local executor: this bwrap has no --json-status-fd: a sandbox it cannot set up "
                            "exits 1 like a command that failed (use a newer bubblewrap)")
            if seccomp.unavailable():
                log.warning("local executor: no system-call filter in the sandbox (%s; pip install pyseccomp, "
                            "and libseccomp2 from the system)", seccomp.unavailable())
        else:
            self.base_env = dict(os.environ if base_env is None else base_env)
            self._sandbox, self._limits = None, None
        # where no cgroup tracks an unsandboxed action, its own PID namespace does
        self._pidns = pid_namespace_prefix() if sandbox == sbx.NONE else None
        if sandbox == sbx.NONE:
            log.info("local executor: an unsandboxed action without a cgroup is tracked by %s (%s)",
                     pid_namespace_mode(), " ".join(self._pidns or ("TANGRAM_ACTION_TOKEN",)))
        self._warned_untracked = False
        self._env_info: dict[str, tuple[int, bool]] = {}  # env id -> (memory_mb, network)
        self.allowed_cores = frozenset(os.sched_getaffinity(0))
        self._envs: dict[str, str] = {}
        self._cg: _CgroupV1 | _CgroupV2 | None = None
        self._isolation: str | None = None  # resolved on first use
        self.isolation_reason = ""
        self._tag = f"p{os.getpid()}-{next(_INSTANCES)}"
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

    @property
    def process_tracking(self) -> str:
        """What finds an action's processes for its kill: sandbox, cgroup, or :func:`pid_namespace_mode`."""
        if self._sandbox is not None:
            return "sandbox"
        return "cgroup" if self.isolation in (CGROUP_V1, CGROUP_V2) else pid_namespace_mode()

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
                sweep_dead_groups(self._cg.parents)
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

    stop_grace_s = property(lambda self: self.kill_grace_s + 2.0)  # SIGTERM, the grace, SIGKILL, the collection

    async def create_environment(self, env_id: str, *, image: str | None = None, memory_mb: int = 0,
                                 labels: Mapping[str, str] | None = None, network: bool = False) -> None:
        """``network``: the environment asks for a network (granted only if the executor allows it)."""
        if not isinstance(env_id, str) or not env_id or env_id in (".", "..", MARKS_DIR) or _SAFE.search(env_id):
            raise ValueError(f"env_id: must be a non-empty name of [A-Za-z0-9_.-], got {env_id!r}")
        if network and not self.allow_network and self.sandbox == sbx.SANDBOX:
            raise ValueError("network: this node does not allow environments a network (allow_network)")
        if env_id in self._envs:
            return
        d = os.path.join(self.root, env_id)
        self._marks.mark(env_id)  # before the directory: a crash between the two leaves nothing unmarked
        os.makedirs(d, exist_ok=True)
        if self._sandbox is not None:
            self._sandbox.prepare_workdir(d)
        self._envs[env_id] = d
        self._env_info[env_id] = (int(memory_mb or 0), bool(network))

    async def adopt_environment(self, env_id: str, *, memory_mb: int = 0, network: bool = False) -> bool:
        d = os.path.join(self.root, env_id)
        if _SAFE.search(env_id) or env_id == MARKS_DIR or not os.path.isdir(d):
            return False
        self._marks.mark(env_id)
        self._envs[env_id] = d
        self._env_info[env_id] = (int(memory_mb or 0), bool(network))
        return True

    def set_owner(self, owner: str) -> None:
        self._marks.set_owner(owner)

    async def sweep_unrecorded(self, keep: set[str]) -> list[str]:
        """Only directories this owner marked: a workdir may hold anything else (owned_dirs.py)."""
        if self._own_root:  # a fresh temporary root holds nothing of a previous run
            return []
        gone = []
        for name in self._marks.marked():
            if name in keep or name in self._envs:
                continue
            path = os.path.join(self.root, name)
            if os.path.isdir(path):
                await asyncio.to_thread(shutil.rmtree, path, True)
                gone.append(name)
            if not os.path.lexists(path):
                self._marks.unmark(name)
        return gone

    def detach(self) -> None:
        self._envs.clear()
        self._env_info.clear()

    async def destroy_environment(self, env_id: str) -> None:
        d = self._envs.pop(env_id, None)
        self._env_info.pop(env_id, None)
        if d is not None:
            await asyncio.to_thread(shutil.rmtree, d, True)
            if not os.path.lexists(d):  # a removal that failed stays marked: a restart's sweep retries it
                self._marks.unmark(env_id)

    async def close(self) -> None:
        for env_id in list(self._envs):
            await self.destroy_environment(env_id)
        for g in list(self._stale):
            _Tracker(0, g, b"").signal(signal.SIGKILL, scan=False)
            if _CgroupV1.remove(g):
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
                   env: Mapping[str, str] | None = None, stdin: bytes | None = None) -> ExecResult:
        # bwrap's status report: its own failure (the command never ran) is not the command's exit 1
        report = self._sandbox.status_pipe() if self._sandbox is not None else None
        try:
            return await self._exec(env_id, command, placement, timeout_s, env, stdin, report)
        finally:  # whatever ended the action: a result, an error, a cancel
            if report is not None:
                report.close()

    async def _exec(self, env_id: str, command: str, placement: Placement, timeout_s: float | None,
                    env: Mapping[str, str] | None, stdin: bytes | None, report: sbx.StatusPipe | None) -> ExecResult:
        cwd = self.env_dir(env_id)
        if not isinstance(command, str):
            raise ValueError(f"command: must be a string, got {type(command).__name__}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout_s!r}")
        cores = self._check_placement(placement)
        quota = placement.cpu_quota if placement.cpu_quota is not None else (len(cores) or None)
        argv = command_argv(command, env)  # the caller's variables reach the command alone, not the host's chain
        penv = dict(self.base_env)
        penv["TANGRAM_DOP"] = str(placement.dop)
        self._seq += 1
        token = f"{self._tag}-{self._seq}"
        penv["TANGRAM_ACTION_TOKEN"] = token
        isolation = self.isolation if cores else NONE
        details: dict[str, Any] = {"pinning": isolation, "cores": cores, "cpu_quota": quota, "dop": placement.dop}
        own_exec_s: float | None = None

        t0 = time.perf_counter()
        group: _Group | None = None
        script = command if argv[0] != "env" else "exec " + shlex.join(argv)
        name = f"{token}-{_SAFE.sub('_', placement.action_id)[:40]}"
        if isolation in (CGROUP_V1, CGROUP_V2):
            # a quota >= the exclusive cores adds nothing to the cpuset: no cpu group (one migration less)
            cfs = quota if quota is not None and quota < len(cores) else None
            group = self._cg.create(name, cores, cfs)
            details["cgroup"] = group.dirs
            details["cfs_quota"] = cfs is not None
        elif self._sandbox is None and not cores and self.isolation in (CGROUP_V1, CGROUP_V2):
            # nothing to pin, but a cgroup still holds every process of the action for its kill
            group = self._cg.create(name, sorted(self.allowed_cores), None)
            details["cgroup"] = group.dirs
        memory_mb = 0
        fds: list[int] = []  # the sandbox's /etc/passwd and /etc/group, as pipes
        try:  # from here to the spawn, a failure (out of descriptors, a limit refused) removes the group
            if self._sandbox is not None:
                env_mem, network = self._env_info.get(env_id, (0, False))
                if self._limits is not None:
                    memory_mb = env_mem or self.default_memory_mb
                    limit_dirs = self._limits.create(name, memory_mb, self.pids_max)
                    group = _Group((group.dirs if group is not None else []) + limit_dirs)
                    details["memory_mb"], details["pids_max"] = memory_mb, self.pids_max
                fds, files = sbx.sandbox_files(self._sandbox.uid, self._sandbox.gid)
                inner = self._sandbox.argv(cwd, argv, network=network and self.allow_network,
                                           user_files=files, status=report)
                # bwrap itself dies with this service (SIGKILL included): its sandbox dies with it
                script = "exec " + shlex.join(sbx.die_with(os.getpid()) + inner)
            pidns = group is None and self._sandbox is None and self._pidns is not None
            if pidns:  # the command is its namespace's init: every process it leaves dies with it
                script = "exec " + shlex.join([*sbx.die_with(os.getpid()), *self._pidns, *argv])  # dies with us too
                details["pid_namespace"] = True
            elif group is None and self._sandbox is None and not self._warned_untracked:
                self._warned_untracked = True
                log.warning("local executor: no cgroup and no PID namespace here: a command that leaves its process "
                            "group and clears its environment (setsid env -i ...) can outlive its action")
            if group is not None:
                script = group.join_prefix() + script
            transport, proto = await finish_spawn(  # a cancellation meanwhile raises at the next await
                self._spawn(script, cwd, penv, cores if isolation == AFFINITY else None, stdin,
                            fds + (report.fds if report is not None else [])))
        except BaseException:
            if group is not None:
                self._remove_group(group)
            raise
        finally:
            for fd in fds:  # the child holds its own copies
                os.close(fd)
            if report is not None:
                report.close_write()
        spawned = time.perf_counter()
        pid = transport.get_pid()
        details["pid"] = pid
        # in a namespace the token scan is not needed: its init is found and killed instead
        track = _Tracker(pid, group, b"" if pidns else token.encode(), in_namespace=pidns)
        log.debug("local exec %s pid %d isolation %s cores %s", placement.action_id, pid, isolation, cores)
        status, error = None, None
        try:
            try:
                if pidns:
                    await track.await_namespace(proto.exited, min(5.0, timeout_s or 5.0))
                # the leader's exit, not the pipes' EOF: a background child may hold them
                left = None if timeout_s is None else max(0.0, timeout_s - (time.perf_counter() - spawned))
                await asyncio.wait_for(asyncio.shield(proto.exited), left)
                # the command's own run; cgroup set-up and teardown are the system's overhead
                own_exec_s = time.perf_counter() - spawned
                rc = transport.get_returncode()
                status = SUCCEEDED if rc == 0 else FAILED
                error = None if rc == 0 else f"exit code {rc}"
            except asyncio.TimeoutError:
                status, error = TIMEOUT, f"killed after {timeout_s:g} s"
                await self._terminate(track, proto)
        except asyncio.CancelledError:
            try:
                await self._terminate(track, proto)
            finally:  # to its end, and the group removed, whatever cancels come meanwhile
                try:
                    await cleanup_through_cancels(track, transport, proto)
                finally:
                    if group is not None:
                        self._remove_group(group)
            raise
        cancelled = True  # until the collection says otherwise: failed or cancelled, the group goes now
        try:
            cancelled = await cleanup_through_cancels(track, transport, proto)
        finally:
            if cancelled and group is not None:
                self._remove_group(group)
        if cancelled:
            raise asyncio.CancelledError()
        details["duration_s"] = time.perf_counter() - t0
        rc = transport.get_returncode()
        oom = status == FAILED and bool(memory_mb) and sbx.Limits.oom_killed(group.dirs if group else [])
        if group is not None and rc == JOIN_FAILED and b"cannot join the action cgroup" in proto.err:
            # the command never ran: no exit code, or a reward would score it as failed tests
            status, error, rc = FAILED, "could not join the action's cgroup: the command did not run", None
        elif report and status != TIMEOUT and (why := report.not_run(proto.err, rc, oom)):
            status, error, rc = FAILED, why, None  # bwrap's own exit 1 is no verdict on the command
        if oom and status == FAILED:
            details["oom_killed"] = True
            error = f"{error}: killed at the memory limit ({memory_mb} MiB)"
        details["truncated"] = proto.truncated
        if group is not None:
            self._remove_group(group)
        return ExecResult(status=status, exit_code=rc, stdout=proto.out.decode(errors="replace"),
                          stderr=proto.err.decode(errors="replace"), error=error, exec_s=own_exec_s,
                          isolation=self.sandbox, truncated=proto.truncated, details=details)

    async def _spawn(self, script: str, cwd: str, env: dict, affinity: list[int] | None,
                     stdin: bytes | None = None, pass_fds: list[int] = ()):
        loop = asyncio.get_running_loop()
        kw = dict(cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                  stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        if pass_fds:
            kw["pass_fds"] = tuple(pass_fds)
        factory = lambda: _Collector(self.max_output_bytes)  # noqa: E731
        if affinity is None:
            spawned = await loop.subprocess_exec(factory, "bash", "-c", script, **kw)
        else:
            async with self._spawn_lock:  # the loop thread's affinity is borrowed for the fork
                saved = os.sched_getaffinity(0)
                os.sched_setaffinity(0, affinity)
                try:
                    spawned = await loop.subprocess_exec(factory, "bash", "-c", script, **kw)
                finally:
                    os.sched_setaffinity(0, saved)
        if stdin is not None:  # the loop writes it as the command reads; EOF after the last byte
            pipe = spawned[0].get_pipe_transport(0)
            pipe.write(stdin)
            pipe.write_eof()
        return spawned

    # ------------------------------------------------------------------ #
    # killing

    async def _terminate(self, track: "_Tracker", proto: "_Collector") -> None:
        """SIGTERM the action's processes, SIGKILL after the grace; returns once the leader has exited."""
        if not proto.exited.done():  # not reaped yet: its pid is still the action's
            track.find_namespace()
        try:
            track.signal(signal.SIGTERM, scan=True)
            try:
                await asyncio.wait_for(asyncio.shield(proto.exited), self.kill_grace_s)
            except asyncio.TimeoutError:
                pass
        finally:  # also when cancelled again meanwhile
            track.signal(signal.SIGKILL, scan=True)
        await asyncio.shield(proto.exited)

    def _remove_group(self, group: _Group) -> None:
        if not _CgroupV1.remove(group):
            _Tracker(0, group, b"").signal(signal.SIGKILL, scan=False)
            if not _CgroupV1.remove(group):
                log.warning("local executor: cgroup %s still busy, retried at close", group.dirs)
                self._stale.append(group)
