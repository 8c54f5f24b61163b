"""Which results of a reward action are verdicts on the model's response, and the score each gives
(no verl import here).

A test command's exit code is a verdict when the response could have caused it: 0, 1 (tests
failed), 2 (pytest: collection errors, which a response that does not import causes), 3, a signal
(137: killed for memory) or a timeout at the widest DoP. Some exit codes say the suite could not run
whatever the response: :data:`BROKEN_EXIT_CODES` (4 and 5 only from a command that runs pytest, and
4 not when a conftest.py could not import the response's code; a sample's ``broken_exit_codes``
overrides the set, ``[]`` turns it off), and a ``solution_file`` the response could not be written to in full.
Those, a run with no exit code (a timeout among them: the service's safety net cancelled a run its executor never
ended, as under a stalled Docker Engine; an executor's own timeout kills the command and reports its exit
status), and a ``fraction`` score with no pytest summary to read raise :class:`NoVerdict`.
"""
from __future__ import annotations

import math
import re
import shlex
from typing import Any, Mapping

from tangram.client import ActionResult

# exit codes of a test command that say the suite could not run, not that the response failed it
BROKEN_EXIT_CODES: dict[int, str] = {
    4: "pytest usage error: an unknown option or a plugin that is not installed, e.g. -n without pytest-xdist",
    5: "pytest collected no tests: a wrong directory or test path, or the image lacks the suite",
    126: "the command was found but cannot be executed (permissions, not a binary)",
    127: "command not found: the image lacks it or PATH does not reach it",
}
# the solution_file step's own exit code; a verdict unless its marker is in stderr too, as a test
# command may exit 86 itself
SOLUTION_WRITE_FAILED = 86
SOLUTION_WRITE_MARKER = "tangram: cannot write solution_file"
SCORE_MODES = ("binary", "fraction")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# pytest's summary line: "3 passed, 1 failed in 0.12s" (-q), "==== 2 failed, 1 error in 1.02s ====",
# "in 65.02s (0:01:05)" past a minute
_SUMMARY = re.compile(r"^(?:=+ )?(\d+ [a-z][a-z ]*(?:, \d+ [a-z][a-z ]*)*) in \d+(?:\.\d+)?(?:s| seconds)"
                      r"(?: \([\d:]+\))?(?: =+)?$")
_ITEM = re.compile(r"(\d+) ([a-z][a-z ]*[a-z])")
# the items of the summary a score reads; others (skipped, warnings, "subtests passed" of pytest 9, a
# plugin's own) are left out
_COUNTED = {"passed": "passed", "failed": "failed", "error": "errors", "errors": "errors"}


class NoVerdict(Exception):
    """A reward action's result that says nothing about the response."""


def broken_exit_codes(spec: Mapping[str, Any]) -> dict[int, str]:
    """The exit codes of the spec's test command that raise (code -> what it usually means)."""
    given = spec.get("broken_exit_codes")
    if given is None:
        return BROKEN_EXIT_CODES
    given = given.tolist() if hasattr(given, "tolist") else given  # a numpy array out of a parquet row
    if not isinstance(given, (list, tuple)) or not all(isinstance(c, int) and not isinstance(c, bool)
                                                       for c in given):
        raise ValueError(f"broken_exit_codes: a list of ints (exit codes of the test command that mean it "
                         f"could not run; [] for none), got {given!r}")
    return {c: BROKEN_EXIT_CODES.get(c, "listed in the sample's broken_exit_codes") for c in given}


def score_mode(spec: Mapping[str, Any]) -> str:
    mode = str(spec.get("score") or "binary")
    if mode not in SCORE_MODES:  # a typo would score binary without a word
        raise ValueError(f"score: 'binary' or 'fraction', got {spec.get('score')!r}")
    return mode


