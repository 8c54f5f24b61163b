"""The processes of one local action: finding them (process group, cgroup, token) and their output.

An action's processes are its process group, every member of its cgroup
(even after ``setsid``) and, without a cgroup, every process whose
environment carries its ``TANGRAM_ACTION_TOKEN``; :class:`_Tracker` signals
them all and tells whether any still runs. The token is the weakest of these:
a command can clear its environment (``env -i``), so an action without a
cgroup runs in a PID namespace of its own when the machine allows one
(:func:`pid_namespace_prefix`), which no process inside can leave;
:class:`PidNamespace` kills it through its init and tells when it is empty.
:class:`_Collector` keeps the output (capped) and tells the leader's exit
apart from the pipes' EOF.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Mapping

from tangram.executors.base import wait_through_cancels
from tangram.executors.cgroups import _CgroupV1, _Group

log = logging.getLogger("tangram.executors.local")


EXECUTOR_ENV = ("TANGRAM_DOP", "TANGRAM_ACTION_TOKEN")  # set by the executor; a caller's own are dropped
_BASH = "/bin/bash" if os.path.exists("/bin/bash") else "bash"  # by path: a caller's PATH cannot choose it


def command_argv(command: str, env: Mapping[str, str] | None) -> list[str]:
    """``bash -c command`` with the caller's ``env`` set by ``env(1)`` as the last step before it.

    What runs before the command on the host (the cgroup join in a bash, setpriv, bwrap) runs in the
    executor's own environment: a variable a caller names would act there, outside the sandbox and
    before the command joins its cgroup (``BASH_ENV`` is run by that bash at its start, ``LD_PRELOAD``
    loaded into every program, ``BASH_FUNC_*`` defines its builtins away). Inside the sandbox ``env``
    runs after the user is dropped, as the command itself would.
    """
    own = {k: v for k, v in (env or {}).items() if k not in EXECUTOR_ENV}
    for k, v in own.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k or not isinstance(v, str) or "\0" in v:
            raise ValueError(f"env.{k}: a name must be a non-empty string without '=' or NUL, its value a string "
                             "without NUL")
    bash = [_BASH, "-c", command]
    return ["env", "--", *(f"{k}={v}" for k, v in own.items()), *bash] if own else bash


async def finish_spawn(spawn):
    """Await a subprocess spawn to its end even when cancelled meanwhile, and return its result.

    CPython's ``subprocess_exec``, cancelled while it connects the child's pipes, kills the child
    and then waits for an exit notice that never comes (python/cpython#125502, Python 3.11 here):
    the action's task hung for ever. So the spawn runs to its end; a cancellation that came
    meanwhile is requested again, so the caller's next await raises it and the caller kills what
    it started as it kills any cancelled action.
    """
    task = asyncio.ensure_future(spawn)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            cancelled = True
            if task.done():
                result = task.result()  # the spawn's own error, if it failed
                break
    if cancelled:
        asyncio.current_task().cancel()
    return result


def _proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of ``pid`` from /proc, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def _prefix_works(prefix: tuple[str, ...], own_proc: bool) -> bool:
    """Whether ``prefix`` runs a command here; ``own_proc``: and /proc is the new namespace's (the command is 1 there)."""
    try:
        done = subprocess.run([*prefix, "sh", "-c", "exec readlink /proc/self"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and (not own_proc or done.stdout.strip() == b"1")


@functools.lru_cache(maxsize=None)
def pid_namespace_prefix() -> tuple[str, ...] | None:
    """An argv prefix that runs a command as the init of a new PID namespace, or None if this machine can't.

    ``unshare --pid --fork --kill-child``: the command is the namespace's PID 1; when
    PID 1 ends the kernel kills every process of the namespace, whatever it did
    to its environment, session, parentage or credentials (:class:`PidNamespace`
    finds that init to kill it). ``--mount --mount-proc`` gives the command a /proc
    of its namespace, so ``ps``, ``pgrep``, ``pkill`` and ``/proc/$!`` agree with
    ``$$`` and ``$!``. Without CAP_SYS_ADMIN (a non-root service, or a root one in a
    container) a user namespace is needed: ``--map-current-user`` (the same uid
    inside; util-linux >= 2.38), else ``--map-root-user``. The first form that works
    is kept, those with their own /proc first. Probed once per process.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    users = [["--user", "--map-current-user"], ["--user", "--map-root-user"]]
    if os.geteuid() == 0:
        users.insert(0, [])
    for proc in (["--mount", "--mount-proc"], []):
        for user in users:
            prefix = (unshare, *user, "--pid", "--fork", "--kill-child", *proc)
            if _prefix_works(prefix, own_proc=bool(proc)):
                return prefix
    return None


def pid_namespace_mode() -> str:
    """How an unsandboxed action without a cgroup is tracked here: ``pid_namespace`` (with a /proc of its
    own), ``pid_namespace_host_proc`` (the host's /proc seen inside), or ``token`` (escapable)."""
    prefix = pid_namespace_prefix()
    if prefix is None:
        return "token"
    return "pid_namespace" if "--mount-proc" in prefix else "pid_namespace_host_proc"


def _ns_inode(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


class PidNamespace:
    """The PID namespace an action's command is the init of: its host pid, and the namespace held open.

    The open handle keeps the namespace's number from being reused by another
    action's namespace while this one is tracked. Killing the init is enough: the
    kernel then kills every other process of the namespace, also one that changed
    its credentials (which clears the parent-death signal ``--kill-child`` relies
    on) or its session; the namespace is empty once no process is in it.
    """

    __slots__ = ("init", "fd", "inode")

    def __init__(self, init: int, fd: int):
        self.init, self.fd, self.inode = init, fd, os.fstat(fd).st_ino

    @classmethod
    def of_child(cls, leader: int) -> "PidNamespace | None":
        """The namespace of ``leader``'s (``unshare``'s) child, if it has forked it already."""
        try:
            with open(f"/proc/{leader}/task/{leader}/children") as f:
                kids = f.read().split()
        except OSError:
            return None
        own = _ns_inode("self")
        for kid in kids:
            try:
                fd = os.open(f"/proc/{kid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            if os.fstat(fd).st_ino != own:
                return cls(int(kid), fd)
            os.close(fd)
        return None

    def members(self) -> list[int]:
        """Host pids of the namespace's processes that are not zombies, its init first."""
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit() and _ns_inode(d) == self.inode:
                st = _proc_state(int(d))
                if st is not None and st[0] not in ("Z", "X"):
                    out.append(int(d))
        out.sort(key=lambda pid: pid != self.init)
        return out

    def init_running(self) -> bool:
        st = _proc_state(self.init)
        return st is not None and st[0] not in ("Z", "X") and _ns_inode(self.init) == self.inode

    def signal(self, sig: int, *, sweep: bool) -> bool:
        """Signal the init (``sweep``: then every process of the namespace); True if any was there."""
        return _kill_each(self.members() if sweep else ([self.init] if self.init_running() else []), sig)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _kill_each(pids, sig: int) -> bool:
    """Signal every pid; True if any was there."""
    hit = False
    for pid in pids:
        try:
            os.kill(pid, sig)
            hit = True
        except ProcessLookupError:
            pass
    return hit


def _marked(token: bytes) -> list[int]:
    """Pids whose environment holds ``TANGRAM_ACTION_TOKEN=<token>``.

    Without a cgroup this is how a descendant that left the process group
    (``setsid``, a daemon) is still found; only used on kill paths.
    """
    needle = b"TANGRAM_ACTION_TOKEN=" + token
    me = os.getpid()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.append(int(d))
    return out


def _alive(pgid: int, group: "_Group | None", token: bytes = b"") -> bool:
    """Whether a non-zombie process of the action remains.

    With a cgroup: any member (every descendant is one, even after setsid).
    Without: any process of the process group or carrying the action's token.
    Zombies do not count: they run nothing, and where PID 1 does not reap
    orphans they would otherwise keep ``killpg(pgid, 0)`` succeeding forever.
    """
    if group is not None:
        pids = group.pids()
    else:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    marked = set(_marked(token)) if (group is None and token) else set()
    for pid in pids:
        st = _proc_state(pid)
        if st is not None and st[0] not in ("Z", "X") and (group is not None or st[1] == pgid or pid in marked):
            return True
    return False


class _Tracker:
    """The processes of one action: its process group, its cgroup, its token."""

    __slots__ = ("pgid", "group", "token", "in_namespace", "ns")

    def __init__(self, pgid: int, group: _Group | None, token: bytes, *, in_namespace: bool = False):
        self.pgid = pgid
        self.group = group
        self.token = token
        self.in_namespace = in_namespace  # pgid is ``unshare``, whose child is a PID namespace's init
        self.ns: PidNamespace | None = None

    def find_namespace(self) -> PidNamespace | None:
        """The action's PID namespace, looked up until found (``unshare`` forks its init soon after its start).

        Only while the leader has not been reaped: its pid could be another's after.
        """
        if self.ns is None and self.in_namespace:
            self.ns = PidNamespace.of_child(self.pgid)
        return self.ns

    async def await_namespace(self, leader_exited: asyncio.Future, within_s: float) -> None:
        """Wait until ``unshare`` has forked the namespace's init and hold the namespace (a few ms at most).

        The command could change its credentials and leave the process group at once,
        so its namespace is found at the start, not at the kill. An action whose
        leader ended before needs none: its init's exit emptied the namespace.
        """
        deadline = time.monotonic() + within_s
        while not leader_exited.done() and self.find_namespace() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.001)

    def close(self) -> None:
        if self.ns is not None:
            self.ns.close()

    def signal(self, sig: int, *, scan: bool) -> bool:
        """Signal every known process; True if any was there. ``scan``: also
        the token carriers (a /proc scan, only without a cgroup)."""
        hit = False
        if self.pgid:
            try:
                os.killpg(self.pgid, sig)
                hit = True
            except (ProcessLookupError, PermissionError):
                pass
        if self.ns is not None and self.ns.signal(sig, sweep=scan):
            hit = True
        pids = self.group.pids() if self.group is not None else (_marked(self.token) if scan and self.token else [])
        return _kill_each(pids, sig) or hit

    def alive(self) -> bool:
        """Whether any process of the action runs; in a PID namespace, whether the namespace is not empty."""
        if self.ns is not None and self.ns.members():
            return True
        return _alive(self.pgid, self.group, self.token)


_GROUP_NAME = re.compile(r"^p(\d+)-")  # an action group's name starts with its executor's pid


def sweep_dead_groups(parents) -> None:
    """Remove the action groups under ``parents`` of executors whose process died without cleaning up (kill -9)."""
    for parent in parents:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            m = _GROUP_NAME.match(name)
            if m is None or os.path.exists(f"/proc/{m.group(1)}"):
                continue
            g = _Group([os.path.join(parent, name)])
            _Tracker(0, g, b"").signal(signal.SIGKILL, scan=False)
            if _CgroupV1.remove(g):
                log.info("local executor: removed the stale cgroup %s", g.dirs[0])


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
        self.truncated = False
        self.exited = loop.create_future()
        self.pipes_closed = loop.create_future()
        self._open = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        buf = self.out if fd == 1 else self.err
        room = self.limit - len(buf)
        if len(data) > room:
            self.truncated = True
        if room > 0:
            buf += data[:room]

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open.discard(fd)
        if not self._open and not self.pipes_closed.done():
            self.pipes_closed.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


async def cleanup(track: "_Tracker", transport, proto: "_Collector") -> None:
    """Kill what an action left behind, wait until it is gone, collect its output."""
    try:
        # fast path: a command that left nothing costs one killpg returning ESRCH (no /proc scan)
        leftovers = track.signal(signal.SIGKILL, scan=False)
        if not leftovers and track.group is None and not proto.pipes_closed.done():
            # the leader is gone but its output is still open: an escaped descendant holds it
            try:
                await asyncio.wait_for(asyncio.shield(proto.pipes_closed), 0.1)
            except asyncio.TimeoutError:
                leftovers = track.signal(signal.SIGKILL, scan=True)
        if leftovers:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and track.alive():
                track.signal(signal.SIGKILL, scan=True)
                await asyncio.sleep(0.005)
        # output ends when the last writer is gone
        try:
            await asyncio.wait_for(asyncio.shield(proto.pipes_closed), 2.0)
        except asyncio.TimeoutError:
            log.warning("local executor: output pipes of pid %d still open after the kill", track.pgid)
        transport.close()
    finally:  # the namespace handle, also when cancelled meanwhile
        track.close()


async def cleanup_through_cancels(track: "_Tracker", transport, proto: "_Collector") -> bool:
    """:func:`cleanup` to its end whatever cancels come meanwhile (a second DELETE, the shutdown): cut
    short, it left processes alive, the pipes open and the action's cgroup behind. True if cancelled
    meanwhile (the caller raises it once it removed the group)."""
    task = asyncio.ensure_future(cleanup(track, transport, proto))
    cancelled = await wait_through_cancels(task)
    task.result()  # its own error, if any
    return cancelled
