"""SandboxFusion's ``run_code`` protocol, pure: request validation, languages, response mapping.

No aiohttp and no I/O here (the endpoint is :mod:`tangram.service.sandbox_fusion`,
the program run inside the action is :mod:`tangram.service.sandbox_runner`).

Request (SandboxFusion's ``RunCodeRequest``): ``code`` and ``language`` required;
``compile_timeout`` and ``run_timeout`` (seconds, default 10), ``memory_limit_MB``
(default -1: no limit), ``stdin`` (string or null), ``files`` (path -> base64 or
null), ``fetch_files`` (paths), ``args`` (accepted, unused: pytest's extra arguments).
Response (``RunCodeResponse``): ``status`` ``Success`` | ``Failed`` | ``SandboxError``,
``message``, ``compile_result`` / ``run_result`` (``CommandRunResult``: ``status``
``Finished`` | ``Error`` | ``TimeLimitExceeded``, ``execution_time``,
``return_code``, ``stdout``, ``stderr``), ``executor_pod_name``, ``files``.
A malformed request is 422 with FastAPI's ``detail`` list (as SandboxFusion
answers it) plus this service's ``error`` and ``field``.
"""
from __future__ import annotations

import base64
import binascii
import math
import os
import posixpath
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tangram.core.errors import ConfigError, DemandError, FieldError
from tangram.core.fields import Fields
from tangram.service.tokens import token_path

SUCCESS, FAILED, SANDBOX_ERROR = "Success", "Failed", "SandboxError"
FINISHED, ERROR, TLE = "Finished", "Error", "TimeLimitExceeded"
# every language SandboxFusion's API names; those without a toolchain here get a clear 422
SANDBOX_FUSION_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql", "rust",
    "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest",
    "verilog", "python_gpu", "lean", "swift", "racket",
)
KEY_CHARS = re.compile(r"^[A-Za-z0-9._~-]{16,256}$")  # URL-safe without escaping; long enough to be a secret
MAX_TIMEOUT_S = 3600.0  # one action's own bound; SandboxFusion has none, an hour is beyond any test case


@dataclass(frozen=True, slots=True)
class Language:
    """How one language is built and run: argv templates with ``{source}``, and the toolchain paths.

    ``paths`` are what the sandbox must expose read-only for the toolchain to run
    (its binaries, libraries, headers); ``tool`` is the executable checked at start.
    """

    name: str
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    paths: tuple[str, ...] = ()

    @property
    def tool(self) -> str:
        return (self.compile or self.run)[0]


def default_languages() -> dict[str, Language]:
    """python (the service's interpreter), cpp (g++, C++17, as SandboxFusion) and bash."""
    py = os.path.realpath(sys.executable)
    py_prefix = os.path.realpath(sys.base_prefix)
    return {
        "python": Language("python", "main.py", (py, "{source}"), paths=(py_prefix,)),
        # SandboxFusion's flags: no optimisation (a borderline solution times out there as here)
        "cpp": Language("cpp", "main.cpp", ("./main",), compile=("g++", "-std=c++17", "{source}", "-o", "main",
                                                                 "-lpthread"), paths=("/usr",)),
        "bash": Language("bash", "main.sh", ("bash", "{source}"), paths=("/usr", "/bin")),
    }


def parse_languages(raw: Any, where: str) -> dict[str, Language]:
    """``{name: {source, run, compile?, paths?}}`` from the config, validated; raises FieldError."""
    if not isinstance(raw, Mapping):
        raise FieldError(where, f"must be a mapping of language name to toolchain, got {type(raw).__name__}")
    out: dict[str, Language] = {}
    for name, spec in raw.items():
        w = f"{where}.{name}"
        if not isinstance(spec, Mapping):
            raise FieldError(w, "must be a mapping with source, run, compile?, paths?")
        unknown = set(spec) - {"source", "run", "compile", "paths"}
        if unknown:
            raise FieldError(f"{w}.{sorted(unknown)[0]}", "unknown field (expected source, run, compile, paths)")
        source = spec.get("source")
        if not isinstance(source, str) or not _relative(source):
            raise FieldError(f"{w}.source", "must be a relative file name such as main.py")
        argv = {}
        for key in ("run", "compile"):
            v = spec.get(key)
            if v is None and key == "compile":
                continue
            if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
                raise FieldError(f"{w}.{key}", "must be a non-empty list of strings (an argv; {source} is the file)")
            argv[key] = tuple(v)
        paths = spec.get("paths", [])
        if not isinstance(paths, list) or not all(isinstance(p, str) and os.path.isabs(p) for p in paths):
            raise FieldError(f"{w}.paths", "must be a list of absolute paths")
        out[str(name)] = Language(str(name), source, argv["run"], argv.get("compile"), tuple(paths))
    return out