def write_solution_step(path: str, size: int) -> str:
    """The (POSIX) shell step copying the action's stdin (the response, ``size`` bytes of UTF-8) to ``path``
    byte for byte. A path that cannot be written (no such directory) or a file short of ``size`` bytes (a
    stdin cut on its way: a proxy that dropped the half-close, an executor that stopped writing) exits
    :data:`SOLUTION_WRITE_FAILED` with the marker in stderr rather than test a truncated response."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size: a byte count >= 0, got {size!r}")
    q = shlex.quote(path)
    why = shlex.quote(f"{SOLUTION_WRITE_MARKER} {path}: unwritable, or short of the response's {size} bytes")
    return (f'cat > {q} && [ "$(wc -c < {q})" -eq {size} ] || '
            f"{{ echo {why} >&2; exit {SOLUTION_WRITE_FAILED}; }}")


def _tail(r: ActionResult) -> str:
    return (r.stderr or r.stdout or "").strip()[-500:]


_PYTEST = re.compile(r"(^|[\s/;&|(])(py\.test|pytest)\b")
# exit codes pytest gives that say the run could not test anything, when the command runs pytest
_PYTEST_ONLY = (4, 5)
# pytest exits 4 too when a conftest.py cannot import the response's code: a verdict on the response
_CONFTEST_IMPORT = "ImportError while loading conftest"


def exec_broken(r: ActionResult, spec: Mapping[str, Any]) -> str | None:
    """Why a test-suite action's result says nothing about the response (None: it is a verdict)."""
    if r.status == "succeeded":
        return None
    if r.status == "timeout":
        if r.exit_code is not None:  # the executor killed the command at timeout_s: its exit status is known
            return None
        # no executor reported the command's end: the service's safety net gave up on one that did not end
        # the run within timeout_s + its grace (a stalled Docker Engine), or the runs a restart stopped
        # spent the deadline; nothing says the response ran that long
        return (f"timeout with no exit code: no executor ended the run itself ({r.error or 'no reason given'}); "
                "the command may never have run")
    if r.status != "failed" or r.exit_code is None:  # it never ran, or was cancelled
        return f"{r.status}: {(r.error or r.stderr or '')[-500:]}".strip()
    code = r.exit_code
    if code == SOLUTION_WRITE_FAILED and SOLUTION_WRITE_MARKER in (r.stderr or ""):
        return (f"the response could not be written to solution_file {spec.get('solution_file')!r} in full (the "
                f"path is unwritable, or the action's stdin arrived short of the response): {_tail(r)}")
    meaning = broken_exit_codes(spec).get(code)
    if (meaning is not None and code in _PYTEST_ONLY and spec.get("broken_exit_codes") is None
            and not _PYTEST.search(str(spec.get("test_command") or ""))):
        meaning = None  # another program's 4 or 5 means what that program says; only pytest's are known
    if code == 4 and _CONFTEST_IMPORT in (r.stdout or "") + (r.stderr or ""):
        meaning = None
    if meaning is not None:
        return (f"the test command exited {code} ({meaning}; set broken_exit_codes to change which exit "
                f"codes raise); its output ends: {_tail(r)}")
    return None


def pytest_counts(stdout: str, *, truncated: bool = False) -> dict[str, int] | None:
    """The passed / failed / errors counts of pytest's summary line in ``stdout`` (its last one), None if it
    has none. Output the executor cut (``truncated``: it keeps the start) has lost its end: a summary
    counts only as its last line."""
    lines = [s for s in (_ANSI.sub("", x).strip() for x in (stdout or "").splitlines()) if s]
    for i in range(len(lines) - 1, -1, -1):
        m = _SUMMARY.match(lines[i])
        if not m:
            continue
        if truncated and i != len(lines) - 1:
            return None
        counts: dict[str, int] = {}
        for n, what in _ITEM.findall(m.group(1)):
            if what in _COUNTED:
                counts[_COUNTED[what]] = counts.get(_COUNTED[what], 0) + int(n)
        return counts
    return None


def score_tests(r: ActionResult, mode: str = "binary") -> float:
    """The score of a test-suite action that is a verdict. ``fraction``: passed / (passed + failed +
    errors) of pytest's summary line in stdout. Without one, a run that printed past the output's cap
    (the executor keeps the start, and the response can print that much) is scored by its exit code as
    ``binary`` is; a run that timed out, was killed, or exited with pytest's internal error or a code of
    its own scores 0.0; one that exited 0, 1 or 2 with
    all its output raises (a command that never reached pytest, ``-qq``, or a response that exited the
    interpreter itself). A failing run whose summary counts no failure scores 0.0: pytest exits 1 only
    with one, so that line is not pytest's (a response may print one after it)."""
    if mode == "fraction":
        c = pytest_counts(r.stdout or "", truncated=r.truncated)
        if c is None:
            if r.truncated and r.status != "timeout":  # its exit code is all that is left: pytest's 0 is all passed
                return 1.0 if r.exit_code == 0 else 0.0
            if r.status == "timeout" or r.exit_code not in (0, 1, 2):
                return 0.0
            raise NoVerdict(f"score: fraction needs pytest's summary line (e.g. '3 passed, 1 failed in 0.12s') in "
                            f"the test command's stdout, and a run that exited {r.exit_code} with all its output "
                            "printed none: the command may not reach pytest (a failed cd, another runner), run it "
                            "with -qq, or the response may exit the interpreter itself. Use score: binary, or "
                            "pytest with -q")
        if r.exit_code == 1 and not (c.get("failed", 0) + c.get("errors", 0)):
            return 0.0  # pytest exits 1 only with a failure: that summary is not pytest's
        total = c.get("passed", 0) + c.get("failed", 0) + c.get("errors", 0)
        return c.get("passed", 0) / total if total else 0.0
    return 1.0 if (r.status == "succeeded" and r.exit_code == 0) else 0.0


def finite(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError(f"the score is not a finite number: {x}")
    return x
