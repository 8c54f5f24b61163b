"""The processes of one local action: finding them (process group, cgroup, token) and their output.

An action's processes are its process group, every member of its cgroup
(even after ``setsid``) and, without a cgroup, every process whose
environment carries its ``TANGRAM_ACTION_TOKEN``; :class:`_Tracker` signals
them all and tells whether any still runs. The token is the weakest of these:
a command can clear its environment (``env -i``), so an action without a
cgroup runs in a PID namespace of its own when the machine allows one
(:func:`pid_namespace_prefix`), which no process inside can leave.
:class:`_Collector` keeps the output (capped) and tells the leader's exit
apart from the pipes' EOF.
"""
from __future__ import annotations

import asyncio
import functools
import os
import shutil
import subprocess

from tangram.executors.cgroups import _Group


def _proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of ``pid`` from /proc, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


@functools.lru_cache(maxsize=None)
def pid_namespace_prefix() -> tuple[str, ...] | None:
    """An argv prefix that runs a command as the init of a new PID namespace, or None if this machine can't.

    ``unshare --pid --fork --kill-child``: the command is the namespace's PID 1 and
    gets SIGKILL when ``unshare`` (the action's process-group leader) dies; when
    PID 1 ends the kernel kills every process of the namespace, whatever it did
    to its environment, session or parentage. A non-root service needs a user
    namespace for that (``--user --map-current-user``: the same uid inside).
    Probed once per process by running ``true`` under it.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    user = [] if os.geteuid() == 0 else ["--user", "--map-current-user"]
    prefix = (unshare, *user, "--pid", "--fork", "--kill-child")
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return prefix if ok else None


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

    __slots__ = ("pgid", "group", "token")

    def __init__(self, pgid: int, group: _Group | None, token: bytes):
        self.pgid = pgid
        self.group = group
        self.token = token

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
        pids = self.group.pids() if self.group is not None else (_marked(self.token) if scan and self.token else [])
        for pid in pids:
            try:
                os.kill(pid, sig)
                hit = True
            except ProcessLookupError:
                pass
        return hit

    def alive(self) -> bool:
        return _alive(self.pgid, self.group, self.token)


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
