"""Which test runner a simple command starts, looking through wrappers.

``timeout 300 env X=1 python -W ignore -m pytest -rA`` is a pytest run whose
program word is ``pytest``: options go right after that word.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from datasets_patch.shell import Word

PYTEST_NAMES = {"pytest", "py.test", "pytest-3", "pytest3"}
_PYTHON = re.compile(r"^(python|pypy)[0-9.]*$")
# python options that take the next word as their value
_PYTHON_VALUE_OPTS = {"-W", "-X", "-Q", "--check-hash-based-pycs"}

# programs that prepare or inspect, never run a test suite
SETUP_PROGRAMS = {
    "cd", "pushd", "popd", "source", ".", "set", "export", "unset", "shopt", "trap",
    "ulimit", "umask", "alias", "echo", "printf", "cat", "sed", "awk", "grep", "head",
    "tail", "tee", "jq", "sort", "uniq", "wc", "cut", "tr", "true", "false", ":", "exit",
    "return", "sleep", "wait", "test", "[", "mkdir", "rm", "rmdir", "cp", "mv", "ln",
    "chmod", "chown", "touch", "ls", "find", "tar", "unzip", "gzip", "wget", "curl", "git",
    "pip", "pip3", "conda", "mamba", "micromamba", "apt-get", "apt", "yum", "apk", "brew",
    "which", "type", "hash", "read", "local", "declare", "readonly", "shift", "let", "date",
    "whoami", "id", "pwd", "basename", "dirname", "realpath", "diff", "patch", "locale",
    "update-locale", "useradd", "su", "sudo", "ldconfig", "eval", "exec", "xargs", "env",
}
# programs that are test runners whatever their arguments
KNOWN_RUNNERS = {
    "tox", "nox", "jest", "mocha", "karma", "vitest", "rspec", "phpunit", "ctest", "qunit",
    "jasmine", "cucumber", "ava", "nosetests", "nose2", "trial", "behave", "runtest",
}
# tools whose first argument says what they do (``go test``, ``npm install``)
_SUBCOMMAND_TOOLS = {"go", "cargo", "npm", "pnpm", "yarn", "npx", "bundle", "mvn", "mvnd",
                     "make", "dotnet", "gradle", "gradlew", "mvnw", "composer"}
_RUN_WRAPPERS = {"poetry", "uv", "pipenv", "pdm", "hatch", "rye"}
_TEST_WORDS = ("test", "check", "spec")
_SHELLS = {"bash", "sh", "zsh", "dash", "ksh"}
_SHELL_C = re.compile(r"^-[a-z]*c$")  # -c, -lc, -ec: the next word is a script


@dataclass
class Runner:
    kind: str  # "pytest", "django", "pip", "setup", "other", "nested" (bash -c SCRIPT)
    name: str  # for reports: "pytest", "tox", "go test", ...
    program: int  # index of the word after which runner options go
    module: str = ""  # for python -m / pip: what is run


def resolve(words: list[Word]) -> Runner:
    """Classify a command's words (assignments already removed)."""
    i = 0
    while i < len(words):
        base = os.path.basename(words[i].value)
        nxt = words[i + 1].value if i + 1 < len(words) else ""
        if base == "timeout":
            i = _skip_options(words, i + 1, {"-s", "--signal", "-k", "--kill-after"}) + 1
        elif base == "env":
            i = _skip_env(words, i + 1)
        elif base in ("nice", "stdbuf", "nohup", "command", "time", "xvfb-run", "catchsegv"):
            i = _skip_options(words, i + 1, {"-n", "--adjustment", "-s", "--server-args", "-e",
                                             "-f", "-p", "-w", "-l", "-i", "-o"})
        elif base in _RUN_WRAPPERS and nxt == "run":
            i = _skip_options(words, i + 2, {"--with", "-p", "--python", "--env-file", "-e",
                                             "--package", "--extra", "--group"})
        elif base == "sudo":
            i = _skip_options(words, i + 1, {"-u", "--user", "-g", "--group", "-C", "-D", "-h",
                                             "-p", "-r", "-t", "-U"})
        elif base in _SHELLS or base == "su":
            return _resolve_shell(words, i)
        elif base == "conda" and nxt == "run":
            i = _skip_options(words, i + 2, {"-n", "--name", "-p", "--prefix"})
        elif _PYTHON.match(base):
            return _resolve_python(words, i)
        elif base == "coverage" and nxt == "run":
            return _resolve_coverage(words, i + 2)
        elif base in PYTEST_NAMES:
            return Runner("pytest", "pytest", i)
        else:
            return _classify_program(words, i)
    return Runner("setup", "", -1)


