"""Rewards computed through the scheduler (no verl import here).

Use as verl's custom reward function (any config that keeps its own loop)::

    reward.custom_reward_function.path=<repo>/integrations/verl/reward.py
    reward.custom_reward_function.name=compute_score

or through the ``tangram`` reward manager (``reward.reward_manager.name=tangram``,
see :mod:`integrations.verl.reward_manager`), or from the ``tangram_agent`` loop.

What to run comes from the sample: ``extra_info["tangram"]`` (or
``reward_model["tangram"]``, or the flat keys ``test_command`` / ``model`` of
either), a mapping with

* test-suite rewards (CPU, elastic DoP): ``test_command`` (e.g.
  ``pytest -q -n ${parallel_num}``), ``setup_command`` (run first, e.g. copy
  the repository in), ``solution_file`` (the response is written there before
  the tests; its last fenced code block if it has one), ``profile`` (the
  profile class of the repository's suite), ``cpu_min`` / ``cpu_max`` (the
  DoP range; default 1 .. the settings' ``reward_cpu_max``), ``timeout_s``,
  ``score`` (``binary``: 1 if the command exits 0, the default; ``fraction``:
  passed / collected from pytest's summary line);
* reward-model rewards (GPU ``model`` actions): ``model`` (the service's model
  name), ``op`` (default ``score``), ``gpu`` (an int or a list of allowed
  DoPs, default 1), ``template`` (default ``"{response}"``; may use
  ``{prompt}``, ``{response}``, ``{ground_truth}``).

The result is a dict: ``score`` plus ``tangram_*`` timing keys (verl puts
them in ``reward_extra_info``).
"""
from __future__ import annotations

import logging
import re
import shlex
from typing import Any, Mapping

from integrations.verl.config import TangramSettings, active_settings
from integrations.verl.session import get_client
from tangram.client import ActionResult, TangramHTTPError

log = logging.getLogger("integrations.verl")

_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.DOTALL)
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|xfailed|xpassed|skipped)")


def _plain(x: Any) -> Any:
    """numpy object scalars / DictConfigs -> plain Python."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(x, DictConfig):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:
        pass
    if hasattr(x, "item") and not isinstance(x, (str, bytes, dict, list)):
        try:
            return x.item()
        except (ValueError, AttributeError):
            return x
    return x


def reward_spec(extra_info: Any = None, reward_model: Any = None) -> dict[str, Any] | None:
    """The tangram reward spec of a sample, or None if it has none."""
    for src in (_plain(extra_info), _plain(reward_model)):
        if not isinstance(src, Mapping):
            continue
        nested = _plain(src.get("tangram"))
        if isinstance(nested, Mapping) and (nested.get("test_command") or nested.get("model")):
            return dict(nested)
        if src.get("test_command") or (isinstance(src.get("model"), str) and src.get("style") != "rule"):
            return dict(src)
    return None


def extract_solution(text: str) -> str:
    blocks = _FENCE.findall(text or "")
    return blocks[-1] if blocks else (text or "")


def pytest_counts(output: str) -> dict[str, int]:
    """Counts from pytest's last summary line (``3 passed, 1 failed in 0.1s``)."""
    counts: dict[str, int] = {}
    for line in reversed((output or "").splitlines()):
        found = _COUNT.findall(line)
        if found:
            for n, what in found:
                counts["errors" if what.startswith("error") else what] = int(n)
            break
    return counts


def score_tests(r: ActionResult, mode: str = "binary") -> float:
    if mode == "fraction":
        c = pytest_counts((r.stdout or "") + "\n" + (r.stderr or ""))
        total = c.get("passed", 0) + c.get("failed", 0) + c.get("errors", 0)
        return c.get("passed", 0) / total if total else 0.0
    return 1.0 if (r.status == "succeeded" and r.exit_code == 0) else 0.0


def _settings(kw: Mapping[str, Any]) -> TangramSettings:
    s = active_settings()
    over = {k: kw.get(f"tangram_{k}") for k in ("url", "token")}
    return s.merged({k: v for k, v in over.items() if v})


