"""The sweep configuration (``tangram profile --config sweep.yaml``), checked up front.

Every key is described in :mod:`profiling.pipeline`'s docstring. A mistake
(a wrong type, an unknown key, a typo, a duplicate class) is a ``ValueError``
naming the key and the reason before anything runs: a sweep can take hours,
and failing in the middle of it, or silently ignoring a misspelt key, wastes
them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from profiling.fit import DEFAULT_MAX_CV_ERROR
from profiling.sweep import ClassSpec

TOP_KEYS = ("out", "executor", "max_cv_error", "defaults", "classes")
SPEC_KEYS = ("command", "workdir", "image", "dops", "repeats", "warmups", "timeout_s", "env")
EXECUTOR_KINDS = ("auto", "local", "docker", "subprocess")


@dataclass(slots=True)
class SweepConfig:
    classes: list[ClassSpec]
    out: str | None = None
    executor: str = "auto"
    max_cv_error: float = DEFAULT_MAX_CV_ERROR
    extra: dict[str, Any] = field(default_factory=dict)


def parse_config(doc: Any, *, source: str = "config") -> SweepConfig:
    if not isinstance(doc, Mapping):
        raise ValueError(f"{source}: expected a mapping at the top level, got {_kind(doc)}")
    _reject_unknown(doc, TOP_KEYS, source)
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise ValueError(f"{source}: defaults: must be a mapping of class keys, got {_kind(defaults)}")
    _reject_unknown(defaults, SPEC_KEYS, f"{source}: defaults")
    defaults = check_fields(defaults, f"{source}: defaults")
    specs = []
    for name, body, where in _class_items(doc.get("classes"), source):
        if isinstance(body, str):
            body = {"command": body}
        if not isinstance(body, Mapping):
            raise ValueError(f"{where}: must be a mapping of class keys or a command string, got {_kind(body)}")
        _reject_unknown(body, SPEC_KEYS, where)
        merged = {**defaults, **check_fields(body, where)}
        if "command" not in merged:
            raise ValueError(f"{where}: command: is required")
        try:
            specs.append(ClassSpec(name=name, **merged))
        except ValueError as exc:  # the workdir is missing, ...
            raise ValueError(f"{where}: {exc}") from None
    out = doc.get("out")
    if out is not None and (not isinstance(out, str) or not out):
        raise ValueError(f"{source}: out: must be a file name, got {out!r}")
    executor = doc.get("executor", "auto")
    if executor not in EXECUTOR_KINDS:
        raise ValueError(f"{source}: executor: must be one of {', '.join(EXECUTOR_KINDS)}, got {executor!r}")
    max_cv = _positive_number(doc.get("max_cv_error", DEFAULT_MAX_CV_ERROR), f"{source}: max_cv_error")
    return SweepConfig(classes=specs, out=out, executor=executor, max_cv_error=max_cv)


def load_config(path: str) -> SweepConfig:
    """Read and check a YAML config; bad YAML is a ``ValueError`` like any other mistake."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.load(f, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text: {exc}") from None
    return parse_config(doc, source=path)


def check_fields(body: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The class keys present in ``body``, type-checked (``env`` values as strings)."""
    out = dict(body)
    for key in ("command", "workdir", "image"):
        v = body.get(key)
        if key in body and v is not None and (not isinstance(v, str) or not v.strip()):
            raise ValueError(f"{where}: {key}: must be a non-empty string, got {v!r}")
    if body.get("command", "") is None:
        raise ValueError(f"{where}: command: must be a non-empty string, got None")
    dops = body.get("dops")
    if dops is not None and (not isinstance(dops, list) or not dops or not all(_int_at_least(d, 1) for d in dops)):
        raise ValueError(f"{where}: dops: must be a non-empty list of positive integers, got {dops!r}")
    for key, low in (("repeats", 1), ("warmups", 0)):
        if key in body and not _int_at_least(body[key], low):
            raise ValueError(f"{where}: {key}: must be an integer >= {low}, got {body[key]!r}")
    if body.get("timeout_s") is not None:
        out["timeout_s"] = _positive_number(body["timeout_s"], f"{where}: timeout_s")
    if "env" in body:
        out["env"] = _env(body["env"], f"{where}: env")
    return out


def _class_items(raw: Any, source: str) -> list[tuple[str, Any, str]]:
    """(name, body, where) per class; names are unique."""
    if isinstance(raw, Mapping):
        items = [(str(k), v if v is not None else {}, f"{source}: classes.{k}") for k, v in raw.items()]
    elif isinstance(raw, list):
        items = []
        for i, v in enumerate(raw):
            if not isinstance(v, Mapping) or not isinstance(v.get("name"), (str, int)) or v.get("name") == "":
                raise ValueError(f"{source}: classes[{i}]: needs a 'name' (a non-empty string)")
            items.append((str(v["name"]), {k: x for k, x in v.items() if k != "name"}, f"{source}: classes[{i}]"))
    else:
        raise ValueError(f"{source}: classes: must be a mapping or a list, got {_kind(raw)}")
    if not items:
        raise ValueError(f"{source}: classes: no classes to profile")
    seen: dict[str, str] = {}
    for name, _, where in items:
        if name in seen:  # the later one would silently replace the earlier one's profile
            raise ValueError(f"{where}: duplicate class name {name!r} (also {seen[name]})")
        seen[name] = where
    return items


def _reject_unknown(body: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in body if k not in known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (known: {', '.join(known)})")


def _int_at_least(v: Any, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _positive_number(v: Any, where: str) -> float:
    """A finite number > 0; a numeric string too (YAML reads ``1e9`` as a string)."""
    x = None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        x = float(v)
    elif isinstance(v, str):
        try:
            x = float(v)
        except ValueError:
            pass
    if x is None or not math.isfinite(x) or x <= 0:
        raise ValueError(f"{where}: must be a positive number, got {v!r}")
    return x


def _env(env: Any, where: str) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ValueError(f"{where}: must be a mapping of variable names to values, got {_kind(env)}")
    out = {}
    for k, v in env.items():
        if not isinstance(k, str) or not k or "=" in k:
            raise ValueError(f"{where}: {k!r}: not a valid variable name")
        if not isinstance(v, (str, int, float, bool)):
            raise ValueError(f"{where}.{k}: must be a string or a number, got {_kind(v)}")
        out[k] = str(v)
    return out


def _kind(v: Any) -> str:
    return "nothing" if v is None else type(v).__name__


def _unique_key_loader():
    """A SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                            key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader
