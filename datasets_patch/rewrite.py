"""Rewrite a test command or evaluation script so its DoP is chosen at run time.

Each pytest invocation gets exactly one ``-n ${parallel_num}`` (pytest-xdist),
Django's ``tests/runtests.py`` gets ``--parallel ${parallel_num}``. Edits are
made on the original string by the offsets of the words, so everything else
(quoting, ``-k`` expressions, heredocs, comments) stays byte for byte.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from datasets_patch.runners import Runner, resolve
from datasets_patch.shell import Command, Word, parse_script

PARALLEL = "${parallel_num}"
PYTEST_OPTION = f"-n {PARALLEL}"
DJANGO_OPTION = f"--parallel {PARALLEL}"
INSTALL_LINE = "python -m pip install -q pytest-xdist || true"

# outcomes, best first: the value's outcome is the best of its invocations
OUTCOMES = ("patched", "already_patched", "kept_explicit", "no_xdist_optout",
            "unsupported_runner", "no_test_command")

# pytest options whose value is the next word (a ``-n`` there is not ours)
_PYTEST_VALUE_OPTS = {
    "-k", "-m", "-p", "-c", "-o", "-W", "-r", "--deselect", "--ignore", "--ignore-glob",
    "--rootdir", "--confcutdir", "--basetemp", "--junitxml", "--junit-xml", "--junit-prefix",
    "--tb", "--capture", "--cov", "--cov-report", "--cov-config", "--durations",
    "--durations-min", "--maxfail", "--log-level", "--log-file", "--log-format",
    "--log-cli-level", "--log-cli-format", "--log-file-level", "--log-date-format",
    "--import-mode", "--override-ini", "--timeout", "--dist", "--maxprocesses", "--tx",
    "--rsyncdir", "--reruns", "--count", "--randomly-seed", "--doctest-glob", "--html",
    "--color", "--code-highlight", "--verbosity", "--asyncio-mode", "--pdbcls",
    "--max-worker-restart", "--report-log", "--config-file", "--inifile",
}
# single-token worker counts: -n4, -nauto, -n=4, --numprocesses=4
_INLINE_N = re.compile(r"^(?:-n=?|--numprocesses=)(\S+)$")
_NO_XDIST = re.compile(r"^-p=?no:xdist(\.plugin)?$")
_DJANGO_VALUE = re.compile(r"^(\d+|auto|\$\{?parallel_num\}?)$")


@dataclass
class Invocation:
    runner: str  # "pytest", "django runtests.py", "tox", ...
    outcome: str
    start: int  # offset of the command's program word
    needs_xdist: bool = False


@dataclass
class PatchResult:
    text: str
    outcome: str
    invocations: list[Invocation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(i.outcome == "patched" for i in self.invocations)

    @property
    def needs_xdist(self) -> bool:
        return any(i.needs_xdist for i in self.invocations)


def patch_script(text: str, keep_explicit: bool = False, install_step: bool = False,
                 xdist_installed: bool = False) -> PatchResult:
    """Patch every pytest / Django runner invocation in ``text``.

    ``install_step`` puts ``INSTALL_LINE`` before the first statement whose
    pytest needs xdist (after ``conda activate`` and the like, so it lands in
    the test environment), unless the script already installs pytest-xdist.
    """
    parsed = parse_script(text)
    edits: list[tuple[int, int, str]] = []
    invocations: list[Invocation] = []
    notes = list(parsed.notes)
    installs_xdist = xdist_installed
    first_needing: Command | None = None
    for cmd in parsed.commands:
        if not cmd.words:
            continue
        runner = resolve(cmd.words)
        if runner.kind == "pip" and _installs_xdist(cmd.words[runner.program + 1:]):
            installs_xdist = True
        if runner.kind == "pytest":
            inv = _patch_pytest(text, cmd, runner, keep_explicit, edits)
            if inv.needs_xdist and first_needing is None:
                first_needing = cmd
        elif runner.kind == "django":
            inv = _patch_django(text, cmd, runner, keep_explicit, edits)
        elif runner.kind == "nested":
            nested = _patch_nested(cmd.words[runner.program], keep_explicit, edits)
            if nested is None:
                continue
            invocations.extend(nested.invocations)
            notes.extend(nested.notes)
            if nested.needs_xdist and first_needing is None:
                first_needing = cmd
            continue
        elif runner.kind == "other":
            inv = Invocation(runner.name, "unsupported_runner", cmd.words[runner.program].start)
        else:
            continue
        invocations.append(inv)
        if inv.outcome != "patched":
            notes.append(f"{inv.runner}: {inv.outcome}")
    if installs_xdist:
        for inv in invocations:
            inv.needs_xdist = False
    elif install_step and first_needing is not None:
        edits.append(_install_edit(text, first_needing.statement_start))
        for inv in invocations:
            inv.needs_xdist = False
    outcome = _overall(invocations)
    return PatchResult(_apply(text, edits), outcome, invocations, notes)


def _overall(invocations: list[Invocation]) -> str:
    if not invocations:
        return "no_test_command"
    return min((i.outcome for i in invocations), key=OUTCOMES.index)


def _installs_xdist(args: list[Word]) -> bool:
    values = [w.value for w in args]
    return "install" in values and any(
        v.lower().replace("_", "-").startswith("pytest-xdist") for v in values)


def _patch_pytest(text: str, cmd: Command, runner: Runner, keep_explicit: bool,
                  edits: list[tuple[int, int, str]]) -> Invocation:
    words = cmd.words
    prog = words[runner.program]
    inv = Invocation("pytest", "patched", prog.start)
    ours: list[tuple[int, int]] = []
    explicit: list[tuple[int, int]] = []
    loads_xdist = False
    j = runner.program + 1
    while j < len(words):
        value = words[j].value
        if value == "--":
            break
        if _NO_XDIST.match(value) or (value == "-p" and j + 1 < len(words)
                                      and _NO_XDIST.match("-p" + words[j + 1].value)):
            inv.outcome = "no_xdist_optout"
            return inv
        if value == "-p" and j + 1 < len(words) and words[j + 1].value.startswith("xdist"):
            loads_xdist = True
        if value.startswith("-pxdist") or value.startswith("-p=xdist"):
            loads_xdist = True
        if _missing_count(words, j):
            # pytest would stop at it anyway; any edit would hide or drop words
            inv.runner, inv.outcome = "pytest (-n without a value)", "unsupported_runner"
            return inv
        if value in ("-n", "--numprocesses"):
            span = (j, j + 1)
            is_ours = value == "-n" and _raw_is_parallel(words[j + 1])
            (ours if is_ours else explicit).append(span)
            j += 2
            continue
        if _INLINE_N.match(value):
            explicit.append((j, j))
            j += 1
            continue
        j += 2 if value in _PYTEST_VALUE_OPTS else 1
    if explicit and keep_explicit and not ours:
        inv.outcome = "kept_explicit"
        return inv
    if ours and not explicit and len(ours) == 1:
        inv.outcome = "already_patched"
        return inv
    spans = ours + explicit
    if not spans:
        option = PYTEST_OPTION
        if _autoload_off(cmd) and not loads_xdist:
            option = "-p xdist.plugin " + option  # plugins are not loaded by themselves
        edits.append((prog.end, prog.end, " " + option))
        inv.needs_xdist = True  # nothing says xdist is in that environment
        return inv
    # keep one (ours, else the first explicit one) canonical; drop the rest,
    # since argparse lets the last -n win
    keep = ours[0] if ours else min(explicit)
    for span in spans:
        first, last = words[span[0]], words[span[1]]
        if span == keep:
            edits.append((first.start, last.end, PYTEST_OPTION))
        else:
            edits.append((_strip_left(text, first.start), last.end, ""))
    return inv


def _missing_count(words: list[Word], j: int) -> bool:
    """``-n`` / ``--numprocesses`` at ``j`` has no value: last word, ``-n=``, or an option next."""
    value = words[j].value
    if value in ("-n=", "--numprocesses="):
        return True
    if value not in ("-n", "--numprocesses"):
        return False
    if j + 1 == len(words):
        return True
    nxt = words[j + 1].value
    # argparse takes "-x" or "--" as the next option, not as -n's value
    return nxt.startswith("-") and not re.match(r"^-\d", nxt)


def _patch_django(text: str, cmd: Command, runner: Runner, keep_explicit: bool,
                  edits: list[tuple[int, int, str]]) -> Invocation:
    words = cmd.words
    prog = words[runner.program]
    inv = Invocation("django runtests.py", "patched", prog.start)
    spans: list[tuple[int, int, bool]] = []  # first, last word index, is ours
    j = runner.program + 1
    while j < len(words):
        value = words[j].value
        if value == "--parallel":
            if j + 1 < len(words) and _DJANGO_VALUE.match(words[j + 1].value):
                spans.append((j, j + 1, _raw_is_parallel(words[j + 1])))
                j += 2
                continue
            spans.append((j, j, False))  # bare --parallel: all cores
        elif value.startswith("--parallel="):
            spans.append((j, j, False))
        j += 1
    if not spans:
        edits.append((prog.end, prog.end, " " + DJANGO_OPTION))
        return inv
    ours = [s for s in spans if s[2]]
    if len(ours) == 1 and len(spans) == 1:
        inv.outcome = "already_patched"
        return inv
    if keep_explicit and not ours:
        inv.outcome = "kept_explicit"
        return inv
    keep = ours[0] if ours else spans[0]
    for span in spans:
        first, last = words[span[0]], words[span[1]]
        if span == keep:
            edits.append((first.start, last.end, DJANGO_OPTION))
        else:
            edits.append((_strip_left(text, first.start), last.end, ""))
    return inv


def _patch_nested(word: Word, keep_explicit: bool,
                  edits: list[tuple[int, int, str]]) -> PatchResult | None:
    """Patch the script of ``bash -c '...'`` when its quoting maps offsets one to one."""
    res = patch_script(word.value, keep_explicit=keep_explicit)
    if word.end - word.start != len(word.value) + 2:
        # escapes or mixed quoting: offsets would not map one to one; leave it
        if not res.invocations:
            return None
        inv = Invocation("shell -c (escaped quoting)", "unsupported_runner", word.start)
        return PatchResult(word.value, inv.outcome, [inv])
    if res.text != word.value:
        edits.append((word.start + 1, word.end - 1, res.text))
    return res


def _autoload_off(cmd: Command) -> bool:
    return any(a.value.startswith("PYTEST_DISABLE_PLUGIN_AUTOLOAD=") and a.value[31:] not in ("", "0")
               for a in cmd.assignments)


def _raw_is_parallel(word: Word) -> bool:
    return word.value == PARALLEL and word.end - word.start == len(PARALLEL)


def _strip_left(text: str, start: int) -> int:
    """Also remove the blanks before a deleted option, so no double space is left."""
    while start > 0 and text[start - 1] in " \t":
        start -= 1
    return start


def _install_edit(text: str, start: int) -> tuple[int, int, str]:
    line_start = text.rfind("\n", 0, start) + 1
    indent = text[line_start:start]
    if "\n" not in text:
        return (start, start, INSTALL_LINE + "; ")
    if indent.strip():  # the statement shares its line with others
        return (start, start, INSTALL_LINE + "; ")
    return (start, start, INSTALL_LINE + "\n" + indent)


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    out = text
    last = len(text) + 1
    for start, end, new in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        if end > last:
            raise ValueError(f"overlapping edits at offset {start}")
        out = out[:start] + new + out[end:]
        last = start
    return out