def suite_action(spec: Mapping[str, Any], settings: TangramSettings, *, environment: str | None = None,
                solution: str | None = None) -> dict[str, Any]:
    """The ``exec`` action body of a test-suite reward."""
    steps = []
    if spec.get("setup_command") and environment is None:
        steps.append(str(spec["setup_command"]))
    env: dict[str, str] = {}
    if spec.get("solution_file") and solution is not None:
        env["TANGRAM_SOLUTION"] = extract_solution(solution)
        steps.append(f'printf "%s" "$TANGRAM_SOLUTION" > {shlex.quote(str(spec["solution_file"]))}')
    steps.append(str(spec["test_command"]))
    command = steps[0] if len(steps) == 1 else " && ".join(f"{{ {s} ; }}" for s in steps)
    lo = int(spec.get("cpu_min") or 1)
    hi = max(lo, int(spec.get("cpu_max") or settings.reward_cpu_max))
    body: dict[str, Any] = {"kind": "exec", "command": command,
                            "resources": {"cpu": {"min": lo, "max": hi} if hi > lo else lo},
                            "timeout_s": float(spec.get("timeout_s") or settings.reward_timeout_s)}
    if environment is not None:
        body["environment"] = environment
    if spec.get("profile"):
        body["profile"] = str(spec["profile"])
    if spec.get("mem_mb"):
        body["resources"]["mem_mb"] = int(spec["mem_mb"])
    if env:
        body["env"] = env
    return body


def model_action(spec: Mapping[str, Any], *, prompt: str, response: str, ground_truth: Any) -> dict[str, Any]:
    template = str(spec.get("template") or "{response}")
    text = template.format(prompt=prompt or "", response=response or "",
                           ground_truth="" if ground_truth is None else ground_truth)
    gpu = spec.get("gpu") or 1
    body: dict[str, Any] = {"kind": "model", "model": str(spec["model"]), "op": str(spec.get("op") or "score"),
                            "inputs": [text], "resources": {"gpu": list(gpu) if isinstance(gpu, (list, tuple)) else int(gpu)}}
    if spec.get("timeout_s"):
        body["timeout_s"] = float(spec["timeout_s"])
    if spec.get("profile"):
        body["profile"] = str(spec["profile"])
    return body


def model_score(output: Any) -> float:
    """A scalar out of a ``model`` action's output (a number, [number], [[number]] or {"score(s)": ...})."""
    x = output
    for _ in range(4):
        if isinstance(x, Mapping):
            x = x.get("score", x.get("scores", x.get("output")))
        elif isinstance(x, (list, tuple)):
            if not x:
                raise ValueError("empty model output")
            x = x[0]
        else:
            break
    return float(x)


def _result(score: float, r: ActionResult | None, kind: str, error: str | None = None) -> dict[str, Any]:
    """The reward's result; always the same keys (verl stacks reward_extra_info per key across a batch)."""
    t = r.timing if r is not None else None
    return {
        "score": float(score),
        "tangram_status": r.status if r is not None else "error",
        "tangram_dop": float((r.allocation or {}).get("dop") or 0) if r is not None else 0.0,
        "tangram_queued_s": t.queued_s if t else 0.0,
        "tangram_exec_s": t.exec_s if t else 0.0,
        "tangram_overhead_s": t.overhead_s if t else 0.0,
        "tangram_error": (error or "")[-500:],
    }


async def run_reward(spec: Mapping[str, Any], *, settings: TangramSettings | None = None,
                     environment: str | None = None, solution: str | None = None, prompt: str = "",
                     ground_truth: Any = None) -> dict[str, Any]:
    """Run one reward action described by ``spec``; returns ``{"score", "tangram_*"...}``."""
    settings = settings or active_settings()
    client = get_client(settings)
    if spec.get("model") and not spec.get("test_command"):
        body = model_action(spec, prompt=prompt, response=solution or "", ground_truth=ground_truth)
        kind = "model"
    else:
        body = suite_action(spec, settings, environment=environment, solution=solution)
        kind = "exec"
    try:
        r = await client.run_action(body)
    except TangramHTTPError as exc:
        log.warning("tangram reward: %s", exc)
        return _result(0.0, None, kind, error=str(exc))
    if kind == "model":
        if not r.ok:
            return _result(0.0, r, kind, error=r.error or r.status)
        try:
            return _result(model_score(r.output), r, kind)
        except (TypeError, ValueError) as exc:
            return _result(0.0, r, kind, error=f"unreadable model output: {exc}")
    return _result(score_tests(r, str(spec.get("score") or "binary")), r, kind,
                   error=None if r.ok else (r.stderr or r.error or "")[-500:] or None)


async def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None,
                        **kwargs: Any) -> dict[str, Any] | float:
    """verl's custom reward function contract (async): score ``solution_str`` through the scheduler.

    Samples without a tangram spec fall back to verl's ``default_compute_score``.
    """
    info = _plain(extra_info) or {}
    spec = reward_spec(info, kwargs.get("reward_model"))
    if spec is None:
        from verl.utils.reward_score import default_compute_score

        return default_compute_score(data_source, solution_str, ground_truth, extra_info)
    return await run_reward(spec, settings=_settings(kwargs), solution=solution_str,
                            prompt=str(info.get("prompt") or "") if isinstance(info, Mapping) else "",
                            ground_truth=ground_truth)
