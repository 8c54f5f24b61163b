"""The program one SandboxFusion ``run_code`` action runs inside its environment.

Run as ``python -I -S -c <this file's source>``: it needs nothing of tangram
inside the sandbox, and imports only modules built into the interpreter (no
``json``, ``subprocess``, ``signal`` or ``threading``: their imports cost more
CPU than the rest of the runner, once per call). It reads one request on stdin
and writes one report on stdout, both as records ``<kind> <fields...>\\n``
followed by the payloads whose lengths the last fields give
(:func:`tangram.service.sandbox_protocol.encode_request` /
:func:`~tangram.service.sandbox_protocol.decode_report` are the other side).

It writes the files and the code into the working directory, runs the compile
step (when there is one) and then the program, each in a session of its own
under its own timeout (the session is killed at the timeout, and after the step
whatever it left behind), feeds the program its stdin from an unlinked file,
and reports SandboxFusion's ``status`` (``Finished`` | ``TimeLimitExceeded`` |
``Error``), ``return_code`` (negative: killed by that signal), ``execution_time``,
stdout and stderr (each capped), then the fetched files (base64).
``memory_limit_mb`` > 0 bounds each step's address space and data
(``RLIMIT_AS``, ``RLIMIT_DATA``) and sets its stack limit to the same size, as
SandboxFusion does without container isolation; the environment's own limits
(cgroup, sandbox) bound the action as a whole.
"""
import binascii
import os
import resource
import select
import sys
import time

SIGKILL = 9  # the signal module would import enum (~10 ms per call)
_CHUNK = 1 << 16


def _records(data):
    """Parse ``kind f1 .. fn\\n`` + payloads: yields (kind, fields, payloads)."""
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        head = data[i:nl].decode().split(" ")
        i = nl + 1
        kind, fields = head[0], head[1:]
        n = int(fields[0]) if fields else 0  # how many payloads, then their lengths
        lens = [int(x) for x in fields[1:1 + n]]
        payloads = []
        for ln in lens:
            payloads.append(data[i:i + ln])
            i += ln
        yield kind, fields[1 + n:], payloads


def _inside(path):
    root = os.path.realpath(os.getcwd())
    full = os.path.realpath(os.path.join(root, path))
    if full != root and not full.startswith(root + os.sep):
        raise ValueError(path)
    return full


def _limit(memory_mb):
    size = memory_mb << 20
    for res in (resource.RLIMIT_AS, resource.RLIMIT_DATA, resource.RLIMIT_STACK):
        soft, hard = resource.getrlimit(res)
        resource.setrlimit(res, (size if hard == resource.RLIM_INFINITY else min(size, hard), hard))


def _kill_group(pid):
    try:
        os.killpg(pid, SIGKILL)
    except OSError:
        pass


def run_step(argv, timeout, stdin_fd, memory_mb, cap):
    """Run ``argv``; returns (status, return_code, seconds, stdout bytes, stderr bytes)."""
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    r_exec, w_exec = os.pipe()  # close-on-exec: EOF at once if exec worked, errno text if not
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: its own session, limits, then the command
        try:
            os.setsid()
            if memory_mb > 0:
                _limit(memory_mb)
            os.dup2(stdin_fd, 0)
            os.dup2(w_out, 1)
            os.dup2(w_err, 2)
            os.execvp(argv[0], argv)
        except BaseException as exc:  # noqa: BLE001 - report and leave, never run on as the runner
            try:
                os.write(w_exec, f"cannot run {argv[0]}: {getattr(exc, 'strerror', None) or exc}".encode())
            finally:
                os._exit(127)
    for fd in (w_out, w_err, w_exec):
        os.close(fd)
    failed = b""
    while True:
        chunk = os.read(r_exec, 4096)
        if not chunk:
            break
        failed += chunk
    os.close(r_exec)
    if failed:
        os.waitpid(pid, 0)
        for fd in (r_out, r_err):
            os.close(fd)
        return "Error", None, 0.0, b"", failed
    try:
        exited = os.pidfd_open(pid)  # readable once the leader exits (Linux >= 5.3)
    except (AttributeError, OSError):
        exited = None
    bufs = {r_out: bytearray(), r_err: bytearray()}
    open_fds = [r_out, r_err]
    deadline = started + timeout
    rc, status, elapsed = None, "Finished", None
    while rc is None:
        left = deadline - time.monotonic()
        if left <= 0:
            status, elapsed = "TimeLimitExceeded", time.monotonic() - started
            _kill_group(pid)
            os.waitpid(pid, 0)
            break
        watch = open_fds + ([exited] if exited is not None else [])
        ready = select.select(watch, [], [], left if exited is not None else min(left, 0.005))[0]
        for fd in ready:
            if fd == exited:
                continue
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                open_fds.remove(fd)
                continue
            room = cap - len(bufs[fd])
            if room > 0:
                bufs[fd] += chunk[:room]
        done, wstatus = os.waitpid(pid, os.WNOHANG)
        if done:
            elapsed = time.monotonic() - started
            rc = os.waitstatus_to_exitcode(wstatus)
    _kill_group(pid)  # what it left in the background; the action's cleanup catches those that left the session
    end = time.monotonic() + 0.5
    while open_fds and time.monotonic() < end:  # the rest of the output, bounded in time
        for fd in select.select(open_fds, [], [], max(0.0, end - time.monotonic()))[0]:
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                open_fds.remove(fd)
            elif len(bufs[fd]) < cap:
                bufs[fd] += chunk[:cap - len(bufs[fd])]
    for fd in (r_out, r_err):
        os.close(fd)
    if exited is not None:
        os.close(exited)
    return status, rc, elapsed, bytes(bufs[r_out]), bytes(bufs[r_err])


