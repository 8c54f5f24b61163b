"""Schemathesis hooks for ``scripts/fuzz_api.py`` (a module it loads, not a script): what JSON Schema
cannot say about the wire API.

Only schema-valid (positive) bodies are touched, and only to make them valid for the service too; every
negative body goes out as generated. Schemathesis revalidates a changed body against the spec.

* ``POST /sandbox/{key}/run_code``: ``language`` names a language this service runs (configurable, so the
  spec says ``string``); a random name is refused (422, field ``language``) before anything runs, so a
  positive body gets one of the embedded default config's languages, picked from the generated name.
* ``DELETE /v1/actions/{id}`` cancels an action; its final result stays readable (as documented), so a
  200 from ``GET /v1/actions/{id}`` after it is no use-after-free. Only that pairing is dropped; a
  deleted environment must still be gone.
* ``POST /v1/actions``: ``profile`` names a profile of the service's store (400 otherwise); the embedded
  default config has none, so a positive body goes without one. An http action may leave out its API pool
  only when the service has exactly one (the default config has none): a positive body names one. A
  model action's ``tokens`` holds one list per input (equal lengths); a cpu range's ``max`` is at least
  its ``min``; at most one of cpu and gpu offers several options; an http or model action that names a
  ``trajectory`` holds no cpu or mem_mb (the engine would keep them with the trajectory).
"""
from __future__ import annotations

import os

import schemathesis
from schemathesis.core.parameters import ParameterLocation
from schemathesis.openapi.checks import UseAfterFree

# the embedded default config's languages (tangram.service.sandbox_protocol.default_languages)
LANGUAGES = tuple(os.environ.get("TANGRAM_FUZZ_LANGUAGES", "python,bash,cpp").split(","))


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    return not (isinstance(failure, UseAfterFree) and failure.free.startswith("DELETE /v1/actions/"))


@schemathesis.hook
def map_case(context, case):
    body = case.body
    if not isinstance(body, dict) or case.meta is None or case.meta.is_negative_at(ParameterLocation.BODY):
        return case
    path = case.operation.path
    if path == "/sandbox/{key}/run_code" and isinstance(body.get("language"), str):
        body["language"] = LANGUAGES[len(body["language"]) % len(LANGUAGES)]
    elif path == "/v1/actions":
        body.pop("profile", None)
        if isinstance(body.get("tokens"), list) and isinstance(body.get("inputs"), list):
            n = len(body["inputs"])
            body["tokens"] = (body["tokens"] + [[] for _ in range(n)])[:n]
        if body.get("kind") == "http":
            body.setdefault("resources", {}).setdefault("api", "fuzz")
        resources = body.get("resources")
        if isinstance(resources, dict) and body.get("kind") in ("http", "model") and body.get("trajectory"):
            resources.pop("cpu", None)
            resources.pop("mem_mb", None)
        if isinstance(resources, dict):
            cpu = resources.get("cpu")
            if isinstance(cpu, dict) and "max" in cpu and cpu["max"] < cpu["min"]:
                cpu["min"], cpu["max"] = cpu["max"], cpu["min"]
            if _elastic(cpu) and _elastic(resources.get("gpu")):
                resources["gpu"] = resources["gpu"][0]
    return case


def _elastic(demand) -> bool:
    """Whether a (schema-valid) demand offers more than one unit count."""
    if isinstance(demand, dict):
        return demand.get("max", demand["min"]) > demand["min"]
    return isinstance(demand, list) and len(set(demand)) > 1
