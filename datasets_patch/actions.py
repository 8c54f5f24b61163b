"""Build an elastic reward action from a (patched) record.

The result is a plain dict in the wire format of the scheduler service
(``POST /v1/actions``): the scheduler picks a core count in [min, max] at run
time and substitutes it for ``${parallel_num}`` in the command.
"""
from __future__ import annotations

import os

from datasets_patch.fields import DEFAULT_FIELDS
from datasets_patch.records import find_fields, repo_of
from datasets_patch.rewrite import PARALLEL, patch_script
from datasets_patch.runners import resolve
from datasets_patch.shell import parse_script

DEFAULT_MAX_CPU = 8


def reward_action_spec(record: dict, field: str | None = None, min_cpu: int = 1,
                       max_cpu: int | None = None) -> dict:
    """``{"kind": "exec", "command", "resources": {"cpu": {"min", "max"}}, "profile"}``.

    ``field`` names the command field (dotted paths allowed); by default the
    first of ``DEFAULT_FIELDS`` the record has. A record that was not patched
    is patched here (idempotent). A command that cannot use more cores gets
    ``max == min``, so the scheduler does not reserve cores it cannot use.
    """
    if max_cpu is None:
        max_cpu = max(min_cpu, min(DEFAULT_MAX_CPU, os.cpu_count() or 1))
    if not isinstance(min_cpu, int) or min_cpu < 1:
        raise ValueError(f"min_cpu: must be an integer >= 1, got {min_cpu!r}")
    if not isinstance(max_cpu, int) or max_cpu < min_cpu:
        raise ValueError(f"max_cpu: must be an integer >= min_cpu ({min_cpu}), got {max_cpu!r}")
    names = [field] if field else list(DEFAULT_FIELDS)
    hits = [h for h in find_fields(record, names) if h[1][h[2]] is not None]
    if not hits:
        raise ValueError(f"record has no test command field {' / '.join(names)}")
    path, container, key = hits[0]
    value = container[key]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = "\n".join(value)  # as SWE-bench joins its list of test commands
    if not isinstance(value, str):
        raise ValueError(f"field {path!r} holds {type(value).__name__}, expected a command string")
    command = patch_script(value).text
    elastic = PARALLEL in command
    return {
        "kind": "exec",
        "command": command,
        "resources": {"cpu": {"min": min_cpu, "max": max_cpu if elastic else min_cpu}},
        "profile": f"{_runner_class(command)}:{repo_of(record) or 'unknown'}",
    }


def _runner_class(command: str) -> str:
    """The first test runner of the command: pytest, django, or the runner's name."""
    for cmd in parse_script(command).commands:
        if not cmd.words:
            continue
        runner = resolve(cmd.words)
        if runner.kind == "pytest":
            return "pytest"
        if runner.kind == "django":
            return "django"
        if runner.kind == "other":
            return runner.name.split()[0]
    return "shell"