def missing_tool(lang: Language) -> str | None:
    """Why ``lang`` cannot run on this machine (its tool is not found), None when it can."""
    tool = lang.tool
    if tool.startswith("./"):
        return None
    found = shutil.which(tool) if not os.path.isabs(tool) else (tool if os.access(tool, os.X_OK) else None)
    return None if found else f"{tool} is not found on this machine"


@dataclass(frozen=True, slots=True)
class SandboxFusionConfig:
    """The ``sandbox_fusion`` section of the cluster config."""

    key: str | None = None
    cpu: int = 1
    max_body_bytes: int = 64 << 20  # code + stdin + files; SandboxFusion test inputs reach tens of MiB
    max_output_bytes: int = 1 << 20  # per stream, as SandboxFusion captures
    languages: Mapping[str, Language] = field(default_factory=default_languages)
    runner_python: str = field(default_factory=lambda: os.path.realpath(sys.executable))


def toolchain_paths(cfg: SandboxFusionConfig) -> tuple[str, ...]:
    """What a sandbox must expose read-only for the configured languages and the runner's interpreter."""
    paths = [os.path.dirname(cfg.runner_python), os.path.realpath(sys.base_prefix)]
    for lang in cfg.languages.values():
        paths.extend(lang.paths)
    return tuple(dict.fromkeys(os.path.realpath(p) for p in paths))


def check_key(key: str, where: str) -> str:
    """A sandbox key: URL-safe and long enough; raises FieldError naming ``where``."""
    if not KEY_CHARS.match(key):
        raise FieldError(where, "a sandbox key is 16-256 characters of [A-Za-z0-9._~-] (it is a URL path segment)")
    return key


