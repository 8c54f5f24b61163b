"""The program one SandboxFusion ``run_code`` action runs inside its environment.

Standard library only, and run as ``python -I -S -c <this file's source>``: it
needs nothing of tangram inside the sandbox. It reads one JSON spec on stdin::

    {"code", "source", "compile": [argv] | null, "run": [argv], "stdin": str | null,
     "compile_timeout", "run_timeout", "memory_limit_mb", "files": {path: base64 | null},
     "fetch_files": [path], "max_output_bytes"}

writes the files and the code (``source``) into the working directory, runs the
compile step (when there is one) and then the program, each under its own
timeout and in its own session, and prints one JSON line with SandboxFusion's
``compile_result`` / ``run_result`` (``status``: ``Finished`` | ``TimeLimitExceeded``
| ``Error``, ``execution_time``, ``return_code``, ``stdout``, ``stderr``) and
``files`` (the fetched files, base64). ``memory_limit_mb`` > 0 bounds each
step's address space (``RLIMIT_AS``/``RLIMIT_DATA``) and raises its stack limit to
the same size, as SandboxFusion does without container isolation; the
environment's cgroup bounds the action as a whole.
"""
from __future__ import annotations

import base64
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time

FINISHED, ERROR, TLE = "Finished", "Error", "TimeLimitExceeded"
_CHUNK = 1 << 16


def _limits(memory_mb: int):
    if memory_mb <= 0:
        return None
    size = memory_mb << 20

    def apply() -> None:
        for res in (resource.RLIMIT_AS, resource.RLIMIT_DATA, resource.RLIMIT_STACK):
            _, hard = resource.getrlimit(res)
            resource.setrlimit(res, (size if hard == resource.RLIM_INFINITY else min(size, hard), hard))

    return apply


def _drain(pipe, buf: bytearray, cap: int) -> None:
    """Read until EOF, keeping the first ``cap`` bytes (a flood cannot fill the runner's memory)."""
    while True:
        chunk = pipe.read(_CHUNK)
        if not chunk:
            return
        room = cap - len(buf)
        if room > 0:
            buf += chunk[:room]


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
    except (BrokenPipeError, OSError):
        pass  # the program stopped reading: what it read is what it gets
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_step(argv: list[str], timeout: float, stdin: bytes | None, memory_mb: int, cap: int) -> dict:
    """One command, SandboxFusion's CommandRunResult as a dict."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=_limits(memory_mb))
    except OSError as exc:  # the toolchain is missing or not executable: the sandbox's fault, not the code's
        return {"status": ERROR, "execution_time": 0.0, "return_code": None, "stdout": "",
                "stderr": f"cannot run {argv[0]}: {exc.strerror or exc}"}
    out, err = bytearray(), bytearray()
    threads = [threading.Thread(target=_drain, args=(proc.stdout, out, cap), daemon=True),
               threading.Thread(target=_drain, args=(proc.stderr, err, cap), daemon=True),
               threading.Thread(target=_feed, args=(proc.stdin, stdin or b""), daemon=True)]
    for t in threads:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    elapsed = time.monotonic() - started
    _kill_session(proc.pid)  # also what it left in the background
    proc.wait()
    for t in threads[:2]:
        t.join(1.0)  # a descendant that left the session may hold a pipe: the action's cleanup kills it
    result = {"status": TLE if timed_out else FINISHED, "execution_time": elapsed,
              "return_code": None if timed_out else proc.returncode,
              "stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace")}
    return result


def _inside(path: str) -> str:
    full = os.path.realpath(os.path.join(os.getcwd(), path))
    if os.path.commonpath([full, os.path.realpath(os.getcwd())]) != os.path.realpath(os.getcwd()):
        raise ValueError(f"{path!r} leaves the working directory")
    return full


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    cap = int(spec.get("max_output_bytes", 1 << 20))
    report: dict = {"compile_result": None, "run_result": None, "files": {}}
    for name, content in (spec.get("files") or {}).items():
        if content is None:
            continue
        full = _inside(name)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(base64.b64decode(content))
    with open(_inside(spec["source"]), "w", encoding="utf-8") as f:
        f.write(spec["code"])
    memory_mb = int(spec.get("memory_limit_mb") or 0)
    ok = True
    if spec.get("compile"):
        res = run_step(spec["compile"], float(spec["compile_timeout"]), None, memory_mb, cap)
        report["compile_result"] = res
        ok = res["status"] == FINISHED and res["return_code"] == 0
    if ok:
        stdin = spec.get("stdin")
        report["run_result"] = run_step(spec["run"], float(spec["run_timeout"]),
                                        None if stdin is None else stdin.encode(), memory_mb, cap)
    for name in spec.get("fetch_files") or ():
        try:
            full = _inside(name)
        except ValueError:
            continue
        if os.path.isfile(full):
            with open(full, "rb") as f:
                report["files"][name] = base64.b64encode(f.read()).decode()
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
