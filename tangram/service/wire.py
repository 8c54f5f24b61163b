"""Validation of the wire API's request bodies (no aiohttp here).

Every problem is a :class:`~tangram.core.errors.DemandError` naming the
field, which the service turns into ``400 {"error", "field"}``. What is
checked here is the *shape* of the body; the demand itself is checked by
``Action.build`` (400) and the engine's feasibility test (422).

Everything a caller sends is bounded here (:data:`LIMITS`): nesting depth,
string lengths, the number of env variables and labels. Strings must be
encodable as UTF-8 (no lone surrogates); a command, an env key or value may
not hold NUL, and an env key may not hold ``=`` (neither can reach a process).
An exec's ``stdin`` may hold NUL: it reaches the command through a pipe, not
argv or the environment, so Linux's 128 KiB per string there does not bind it either.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

from tangram.core.errors import DemandError
from tangram.executors.http import METHODS as HTTP_METHODS

KIND_FIELDS = {
    "exec": {"environment", "command", "env", "restartable", "stdin"},
    # trajectory: the rollout an http or model action belongs to (an exec action's is its environment), for
    # the order's generation credit (docs/scheduling.md)
    "http": {"url", "method", "headers", "json", "body", "trajectory"},
    "model": {"model", "op", "inputs", "tokens", "trajectory"},
}
COMMON_FIELDS = {"kind", "resources", "profile", "timeout_s", "class"}
ALL_FIELDS = COMMON_FIELDS.union(*KIND_FIELDS.values())
MODEL_OPS = ("score", "logprobs", "embed")  # what the torch executor implements

# Bounds on what one request may hold (the body itself is bounded by service.max_body_bytes)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token: what the executor can send
LIMITS = {
    "depth": 32,  # JSON nesting: a json payload or model input deeper than this is not an action
    "name": 256,  # class, profile, environment, trajectory, model, image, method, op, api
    "command": 256 * 1024,
    "env_vars": 256,
    "env_key": 256,
    "env_value": 32 * 1024,
    "stdin": 16 * 1024 * 1024,  # characters; service.max_body_bytes (1 MiB by default) is the tighter bound
    "labels": 64,
    "label_key": 128,
    "label_value": 1024,
    "url": 8192,
    "header_value": 8192,
}
RESERVED_LABEL_PREFIXES = ("tangram.", "org.arl-tangram.")  # the executors' own labels: no caller sets them


def check_tree(body: Any, root: str = "body") -> None:
    """Bounded depth and UTF-8-encodable strings everywhere in a parsed body (iterative: no recursion)."""
    stack: list[tuple[Any, str, int]] = [(body, root, 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            _utf8(v, path)
        elif isinstance(v, (dict, list)):
            if depth >= LIMITS["depth"]:
                raise DemandError(path, f"nested deeper than {LIMITS['depth']} levels")
            if isinstance(v, dict):
                for k, x in v.items():
                    _utf8(k, f"{path}.<key>")
                    stack.append((x, k if path == root else f"{path}.{k}", depth + 1))
            else:
                stack.extend((x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v))


def parse_action(body: Any) -> dict[str, Any]:
    """The keyword arguments of :meth:`Runtime.build_action` for one ``POST /v1/actions`` body."""
    if not isinstance(body, Mapping):
        raise DemandError("body", f"must be a JSON object, got {_tname(body)}")
    check_tree(body)
    kind = body.get("kind")
    if kind is None:
        raise DemandError("kind", "is required (exec, http or model)")
    if not isinstance(kind, str) or kind not in KIND_FIELDS:
        raise DemandError("kind", f"must be one of {sorted(KIND_FIELDS)}, got {kind!r}")
    for key in body:
        if key not in ALL_FIELDS:
            raise DemandError(str(key) or "<empty key>", "unknown field")
        if key not in COMMON_FIELDS and key not in KIND_FIELDS[kind]:
            raise DemandError(str(key) or "<empty key>", f"is not a field of {kind} actions")
    resources = body.get("resources", {})
    if not isinstance(resources, Mapping):
        raise DemandError("resources", f"must be an object, got {_tname(resources)}")
    demands: dict[str, Any] = {}
    for key, val in resources.items():
        if key == "cpu":
            demands[key] = _demand(val, "resources.cpu", allow_range=True)
        elif key == "gpu":
            demands[key] = _demand(val, "resources.gpu", allow_range=False)
        elif key == "api":
            demands[key] = _string(val, "resources.api", limit=LIMITS["name"])
        elif key == "mem_mb":
            demands[key] = _int(val, "resources.mem_mb", lo=0)
        else:
            raise DemandError(f"resources.{key}", "unknown resource (expected cpu, gpu, api or mem_mb)")
    out: dict[str, Any] = {"kind": kind, "resources": demands}
    if "profile" in body:
        out["profile"] = _string(body["profile"], "profile", limit=LIMITS["name"])
    if body.get("timeout_s") is not None:
        t = body["timeout_s"]
        try:
            ok = not isinstance(t, bool) and isinstance(t, (int, float)) and 0 < float(t) < math.inf
        except OverflowError:  # an integer past a float's range (JSON allows 4,300 digits)
            ok = False
        if not ok:
            raise DemandError("timeout_s", f"must be a positive finite number of seconds, got {str(t)[:40]!r}")
        out["timeout_s"] = float(t)
    if "class" in body:
        out["action_class"] = _string(body["class"], "class", limit=LIMITS["name"])
    if body.get("trajectory") is not None:
        out["trajectory"] = _string(body["trajectory"], "trajectory", limit=LIMITS["name"])
    payload: dict[str, Any] = {}
    if kind == "exec":
        if "command" not in body:
            raise DemandError("command", "is required for exec actions")
        out["command"] = _string(body["command"], "command", limit=LIMITS["command"], nul=False)
        if body.get("environment") is not None:
            out["environment"] = _string(body["environment"], "environment", limit=LIMITS["name"])
        if "env" in body:
            payload["env"] = _env(body["env"])
        if "restartable" in body:  # its run may be stopped and started again wider (a test suite)
            if not isinstance(body["restartable"], bool):
                raise DemandError("restartable", f"must be true or false, got {body['restartable']!r}")
            out["restartable"] = body["restartable"]
        if body.get("stdin") is not None:
            payload["stdin"] = _stdin(body["stdin"])
    elif kind == "http":
        if "url" not in body:
            raise DemandError("url", "is required for http actions")
        url = _string(body["url"], "url", limit=LIMITS["url"])
        if not url.startswith(("http://", "https://")):
            raise DemandError("url", f"must be an http(s) URL, got {url!r}")
        payload["url"] = url
        if "method" in body:
            payload["method"] = _string(body["method"], "method", limit=LIMITS["name"]).upper()
            if payload["method"] not in HTTP_METHODS:
                raise DemandError("method", f"must be one of {sorted(HTTP_METHODS)}, got {body['method']!r}")
        if "headers" in body:
            h = body["headers"]
            if not isinstance(h, Mapping) or not all(isinstance(v, str) for v in h.values()):
                raise DemandError("headers", "must be an object of string values")
            for k, v in h.items():
                _string(k, "headers.<key>", limit=LIMITS["name"], nul=False)
                _string(v, f"headers.{k}", limit=LIMITS["header_value"], nul=False, allow_empty=True)
                if any(c in k + v for c in "\r\n"):
                    raise DemandError(f"headers.{k}", "must not contain CR or LF")
                if not _HEADER_NAME.fullmatch(k):
                    raise DemandError(f"headers.{k}", "a header name is an RFC 9110 token (letters, digits and "
                                                      "!#$%&'*+-.^_`|~)")
            payload["headers"] = dict(h)
        if "json" in body and "body" in body:
            raise DemandError("body", "give either json or body, not both")
        if "json" in body:
            payload["json"] = body["json"]
        if "body" in body:
            payload["body"] = _string(body["body"], "body", allow_empty=True)
    else:  # model
        if "model" not in body:
            raise DemandError("model", "is required for model actions")
        payload["model"] = _string(body["model"], "model", limit=LIMITS["name"])
        payload["op"] = _string(body["op"], "op", limit=LIMITS["name"]) if "op" in body else "score"
        if payload["op"] not in MODEL_OPS:
            raise DemandError("op", f"must be one of {list(MODEL_OPS)}, got {payload['op']!r}")
        if "inputs" not in body:
            raise DemandError("inputs", "is required for model actions")
        if not isinstance(body["inputs"], list):
            raise DemandError("inputs", f"must be an array, got {_tname(body['inputs'])}")
        payload["inputs"] = body["inputs"]
        if body.get("tokens") is not None:
            tokens = body["tokens"]
            if not isinstance(tokens, list) or len(tokens) != len(body["inputs"]):
                raise DemandError("tokens", "must be an array with one token list per input")
            payload["tokens"] = tokens
    out["payload"] = payload
    return out


def parse_environment(body: Any) -> dict[str, Any]:
    """The keyword arguments of :meth:`Runtime.create_environment` for ``POST /v1/environments``."""
    if not isinstance(body, Mapping):
        raise DemandError("body", f"must be a JSON object, got {_tname(body)}")
    for key in body:
        if key not in ("image", "memory_mb", "labels", "network", "trajectory"):
            raise DemandError(str(key) or "<empty key>",
                              "unknown field (expected image, memory_mb, labels, network, trajectory)")
    check_tree(body)
    out: dict[str, Any] = {}
    if body.get("trajectory") is not None:  # the name the rollout's calls gave before it had an environment
        out["trajectory"] = _string(body["trajectory"], "trajectory", limit=LIMITS["name"])
    if body.get("image") is not None:
        out["image"] = _string(body["image"], "image", limit=LIMITS["name"], nul=False)
    if "memory_mb" in body:
        out["memory_mb"] = _int(body["memory_mb"], "memory_mb", lo=0, hi=1 << 30)
    if body.get("network") is not None:
        if not isinstance(body["network"], bool):
            raise DemandError("network", f"must be true or false, got {_tname(body['network'])}")
        if body["network"]:
            out["network"] = True
    if body.get("labels") is not None:
        labels = body["labels"]
        if not isinstance(labels, Mapping):
            raise DemandError("labels", f"must be an object, got {_tname(labels)}")
        if len(labels) > LIMITS["labels"]:
            raise DemandError("labels", f"at most {LIMITS['labels']} labels, got {len(labels)}")
        for k, v in labels.items():
            _string(k, "labels.<key>", limit=LIMITS["label_key"], nul=False)
            if k.startswith(RESERVED_LABEL_PREFIXES):
                raise DemandError(f"labels.{k}", f"the prefixes {list(RESERVED_LABEL_PREFIXES)} are reserved for the service")
            if not isinstance(v, str):
                raise DemandError(f"labels.{k}", f"must be a string, got {_tname(v)}")
            _string(v, f"labels.{k}", limit=LIMITS["label_value"], nul=False, allow_empty=True)
        out["labels"] = dict(labels)
    return out


def _env(env: Any) -> dict[str, str]:
    """Process environment variables: names without ``=`` or NUL, values without NUL, bounded."""
    if not isinstance(env, Mapping):
        raise DemandError("env", f"must be an object of string values, got {_tname(env)}")
    if len(env) > LIMITS["env_vars"]:
        raise DemandError("env", f"at most {LIMITS['env_vars']} variables, got {len(env)}")
    for k, v in env.items():
        _string(k, "env.<key>", limit=LIMITS["env_key"], nul=False)
        if "=" in k:
            raise DemandError(f"env.{k}", "a variable name must not contain '='")
        if not isinstance(v, str):
            raise DemandError(f"env.{k}", f"must be a string, got {_tname(v)}")
        _string(v, f"env.{k}", limit=LIMITS["env_value"], nul=False, allow_empty=True)
    return dict(env)


def _stdin(v: Any) -> bytearray:
    """An exec's standard input: any string (NUL included) up to its limit, as UTF-8. A bytearray, so that
    :func:`free_input` can empty it once the action ended: finished records keep their action."""
    if not isinstance(v, str):
        raise DemandError("stdin", f"must be a string, got {_tname(v)}")
    if len(v) > LIMITS["stdin"]:
        raise DemandError("stdin", f"must be at most {LIMITS['stdin']} characters, got {len(v)}")
    return bytearray(v, "utf-8")  # check_tree refused a lone surrogate already


def free_input(job: Any, outcome: Any = None) -> None:
    """A runtime listener: the stdin of an action that ended is emptied (a restart re-runs an action before
    it ends, never after); the service keeps the action with its result for ``service.keep_results``."""
    stdin = job.action.payload.get("stdin")
    if isinstance(stdin, bytearray):
        stdin.clear()


def _demand(v: Any, field: str, *, allow_range: bool) -> Any:
    """A cpu or gpu demand with whole numbers as ints (its bounds are checked by ``Action.build``)."""
    v = _whole(v)
    if isinstance(v, bool):
        raise DemandError(field, f"must be an integer{' or {min, max}' if allow_range else ' or a list'}, got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, Mapping) and allow_range:
        for k in v:
            if k not in ("min", "max"):
                raise DemandError(f"{field}.{k}", "unknown key (expected min and max)")
        if "min" not in v:
            raise DemandError(f"{field}.min", "is required in a range")
        return {k: _int(v[k], f"{field}.{k}", lo=1) for k in ("min", "max") if k in v}
    if isinstance(v, list):
        return [_int(x, f"{field}[{i}]", lo=1) for i, x in enumerate(v)]
    raise DemandError(field, f"must be an integer{', a {min, max} range' if allow_range else ''} or a list, "
                             f"got {_tname(v)}")


def _string(v: Any, field: str, *, allow_empty: bool = False, limit: int | None = None, nul: bool = True) -> str:
    if not isinstance(v, str) or (not v and not allow_empty):
        raise DemandError(field, f"must be a non-empty string, got {_tname(v) if not isinstance(v, str) else 'an empty string'}")
    if limit is not None and len(v) > limit:
        raise DemandError(field, f"must be at most {limit} characters, got {len(v)}")
    if not nul and "\0" in v:
        raise DemandError(field, "must not contain a NUL character")
    _utf8(v, field)
    return v


def _utf8(v: Any, field: str) -> None:
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise DemandError(field, "is not valid Unicode (a lone surrogate)") from None


def _whole(v: Any) -> Any:
    """``v`` as an int when it is a whole number (JSON, and JSON Schema, make no difference between 2 and
    2.0), else unchanged."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _int(v: Any, field: str, *, lo: int | None = None, hi: int | None = None) -> int:
    v = _whole(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise DemandError(field, f"must be an integer, got {_tname(v)}")
    if lo is not None and v < lo:
        raise DemandError(field, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise DemandError(field, f"must be <= {hi}, got {v}")
    return v


def _tname(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)
