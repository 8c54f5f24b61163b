"""``tangram serve`` as a subprocess: start it, learn its URL, stop it.

:func:`start_serve` runs ``python -m tangram.cli serve ARGS`` with this
interpreter and waits for the one line the command prints once it listens
(``tangram serve: listening on <url>``). Its stdout and stderr go to one pipe
that a reader thread drains for the process's whole life (a child writing to a
full pipe would block), keeping the last lines for error messages. Standard
library only: scripts and tests import this without the service's dependencies.
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Mapping, Sequence

__all__ = ["ServeProcess", "ServeStartError", "start_serve"]

LISTENING = re.compile(r"tangram serve: listening on (\S+)")
TAIL_LINES = 200  # output kept for error messages; older lines are dropped
MAX_LINE = 4096  # characters kept of one line


class ServeStartError(RuntimeError):
    """``tangram serve`` exited, or did not listen in time; ``output`` is the tail of what it printed."""

    def __init__(self, message: str, output: str, returncode: int | None):
        super().__init__(f"{message}\n--- output of tangram serve (last lines) ---\n{output}" if output else message)
        self.output = output
        self.returncode = returncode


class ServeProcess:
    """A running ``tangram serve``: ``url``, ``proc``; ``stop()`` or use it as a context manager.

    ``tail_lines``: how many of its last output lines to keep (each cut at
    ``MAX_LINE`` characters); None keeps everything it prints, whole (for a
    caller that checks the whole log, e.g. that a secret never appears in it).
    """

    def __init__(self, proc: subprocess.Popen, state_dir_to_remove: str | None = None, *,
                 tail_lines: int | None = TAIL_LINES):
        self.proc = proc
        self.url: str | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._max_line = MAX_LINE if tail_lines is not None else None
        self._printed = threading.Condition()  # guards _tail and _ended; notified at each line and at the end
        self._ended = False
        self._listening = threading.Event()  # set once listening, or at end of output
        self._state_dir_to_remove = state_dir_to_remove
        self._reader = threading.Thread(target=self._drain, name=f"tangram-serve-{proc.pid}-output", daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        try:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                with self._printed:
                    self._tail.append(line[:self._max_line])
                    self._printed.notify_all()
                if self.url is None:
                    m = LISTENING.search(line)
                    if m:
                        self.url = m.group(1)
                        self._listening.set()
        except (OSError, ValueError):
            pass
        finally:
            self.proc.stdout.close()  # type: ignore[union-attr]
            with self._printed:
                self._ended = True
                self._printed.notify_all()
            self._listening.set()

    def output(self) -> str:
        """What the process printed (stdout and stderr together; its last ``tail_lines`` lines)."""
        with self._printed:
            return "".join(self._tail)

    def wait_for_output(self, text: str, timeout_s: float = 10.0) -> bool:
        """Whether ``text`` appears in :meth:`output` within ``timeout_s`` (False once the output ended without it)."""
        with self._printed:
            self._printed.wait_for(lambda: self._ended or text in "".join(self._tail), timeout_s)
            return text in "".join(self._tail)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, grace_s: float = 15.0) -> int:
        """SIGTERM (a clean shutdown: actions cancelled, environments removed), SIGKILL after ``grace_s``.

        Returns the exit status; a second call only returns it again."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()
        return self.proc.returncode

    def kill(self) -> int:
        """SIGKILL, as a crash would; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()
        return self.proc.returncode

    def _close(self) -> None:
        # the pipe ends once the process and anything that inherited its output are gone; the
        # reader closes it then (closing it under a blocked read would wait for that read anyway)
        self._reader.join(timeout=5)
        if self._state_dir_to_remove:
            shutil.rmtree(self._state_dir_to_remove, ignore_errors=True)
            self._state_dir_to_remove = None

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServeProcess(pid={self.proc.pid}, url={self.url!r}, returncode={self.proc.returncode})"


def start_serve(args: Sequence[str] = (), *, wait_s: float = 60.0, env: Mapping[str, str] | None = None,
                cwd: str | os.PathLike | None = None, state_dir: str | os.PathLike | None = None,
                throwaway_state: bool = False, tail_lines: int | None = TAIL_LINES) -> ServeProcess:
    """Start ``tangram serve ARGS`` and return it once it listens (its URL in ``.url``).

    ``env`` is the child's whole environment (default: this process's); ``cwd`` its
    working directory (``-m tangram.cli`` imports tangram from there first).
    ``state_dir`` adds ``--state-dir``; ``throwaway_state`` instead gives it a fresh
    temporary state directory, removed at ``stop()``: a throwaway service neither
    shares nor is refused the default state directory of the nodes it serves.
    ``tail_lines``: the output kept (:class:`ServeProcess`; None: all of it).

    Raises :class:`ServeStartError` (with the output's tail) if it exits or does not
    listen within ``wait_s`` seconds; it is then killed and nothing is left behind.
    """
    if state_dir is not None and throwaway_state:
        raise ValueError("give state_dir or throwaway_state, not both")
    args = [os.fspath(a) for a in args]
    temp_state = None
    if throwaway_state:
        temp_state = tempfile.mkdtemp(prefix="tangram-state-")
        args += ["--state-dir", temp_state]
    elif state_dir is not None:
        args += ["--state-dir", os.fspath(state_dir)]
    try:
        proc = subprocess.Popen([sys.executable, "-m", "tangram.cli", "serve", *args], cwd=cwd,
                                env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    except BaseException:
        if temp_state:
            shutil.rmtree(temp_state, ignore_errors=True)
        raise
    serve = ServeProcess(proc, temp_state, tail_lines=tail_lines)
    try:
        serve._listening.wait(wait_s)
    except BaseException:  # interrupted: leave nothing running
        serve.kill()
        raise
    if serve.url is not None:
        return serve
    rc = proc.poll()
    if rc is None and not serve._reader.is_alive():  # its output ended: it is exiting
        try:
            rc = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    if rc is None:
        serve.kill()
        raise ServeStartError(f"tangram serve did not listen within {wait_s:g} s (killed)", serve.output(), None)
    serve.kill()  # reaps it, closes the pipe
    raise ServeStartError(f"tangram serve exited with status {rc} before listening", serve.output(), rc)
