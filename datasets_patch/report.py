"""What the patcher did: counts by outcome, by field, by repository, examples."""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any

from datasets_patch.jsonvalues import display_default
from datasets_patch.records import RecordResult, repo_of
from datasets_patch.rewrite import OUTCOMES

_EXAMPLE_CHARS = 300  # long eval scripts: enough to recognise them


def _short(value: Any) -> Any:
    if isinstance(value, str) and len(value) > _EXAMPLE_CHARS:
        return value[:_EXAMPLE_CHARS] + f"... [{len(value)} chars]"
    if isinstance(value, (list, tuple)):
        return [_short(v) for v in value]
    return value


class Report:
    def __init__(self, max_examples: int = 3):
        self.max_examples = max_examples
        self.records = 0
        self.outcomes: Counter[str] = Counter()
        self.fields: dict[str, Counter[str]] = defaultdict(Counter)
        self.repos: dict[str, Counter[str]] = defaultdict(Counter)
        self.runners: Counter[str] = Counter()  # unsupported runner -> field values
        self.install_added = 0
        self.examples: dict[str, list[dict]] = defaultdict(list)

    def add(self, index: int, record: dict, result: RecordResult, install_added: bool = False) -> None:
        self.records += 1
        self.outcomes[result.outcome] += 1
        repo = repo_of(record) or "(no repo)"
        self.repos[repo][result.outcome] += 1
        self.install_added += int(install_added)
        for fr in result.fields:
            self.fields[fr.path][fr.outcome] += 1
            self.runners.update(set(fr.runners))
        examples = self.examples[result.outcome]
        if len(examples) < self.max_examples:
            shown = next((f for f in result.fields if f.outcome == result.outcome), None)
            example: dict[str, Any] = {"index": index, "repo": repo}
            if shown is not None:
                example.update(field=shown.path, before=_short(shown.before),
                               after=_short(shown.after), notes=shown.notes[:5])
            examples.append(example)

    def to_dict(self) -> dict:
        return {
            "records": self.records,
            "outcomes": {o: self.outcomes.get(o, 0) for o in OUTCOMES if o in self.outcomes
                         or o != "kept_explicit"},
            "fields": {k: dict(v) for k, v in sorted(self.fields.items())},
            "repos": {k: dict(v) for k, v in sorted(self.repos.items())},
            "unsupported_runners": dict(self.runners.most_common()),
            "install_field_added": self.install_added,
            "examples": {o: self.examples[o] for o in OUTCOMES if self.examples.get(o)},
        }

    def format(self) -> str:
        d = self.to_dict()
        lines = [f"records: {d['records']}"]
        lines += [f"  {o:<20} {n}" for o, n in d["outcomes"].items()]
        if d["install_field_added"]:
            lines.append(f"records given an install step field: {d['install_field_added']}")
        if d["fields"]:
            lines.append("by field:")
            lines += [f"  {k}: {_counts(v)}" for k, v in d["fields"].items()]
        if d["repos"]:
            lines.append("by repository:")
            lines += [f"  {k}: {_counts(v)}" for k, v in d["repos"].items()]
        if d["unsupported_runners"]:
            lines.append("unsupported runners (left untouched):")
            lines += [f"  {k}: {n}" for k, n in d["unsupported_runners"].items()]
        for outcome, examples in d["examples"].items():
            lines.append(f"examples of {outcome}:")
            for ex in examples:
                where = f"#{ex['index']} {ex['repo']}"
                if "field" in ex:
                    lines.append(f"  {where} {ex['field']}: {_json(ex['before'])}")
                    if ex["after"] is not None and ex["after"] != ex["before"]:  # None: skipped
                        lines.append(f"    -> {_json(ex['after'])}")
                    elif ex["notes"] and outcome == "no_test_command":
                        lines.append(f"    ({ex['notes'][0]})")  # why it was skipped
                else:
                    lines.append(f"  {where}: no test command field")
        return "\n".join(lines)


def _json(value: Any) -> str:
    # field values from Parquet may be bytes, timestamps, ...: shown, never a crash
    return json.dumps(value, default=display_default)[:160]


def _counts(counter: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counter.items(), key=lambda kv: OUTCOMES.index(kv[0])))