def _text(b):
    return b.decode("utf-8", "replace").encode("utf-8")


def _undumpable():
    """Nothing the program runs as this user can open this process's /proc entries (its fd/1 is where
    the report goes); the program itself, once exec'd, is dumpable again."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:  # noqa: BLE001 - no ctypes (a minimal python): the secret in the report still holds
        pass


def main():
    _undumpable()
    out = sys.stdout.buffer
    limits, files, code, compile_argv, run_argv, stdin, fetch = {}, [], None, None, None, b"", []
    for kind, fields, payloads in _records(sys.stdin.buffer.read()):
        if kind == "limits":
            limits = {"compile_timeout": float(fields[0]), "run_timeout": float(fields[1]),
                      "memory_mb": int(fields[2]), "cap": int(fields[3]), "nonce": fields[4]}
        elif kind == "file":
            files.append((payloads[0].decode(), payloads[1]))
        elif kind == "source":
            code = (payloads[0].decode(), payloads[1])
        elif kind in ("compile", "run"):
            argv = [a.decode() for a in payloads[0].split(b"\0")]
            compile_argv, run_argv = (argv, run_argv) if kind == "compile" else (compile_argv, argv)
        elif kind == "stdin":
            stdin = payloads[0]
        elif kind == "fetch":
            fetch = [p.decode() for p in payloads[0].split(b"\0") if p]
    for name, data in files + [code]:
        full = _inside(name)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
    cap = limits["cap"]
    ok = True
    steps = []
    if compile_argv:
        with open(os.devnull, "rb") as null:
            res = run_step(compile_argv, limits["compile_timeout"], null.fileno(), limits["memory_mb"], cap)
        steps.append(("compile", res))
        ok = res[0] == "Finished" and res[1] == 0
    if ok:
        path = _inside(".tangram-stdin")
        with open(path, "wb") as f:
            f.write(stdin)
        fd = os.open(path, os.O_RDONLY)
        os.unlink(path)  # the program reads it; nobody sees it in the directory
        try:
            steps.append(("run", run_step(run_argv, limits["run_timeout"], fd, limits["memory_mb"], cap)))
        finally:
            os.close(fd)
    for name, (status, rc, seconds, so, se) in steps:
        so, se = _text(so), _text(se)
        out.write(f"{name} 2 {len(so)} {len(se)} {status} {'-' if rc is None else rc} {seconds!r}\n".encode())
        out.write(so + se)
    for name in fetch:
        try:
            full = _inside(name)
        except ValueError:
            continue
        if os.path.isfile(full):
            with open(full, "rb") as f:
                data = binascii.b2a_base64(f.read(), newline=False)
            path = name.encode()
            out.write(f"file 2 {len(path)} {len(data)}\n".encode() + path + data)
    out.write(f"done 0 {limits['nonce']}\n".encode())
    out.flush()


if __name__ == "__main__":
    main()