def read_key_file(path: str, where: str) -> str:
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise FieldError(where, f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise FieldError(where, f"{path} is not UTF-8 text") from None
    return check_key(key, where)


@dataclass(frozen=True, slots=True)
class RunCodeRequest:
    code: str
    language: str
    compile_timeout: float = 10.0
    run_timeout: float = 10.0
    memory_limit_mb: int = -1
    stdin: str | None = None
    files: Mapping[str, str | None] = field(default_factory=dict)
    fetch_files: tuple[str, ...] = ()


def parse_run_code(body: Any, languages: Mapping[str, Language]) -> RunCodeRequest:
    """Validate a ``run_code`` body; raises DemandError naming the field."""
    if not isinstance(body, Mapping):
        raise DemandError("body", f"must be a JSON object, got {_tname(body)}")
    # a field SandboxFusion does not know is ignored, as its request model ignores it (a newer client's)
    if "code" not in body:
        raise DemandError("code", "is required")
    code = _text(body["code"], "code")
    if "language" not in body:
        raise DemandError("language", "is required")
    language = body["language"]
    if not isinstance(language, str):
        raise DemandError("language", f"must be a string, got {_tname(language)}")
    if language not in languages:
        known = ", ".join(sorted(languages)) or "none"
        if language in SANDBOX_FUSION_LANGUAGES:
            raise DemandError("language", f"{language!r} has no toolchain on this service (available: {known})")
        raise DemandError("language", f"unknown language {language!r} (available: {known})")
    out: dict[str, Any] = {"code": code, "language": language}
    for key in ("compile_timeout", "run_timeout"):
        if body.get(key) is not None:
            t = body[key]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= MAX_TIMEOUT_S:
                raise DemandError(key, f"must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {t!r}")
            out[key] = float(t)
    if body.get("memory_limit_MB") is not None:
        m = body["memory_limit_MB"]
        if isinstance(m, bool) or not isinstance(m, int):
            if isinstance(m, float) and m.is_integer():
                m = int(m)
            else:
                raise DemandError("memory_limit_MB", f"must be an integer (MiB; -1 for none), got {m!r}")
        out["memory_limit_mb"] = m if m > 0 else -1  # SandboxFusion: 0 or below is no limit
    if body.get("stdin") is not None:
        out["stdin"] = _text(body["stdin"], "stdin")
    files = body.get("files") or {}
    if not isinstance(files, Mapping):
        raise DemandError("files", f"must be an object of path -> base64 content, got {_tname(files)}")
    for path, content in files.items():
        if not _relative(path):
            raise DemandError(f"files.{path}", "must be a relative path inside the working directory")
        if content is None:
            continue
        if not isinstance(content, str):
            raise DemandError(f"files.{path}", f"must be base64 text or null, got {_tname(content)}")
        try:
            base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise DemandError(f"files.{path}", "is not valid base64") from None
    out["files"] = dict(files)
    fetch = body.get("fetch_files") or []
    if not isinstance(fetch, list) or not all(isinstance(p, str) for p in fetch):
        raise DemandError("fetch_files", "must be an array of relative paths")
    for i, path in enumerate(fetch):
        if not _relative(path):
            raise DemandError(f"fetch_files[{i}]", f"{path!r} must be a relative path inside the working directory")
    out["fetch_files"] = tuple(fetch)
    args = body.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise DemandError("args", "must be an array of strings")
    return RunCodeRequest(**out)


def encode_request(req: RunCodeRequest, lang: Language, *, max_output_bytes: int, nonce: str) -> bytearray:
    """What :mod:`tangram.service.sandbox_runner` reads on its stdin: records ``kind n len1..lenn
    fields..\\n`` each followed by its n payloads (files decoded here, so the runner needs no base64).
    ``nonce``: a secret the runner's closing record repeats (:func:`decode_report`)."""
    fill = lambda argv: "\0".join(a.replace("{source}", lang.source) for a in argv).encode()  # noqa: E731
    buf = bytearray()

    def record(kind: str, payloads: tuple[bytes, ...] = (), fields: tuple[Any, ...] = ()) -> None:
        head = [kind, str(len(payloads)), *(str(len(p)) for p in payloads), *(str(f) for f in fields)]
        buf.extend(" ".join(head).encode() + b"\n")
        for p in payloads:
            buf.extend(p)

    record("limits", fields=(repr(req.compile_timeout), repr(req.run_timeout), max(req.memory_limit_mb, 0),
                             max_output_bytes, nonce))
    for path, content in req.files.items():
        if content is not None:
            record("file", (path.encode(), base64.b64decode(content)))
    record("source", (lang.source.encode(), req.code.encode()))
    if lang.compile:
        record("compile", (fill(lang.compile),))
    record("run", (fill(lang.run),))
    if req.stdin is not None:
        record("stdin", (req.stdin.encode(),))
    if req.fetch_files:
        record("fetch", ("\0".join(req.fetch_files).encode(),))
    return buf


def decode_report(text: str, nonce: str) -> dict[str, Any] | None:
    """The runner's report as SandboxFusion's CodeRunResult (``compile_result``, ``run_result``,
    ``files``); None when it is cut short, malformed, or not the runner's own: its closing record must
    carry ``nonce`` (which the program never sees) and end the output. A program that wrote a report of
    its own into the runner's output (through ``/proc/<runner>/fd/1``, which the runner also closes
    to it) gets a SandboxError, not the result it wrote."""
    data = text.encode("utf-8", "surrogateescape")
    report: dict[str, Any] = {"compile_result": None, "run_result": None, "files": {}}
    i = 0
    try:
        while i < len(data):
            nl = data.index(b"\n", i)
            head = data[i:nl].decode().split(" ")
            i = nl + 1
            kind, n = head[0], int(head[1])
            lens = [int(x) for x in head[2:2 + n]]
            payloads = []
            for ln in lens:
                if i + ln > len(data):
                    return None
                payloads.append(data[i:i + ln])
                i += ln
            fields = head[2 + n:]
            if kind in ("compile", "run"):
                status, rc, seconds = fields
                report[f"{kind}_result"] = {
                    "status": status, "execution_time": float(seconds), "return_code": None if rc == "-" else int(rc),
                    "stdout": payloads[0].decode("utf-8", "replace"), "stderr": payloads[1].decode("utf-8", "replace")}
            elif kind == "file":
                report["files"][payloads[0].decode("utf-8", "replace")] = payloads[1].decode("ascii")
            elif kind == "done":
                return report if fields == [nonce] and not data[i:].strip() else None
    except (ValueError, IndexError, UnicodeDecodeError):
        return None
    return None  # no closing record: the output was cut short


def run_status(compile_result: Mapping[str, Any] | None, run_result: Mapping[str, Any] | None) -> tuple[str, str]:
    """SandboxFusion's rule: an ``Error`` step is SandboxError (its stderr the message); a
    time-out or a non-zero return code is Failed; else Success."""
    steps = [r for r in (compile_result, run_result) if r is not None]
    for r in steps:
        if r.get("status") == ERROR:
            return SANDBOX_ERROR, r.get("stderr") or ""
    if any(r.get("status") == TLE for r in steps):
        return FAILED, ""
    if any(r.get("return_code") not in (None, 0) for r in steps):
        return FAILED, ""
    return SUCCESS, ""


def response_from_report(report: Any) -> dict[str, Any]:
    """The ``RunCodeResponse`` of the runner's report (a SandboxError when it is not one)."""
    if not isinstance(report, Mapping):
        return sandbox_error("the sandbox runner gave no report")
    compile_result = _command_result(report.get("compile_result"))
    run_result = _command_result(report.get("run_result"))
    if compile_result is False or run_result is False:
        return sandbox_error("the sandbox runner's report is malformed")
    files = report.get("files") or {}
    if not isinstance(files, Mapping):
        return sandbox_error("the sandbox runner's report is malformed")
    status, message = run_status(compile_result, run_result)
    return {"status": status, "message": message, "compile_result": compile_result, "run_result": run_result,
            "executor_pod_name": None, "files": dict(files)}


def sandbox_error(message: str) -> dict[str, Any]:
    return {"status": SANDBOX_ERROR, "message": message, "compile_result": None, "run_result": None,
            "executor_pod_name": None, "files": {}}


def validation_error(field: str, reason: str) -> dict[str, Any]:
    """A 422 body: FastAPI's ``detail`` (what SandboxFusion's clients parse) and this service's own fields."""
    loc: list[Any] = ["body"] + [p for p in field.split(".", 1) if p] if field != "body" else ["body"]
    return {"detail": [{"type": "value_error", "loc": loc, "msg": reason}], "error": reason, "field": field}


def _command_result(r: Any) -> dict[str, Any] | None | bool:
    if r is None:
        return None
    if not isinstance(r, Mapping) or r.get("status") not in (FINISHED, ERROR, TLE):
        return False
    t = r.get("execution_time")
    return {"status": r["status"],
            "execution_time": float(t) if isinstance(t, (int, float)) and math.isfinite(t) else None,
            "return_code": r.get("return_code") if isinstance(r.get("return_code"), int) else None,
            "stdout": r.get("stdout") if isinstance(r.get("stdout"), str) else None,
            "stderr": r.get("stderr") if isinstance(r.get("stderr"), str) else None}


def _relative(path: Any) -> bool:
    if not isinstance(path, str) or not path or "\0" in path or path.startswith("/"):
        return False
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    norm = posixpath.normpath(path)
    return norm not in (".", "..") and not norm.startswith("../")


def _text(v: Any, field: str) -> str:
    if not isinstance(v, str):
        raise DemandError(field, f"must be a string, got {_tname(v)}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise DemandError(field, "is not valid Unicode (a lone surrogate)") from None
    return v


def _tname(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


# ---------------------------------------------------------------------------- #
# the sandbox_fusion: section of the cluster config

_F = Fields(ConfigError)


def parse_sandbox_fusion(raw: Any, where: str, base_dir: str | Path | None = None) -> SandboxFusionConfig:
    """The SandboxFusion-compatible endpoint: its key, demand, limits and language toolchains."""
    m = _F.mapping(raw, where)
    _F.known(m, where, {"key", "key_file", "cpu", "max_body_bytes", "max_output_bytes", "languages", "runner_python"})
    kw: dict[str, Any] = {}
    try:
        if m.get("key") is not None and m.get("key_file") is not None:
            raise ConfigError(f"{where}.key_file", "give either key or key_file")
        if m.get("key") is not None:
            kw["key"] = check_key(_F.string(m["key"], f"{where}.key"), f"{where}.key")
        if m.get("key_file") is not None:
            kw["key"] = read_key_file(token_path(_F.string(m["key_file"], f"{where}.key_file"), base_dir),
                                      f"{where}.key_file")
        if "languages" in m:
            kw["languages"] = parse_languages(m["languages"], f"{where}.languages")
    except ConfigError:
        raise
    except FieldError as exc:
        raise ConfigError(exc.field, exc.reason) from None
    if "cpu" in m:
        kw["cpu"] = _F.integer(m["cpu"], f"{where}.cpu", lo=1)
    if "max_body_bytes" in m:
        kw["max_body_bytes"] = _F.integer(m["max_body_bytes"], f"{where}.max_body_bytes", lo=1024)
    if "max_output_bytes" in m:
        kw["max_output_bytes"] = _F.integer(m["max_output_bytes"], f"{where}.max_output_bytes", lo=1024)
    if "runner_python" in m:
        py = _F.string(m["runner_python"], f"{where}.runner_python")
        if not os.path.isabs(py):
            raise ConfigError(f"{where}.runner_python", f"must be an absolute path, got {py!r}")
        kw["runner_python"] = py
    return SandboxFusionConfig(**kw)
