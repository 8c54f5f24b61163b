"""Patch the test-command fields of one dataset record, in place.

Fields may sit at the top level or in nested dicts (verl keeps task fields in
``extra_info`` / ``reward_model``). Added fields never replace existing ones:

- ``<field>_unpatched``: the original value, next to the patched field, as a
  fallback for environments where the patched command cannot run;
- ``tangram_install`` (top level): ``pip install pytest-xdist``, a step the
  environment must run before the command, set when a pytest invocation got
  ``-n`` and nothing shows xdist is installed (not set with ``install_step``,
  which puts the install into the script itself).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from datasets_patch.fields import DEFAULT_FIELDS, INSTALL_FIELD, INSTALL_VALUE, UNPATCHED_SUFFIX
from datasets_patch.rewrite import INSTALL_LINE, OUTCOMES, PatchResult, patch_script

_MAX_DEPTH = 3  # record -> extra_info -> nested dict -> field


@dataclass
class FieldResult:
    path: str  # dotted, e.g. "extra_info.test_cmd"
    outcome: str
    before: Any = None
    after: Any = None
    notes: list[str] = field(default_factory=list)
    runners: list[str] = field(default_factory=list)  # unsupported runner names


@dataclass
class RecordResult:
    outcome: str
    fields: list[FieldResult] = field(default_factory=list)


def find_fields(record: dict, names: tuple[str, ...] | list[str]) -> list[tuple[str, dict, str]]:
    """(dotted path, containing dict, key) for each field named in ``names``.

    A dotted name (``extra_info.test_cmd``) is an exact path; a plain name is
    looked up at the top level and in nested dicts, shallowest first.
    """
    found: list[tuple[str, dict, str]] = []
    seen: set[str] = set()
    for name in names:
        if "." in name:
            hit = _exact(record, name)
            if hit and name not in seen:
                seen.add(name)
                found.append((name, *hit))
            continue
        for path, container in _dicts(record):
            if name in container:
                dotted = f"{path}.{name}" if path else name
                if dotted not in seen:
                    seen.add(dotted)
                    found.append((dotted, container, name))
    return found


def _exact(record: dict, dotted: str) -> tuple[dict, str] | None:
    *parents, key = dotted.split(".")
    node: Any = record
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and key in node:
        return node, key
    return None


def _dicts(record: dict):
    """The record and its nested dicts, breadth first, with their dotted paths."""
    queue: list[tuple[str, dict, int]] = [("", record, 0)]
    while queue:
        path, node, depth = queue.pop(0)
        yield path, node
        if depth >= _MAX_DEPTH:
            continue
        for key, value in node.items():
            if isinstance(value, dict):
                queue.append((f"{path}.{key}" if path else str(key), value, depth + 1))


def repo_of(record: dict) -> str:
    for _path, container in _dicts(record):
        value = container.get("repo")
        if isinstance(value, str) and value:
            return value
    return ""


def patch_record(record: dict, fields: tuple[str, ...] | list[str] = DEFAULT_FIELDS,
                 keep_explicit: bool = False, install_step: bool = False) -> RecordResult:
    results: list[FieldResult] = []
    needs_install = False
    for path, container, key in find_fields(record, fields):
        if key.endswith(UNPATCHED_SUFFIX):
            continue
        res, needs = _patch_field(path, container, key, keep_explicit, install_step)
        results.append(res)
        needs_install = needs_install or needs
    if needs_install and INSTALL_FIELD not in record:
        record[INSTALL_FIELD] = INSTALL_VALUE
    if not results:
        return RecordResult("no_test_command", [])
    outcome = min((r.outcome for r in results), key=OUTCOMES.index)
    return RecordResult(outcome, results)


def _patch_field(path: str, container: dict, key: str, keep_explicit: bool,
                 install_step: bool) -> tuple[FieldResult, bool]:
    value = container[key]
    if value is None:
        return FieldResult(path, "no_test_command", notes=[f"field {path!r} is null"]), False
    if isinstance(value, str):
        parts, is_list = [value], False
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        parts, is_list = list(value), True
    elif isinstance(value, (bytes, bytearray)) or (
            isinstance(value, (list, tuple)) and any(isinstance(v, (bytes, bytearray)) for v in value)):
        # a binary column: the rewrite works on text and does not guess an encoding
        why = f"field {path!r} holds bytes (a binary column); only text commands are patched, left as is"
        return FieldResult(path, "no_test_command", before=value, notes=[why]), False
    else:
        why = f"field {path!r} holds {type(value).__name__}, expected a string or a list of strings"
        return FieldResult(path, "no_test_command", before=value, notes=[why]), False
    results: list[PatchResult] = []
    installed = False
    for part in parts:
        try:
            res = patch_script(part, keep_explicit=keep_explicit,
                               install_step=install_step and not installed)
        except Exception as exc:  # noqa: BLE001 - one odd script must not stop a dataset
            res = PatchResult(part, "unsupported_runner",
                              notes=[f"field {path!r}: cannot patch ({type(exc).__name__}: {exc}); left as is"])
        installed = installed or (install_step and res.changed and _has_install(res, part))
        results.append(res)
    new_parts = [r.text for r in results]
    outcome = min((r.outcome for r in results), key=OUTCOMES.index) if results else "no_test_command"
    notes = [n for r in results for n in r.notes]
    runners = [i.runner for r in results for i in r.invocations if i.outcome == "unsupported_runner"]
    new_value: Any = new_parts if is_list else new_parts[0]
    if is_list and isinstance(value, tuple):
        new_value = tuple(new_parts)
    changed = new_parts != parts
    if changed:
        container[key] = new_value
        backup = key + UNPATCHED_SUFFIX
        if backup in container:
            notes.append(f"{backup!r} already present; left as it was")
        else:
            container[backup] = value
    # one install line in a list of commands serves the later ones too
    needs = not installed and any(r.needs_xdist for r in results)
    return FieldResult(path, outcome, value, new_value, notes, runners), needs


def _has_install(res: PatchResult, before: str) -> bool:
    return INSTALL_LINE in res.text and INSTALL_LINE not in before