def _skip_options(words: list[Word], i: int, value_opts: set[str]) -> int:
    while i < len(words) and words[i].value.startswith("-"):
        i += 2 if words[i].value in value_opts else 1
    return i


def _resolve_shell(words: list[Word], i: int) -> Runner:
    """``bash -c SCRIPT`` / ``su user -c SCRIPT``: the script is a nested command."""
    base = os.path.basename(words[i].value)
    for j in range(i + 1, len(words)):
        value = words[j].value
        if _SHELL_C.match(value) or value == "--command":
            return Runner("nested", base, j + 1) if j + 1 < len(words) else Runner("setup", base, i)
        if base in _SHELLS and not value.startswith("-"):
            return _classify_program(words, j)  # bash run_tests.sh
    return Runner("setup", base, i)


def _skip_env(words: list[Word], i: int) -> int:
    while i < len(words):
        value = words[i].value
        if value in ("-u", "--unset", "-C", "--chdir"):
            i += 2
        elif value.startswith("-") or ("=" in value and value.split("=", 1)[0].isidentifier()):
            i += 1
        else:
            break
    return i


def _resolve_python(words: list[Word], i: int) -> Runner:
    j = i + 1
    while j < len(words):
        value = words[j].value
        if value == "-m" and j + 1 < len(words):
            return _module_runner(words, j + 1, words[j + 1].value)
        if value.startswith("-m") and len(value) > 2:
            return _module_runner(words, j, value[2:])
        if value == "-c":
            return Runner("other", "python -c", i)
        if value in _PYTHON_VALUE_OPTS:
            j += 2
        elif value.startswith("-"):
            j += 1
        else:
            return _classify_program(words, j)  # a script: python tests/runtests.py
    return Runner("other", "python", i)


def _module_runner(words: list[Word], j: int, module: str) -> Runner:
    if module in ("pytest", "py.test"):
        return Runner("pytest", "pytest", j, module)
    if module == "pip":
        return Runner("pip", "pip", j, module)
    if module == "coverage" and j + 1 < len(words) and words[j + 1].value == "run":
        return _resolve_coverage(words, j + 2)
    if any(t in module for t in _TEST_WORDS) or module in ("unittest", "nose", "tox", "nox"):
        return Runner("other", f"python -m {module}", j, module)
    return Runner("setup", f"python -m {module}", j, module)


def _resolve_coverage(words: list[Word], j: int) -> Runner:
    while j < len(words):
        value = words[j].value
        if value == "-m" and j + 1 < len(words):
            return _module_runner(words, j + 1, words[j + 1].value)
        if value in ("--rcfile", "--source", "--include", "--omit", "--context", "--data-file"):
            j += 2
        elif value.startswith("-"):
            j += 1
        else:
            return _classify_program(words, j)
    return Runner("other", "coverage run", j)


def _classify_program(words: list[Word], i: int) -> Runner:
    value = words[i].value
    base = os.path.basename(value)
    if base == "runtests.py" and os.path.basename(os.path.dirname(value)) == "tests":
        return Runner("django", "django runtests.py", i)
    if base in PYTEST_NAMES:
        return Runner("pytest", "pytest", i)
    if base in ("pip", "pip3"):
        return Runner("pip", "pip", i)
    if base in KNOWN_RUNNERS or value in ("bin/test", "./bin/test"):
        return Runner("other", value if "/" in value else base, i)
    # bundle exec rspec, yarn jest, npx karma: the runner is a few words in
    for w in words[i + 1:i + 3]:
        if os.path.basename(w.value) in KNOWN_RUNNERS:
            return Runner("other", f"{base} {w.value}", i)
    if base in SETUP_PROGRAMS and "/" not in value:  # a path is a script, not the builtin
        return Runner("setup", base, i)
    name = base
    if base in _SUBCOMMAND_TOOLS and i + 1 < len(words):
        name = f"{base} {words[i + 1].value}"
    rest = " ".join(w.value for w in words[i:]).lower()
    if any(t in rest for t in _TEST_WORDS):
        return Runner("other", name, i)
    return Runner("setup", name, i)
