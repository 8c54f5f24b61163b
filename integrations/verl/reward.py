"""Rewards computed through the scheduler (no verl import here).

Use as verl's custom reward function (any config that keeps its own loop)::

    reward.custom_reward_function.path=<repo>/integrations/verl/reward.py
    reward.custom_reward_function.name=compute_score

or through the ``tangram`` reward manager (``reward.reward_manager.name=tangram``,
see :mod:`integrations.verl.reward_manager`), or from the ``tangram_agent`` loop.

What to run comes from the sample: ``extra_info["tangram"]`` (or
``reward_model["tangram"]``, or the flat keys ``test_command`` / ``model`` of
either; a flat ``model`` only where the sample's reward_model is seen and is
not verl's ``style: rule``, so not under ``compute_score``), a mapping with

* test-suite rewards (CPU, elastic DoP): ``test_command`` (e.g.
  ``pytest -q -n ${parallel_num}``), ``setup_command`` (run first, e.g. copy
  the repository in), ``solution_file`` (the response is written there before
  the tests, byte for byte from the action's stdin; its last fenced code block
  if it has one), ``profile`` (the
  profile class of the repository's suite), ``cpu_min`` / ``cpu_max`` (the
  DoP range; default 1 .. the settings' ``reward_cpu_max``), ``timeout_s`` (a
  suite that times out below cpu_max, or after a restart left it part of its
  timeout, runs once more with all of it, wider as its node allows:
  that run is the verdict), ``restartable`` (true: the service may stop a suite that straggles at
  a narrow DoP and run it again wider; only one that runs in the trajectory's
  environment), ``score`` (``binary``: 1 if the command exits 0, the default;
  ``fraction``: passed / (passed + failed + errors) of pytest's summary line in
  stdout; see :func:`integrations.verl.verdicts.score_tests` for a run without
  one), ``broken_exit_codes`` (the test command's exit codes that mean it could
  not run and raise; default pytest's 4 and 5 and any command's 126 and 127,
  see :mod:`integrations.verl.verdicts`; ``[]`` for none);
* reward-model rewards (GPU ``model`` actions): ``model`` (the service's model
  name), ``op`` (default ``score``), ``gpu`` (an int or a list of allowed
  DoPs, default 1), ``template`` (default ``"{response}"``; may use
  ``{prompt}``, ``{response}``, ``{ground_truth}``);
* teacher log-prob rewards (``op: logprobs``, a causal-LM teacher such as
  ``tangram.demo.teachers:smollm2``): the teacher's log-probabilities of the
  response's tokens given ``prompt_template`` (default ``"{prompt}"``),
  reduced by ``reduce`` (``mean``, the default, or ``sum``) into the score.

The result is a dict with the keys of :data:`REWARD_KEYS` (verl stacks
``reward_extra_info`` per key over a batch): ``score``, ``acc`` (= score) and
``tangram_*`` keys (the reward action's status, DoP and timings). A sample
scored without Tangram keeps what verl's own scorer returned (a dict's every
key, ``acc`` and ``pred`` among them) with the ``tangram_*`` keys beside them
(``tangram_status="none"``); verl reads a batch's keys from its first sample, so
a batch whose scorers return different key sets fails there, as under verl's
``naive`` manager.

What is scored is the last generated turn, decoded from verl's response
tokens (``tangram_last_turn`` of the ``tangram_agent`` loop; the whole response
of a single-turn loop), in the trajectory's own environment when one was
handed over (``tangram_environment``; deleted after scoring), else in a new
one built from the sample's spec. Nothing is ever scored 0.0 for an
infrastructure failure: an unreachable service (after retries within
``retry_s``), a failed ``setup_command``, a tool call the service failed
during the rollout, a reward action the service could not run, a test suite
that could not run (:mod:`integrations.verl.verdicts`) and a reward model's
score that is not finite raise
:class:`~integrations.verl.session.TangramServiceError`, and every failure is
counted in the ``tangram/failed`` metric.
"""
from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Mapping

from integrations.verl import guard, metrics
from integrations.verl.config import TangramSettings, active_settings
from integrations.verl.session import (EnvSpec, TangramServiceError, create_environment, delete_environment,
                                       get_client, new_key, retrying, reward_failed, timing_record)
from integrations.verl.verdicts import (NoVerdict, broken_exit_codes, exec_broken, finite, pytest_counts,  # noqa: F401
                                        score_mode, score_tests, write_solution_step)
from tangram.client import ActionResult, TangramHTTPError

log = logging.getLogger("integrations.verl")

_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.DOTALL)
_ENV_KEYS = ("image", "memory_mb", "setup_command", "labels")

REWARD_KEYS = ("score", "acc", "tangram_status", "tangram_dop", "tangram_queued_s", "tangram_exec_s",
               "tangram_overhead_s", "tangram_actions")


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
    """The tangram reward spec of a sample, or None if it has none. A flat ``model`` key (datasets record
    the model that wrote a sample there) counts only when the sample's reward_model is given and is not
    verl's rule scorer (``style: rule``): verl's naive manager hands a custom function no reward_model,
    so under ``compute_score`` a model reward is written ``extra_info.tangram.model``."""
    reward_model = _plain(reward_model)
    rule = not isinstance(reward_model, Mapping) or reward_model.get("style") == "rule"
    for src in (_plain(extra_info), reward_model):
        if not isinstance(src, Mapping):
            continue
        nested = _plain(src.get("tangram"))
        if isinstance(nested, Mapping) and (nested.get("test_command") or nested.get("model")):
            return dict(nested)
        if src.get("test_command") or (isinstance(src.get("model"), str) and not rule):
            return dict(src)
    return None


def env_spec(info: Any, tools_kwargs: Any = None, reward_model: Any = None) -> EnvSpec:
    """How a sample's environment is built: ``extra_info.tangram``'s environment keys, then those of its
    reward spec in whichever form :func:`reward_spec` reads it (``reward_model.tangram``, flat keys of
    either), then the tools' ``create_kwargs`` (``tools_kwargs``, else ``extra_info.tools_kwargs``, where
    verl's dataset keeps them). A setup written in any of the forms runs before the tests."""
    spec = EnvSpec()
    info = _plain(info)
    info = info if isinstance(info, Mapping) else {}
    for src in (_plain(info.get("tangram")), reward_spec(info, reward_model)):
        if isinstance(src, Mapping):
            spec = EnvSpec.from_mapping({k: v for k, v in src.items() if k in _ENV_KEYS}, spec)
    tools_kwargs = _plain(tools_kwargs if tools_kwargs is not None else info.get("tools_kwargs"))
    for tk in tools_kwargs.values() if isinstance(tools_kwargs, Mapping) else ():
        ck = tk.get("create_kwargs") if isinstance(tk, Mapping) else None
        if isinstance(ck, Mapping) and any(k in ck for k in _ENV_KEYS):
            spec = EnvSpec.from_mapping({k: v for k, v in ck.items() if k in _ENV_KEYS}, spec)
    return spec


def last_turn_span(response_mask: Any) -> tuple[int, int]:
    """``[start, end)`` of the last run of generated tokens (mask 1) in a response; (0, 0) if none."""
    mask = [int(x) for x in (response_mask.tolist() if hasattr(response_mask, "tolist") else response_mask)]
    end = len(mask)
    while end > 0 and mask[end - 1] != 1:
        end -= 1
    start = end
    while start > 0 and mask[start - 1] == 1:
        start -= 1
    return start, end


def extract_solution(text: str) -> str:
    blocks = _FENCE.findall(text or "")
    return blocks[-1] if blocks else (text or "")


def _settings(kw: Mapping[str, Any]) -> TangramSettings:
    """The process's settings under what ``reward_kwargs`` say (``tangram_url``, ``tangram_token_file``, ...).
    A null or empty value keeps the setting, but for ``tangram_max_consecutive_failures``, where null means
    never stop (as 0 does, in the merge)."""
    s = active_settings()
    over = {k[len("tangram_"):]: v for k, v in kw.items() if k.startswith("tangram_")
            and (v not in (None, "") or (v is None and k == "tangram_max_consecutive_failures"))}
    return s.merged(over)


def _group(command: Any) -> str:
    """``command`` as one brace group of a step chain, closed on a line of its own: a command ending in a
    newline, ``;``, ``&``, a ``# comment`` or a here-document runs as it would alone (``{ CMD ; }`` made
    each of those a syntax error, exit 2, scored as failed tests)."""
    return f"{{ {command}\n}}"


def suite_action(spec: Mapping[str, Any], settings: TangramSettings, *, environment: str | None = None,
                solution: str | None = None) -> dict[str, Any]:
    """The ``exec`` action body of a test-suite reward."""
    broken_exit_codes(spec)  # a bad list is refused before anything runs
    score_mode(spec)
    steps = []  # brace groups run before the test command
    if spec.get("setup_command") and environment is None:  # stdin is the write step's: not read here
        steps.append(f"{_group(spec['setup_command'])} < /dev/null")
    stdin = None
    if spec.get("solution_file") and solution is not None:
        # on stdin, not in env or argv: a response past 32 KiB (an env value's cap) or 128 KiB (Linux's) fits
        stdin = extract_solution(solution)
        size = len(stdin.encode("utf-8", "surrogatepass"))  # what the service writes (it refuses a surrogate)
        steps.append(_group(write_solution_step(str(spec["solution_file"]), size)))
    test = str(spec["test_command"])
    command = " && ".join([*steps, _group(test)]) if steps else test
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
    if stdin is not None:
        body["stdin"] = stdin
    if "restartable" in spec:  # as given: the service refuses anything but true or false (400, naming it)
        body["restartable"] = spec["restartable"]
    return body


def model_action(spec: Mapping[str, Any], *, prompt: str, response: str, ground_truth: Any,
                 settings: TangramSettings | None = None, trajectory: str | None = None) -> dict[str, Any]:
    """The ``model`` action body of a reward-model or teacher reward. A template naming ``{prompt}`` with no
    prompt to put there is refused: the response would be scored without its question."""
    op = str(spec.get("op") or "score")
    fields = {"prompt": prompt or "", "response": response or "",
              "ground_truth": "" if ground_truth is None else ground_truth}
    template = str(spec.get("prompt_template") or "{prompt}") if op == "logprobs" else str(spec.get("template") or "")
    if "{prompt}" in template and not prompt:
        raise ValueError(f"the {spec.get('model')!r} reward's template uses {{prompt}} but the sample gives no "
                         "prompt: set extra_info.prompt (the tangram reward manager decodes the sample's prompt "
                         "tokens when it is absent)")
    gpu = spec.get("gpu") or 1
    body: dict[str, Any] = {"kind": "model", "model": str(spec["model"]), "op": op,
                            "resources": {"gpu": list(gpu) if isinstance(gpu, (list, tuple)) else int(gpu)}}
    if op == "logprobs":  # the teacher's log-probs of the response given the prompt
        body["inputs"] = [str(spec.get("prompt_template") or "{prompt}").format(**fields)]
        body["tokens"] = [response or ""]
    else:
        body["inputs"] = [str(spec.get("template") or "{response}").format(**fields)]
    if spec.get("timeout_s") or settings is not None:  # bounded, it is kept under its key if the answer is lost
        body["timeout_s"] = float(spec.get("timeout_s") or settings.reward_timeout_s)
    if spec.get("profile"):
        body["profile"] = str(spec["profile"])
    if trajectory:  # the rollout it scores: the order credits the trajectory's generation
        body["trajectory"] = trajectory
    return body


def model_score(output: Any) -> float:
    """A scalar out of a ``model`` action's output (a number, [number], [[number]] or {"score(s)": ...});
    ValueError if it is not finite (NaN, inf): no reward to train on."""
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
    return finite(float(x))


def logprob_score(output: Any, reduce: str = "mean") -> float:
    """A teacher's per-token log-probs of one response (``[[lp, ...]]``) reduced to a score (ValueError if
    it is not finite: a -inf log-prob, NaN)."""
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce: 'mean' or 'sum', got {reduce!r}")
    if not isinstance(output, (list, tuple)) or len(output) != 1 or not isinstance(output[0], (list, tuple)):
        raise ValueError("expected one list of log-probs")
    lps = [float(x) for x in output[0]]
    if not lps:
        raise ValueError("the response has no tokens")
    return finite(sum(lps) / len(lps) if reduce == "mean" else sum(lps))


def naive_keys(got: Any) -> dict[str, Any]:
    """The ``reward_extra_info`` of a score verl's own scorer gave: what verl's naive manager keeps (a dict
    result's every key, its ``acc`` and ``pred`` among them; else ``acc`` = the score), with the
    :data:`REWARD_KEYS` it lacks beside them (``tangram_status`` ``none``)."""
    score = got["score"] if isinstance(got, Mapping) else got
    return {**result(float(score)), **(dict(got) if isinstance(got, Mapping) else {"acc": score})}


def result(score: float, r: ActionResult | None = None, actions: int = 0) -> dict[str, Any]:
    """A reward result: always the keys of :data:`REWARD_KEYS`, all numbers but the status."""
    t = r.timing if r is not None else None
    return {
        "score": float(score), "acc": float(score),
        "tangram_status": r.status if r is not None else "none",
        "tangram_dop": float((r.allocation or {}).get("dop") or 0) if r is not None else 0.0,
        "tangram_queued_s": t.queued_s if t else 0.0,
        "tangram_exec_s": t.exec_s if t else 0.0,
        "tangram_overhead_s": t.overhead_s if t else 0.0,
        "tangram_actions": float(actions),
    }


def _broken(r: ActionResult, kind: str, spec: Mapping[str, Any] | None = None) -> str | None:
    """Why an action's result says nothing about the response (None: it is a verdict).

    A test command that fails the tests or times out is a verdict on the response; an action that
    could not run (no exit code, cancelled), a test command that could not (see
    :func:`~integrations.verl.verdicts.exec_broken`) or a failed reward model is not."""
    if kind == "model":
        return None if r.ok else f"{r.status}: {r.error or ''}".strip()
    return exec_broken(r, spec or {})


def _cpu_max(body: Mapping[str, Any]) -> int:
    cpu = body["resources"]["cpu"]
    return int(cpu["max"]) if isinstance(cpu, Mapping) else int(cpu)


async def run_reward(spec: Mapping[str, Any], *, settings: TangramSettings | None = None,
                     environment: str | None = None, solution: str | None = None, prompt: str = "",
                     ground_truth: Any = None, trajectory: str | None = None,
                     trace: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], ActionResult]:
    """Run one reward action described by ``spec`` (in ``environment`` if given, else in a one-shot
    environment with the spec's ``setup_command`` run first); raises :class:`TangramServiceError`
    when the service cannot give a verdict. A test suite that times out at a DoP below its cpu_max runs
    once more at cpu_max (``timeout_s`` bounds it at the DoP the scheduler granted, which load decides);
    that run is the verdict. Every action that ran is appended to ``trace``. Returns the result dict and
    the verdict's action result."""
    settings = settings or active_settings()
    client = get_client(settings)
    kind = "model" if spec.get("model") and not spec.get("test_command") else "exec"
    if kind == "model":
        body = model_action(spec, prompt=prompt, response=solution or "", ground_truth=ground_truth,
                            settings=settings, trajectory=trajectory)
    else:
        body = suite_action(spec, settings, environment=environment, solution=solution)

    async def run(body: Mapping[str, Any], name: str) -> ActionResult:
        key = new_key()  # a retry after a lost answer waits for the same action, never runs the suite twice
        r = await retrying(lambda: client.run_action(body, idempotency_key=key), settings, f"the {kind} reward action")
        if trace is not None:
            trace.append(timing_record(kind, name, r))
        return r

    r = await run(body, "reward")
    dop = (r.allocation or {}).get("dop")
    # a restart (restartable) left the last run what remained of timeout_s: its timeout says nothing yet
    restarted = float((r.allocation or {}).get("restarted_s") or 0) > 0
    cpu_max = _cpu_max(body) if kind == "exec" else 0
    if kind == "exec" and r.status == "timeout" and isinstance(dop, (int, float)) and (dop < cpu_max or restarted):
        log.info("tangram: a test-suite reward timed out at DoP %s%s; running it again, up to cpu_max %d", dop,
                 " after a restart" if restarted else "", cpu_max)  # the solution is written again
        # its own whole timeout_s (no restart shortens it) and wider than it ran, up to cpu_max: the service
        # caps the range to the node, and refuses (422) a range no node holds, when the first run already had
        # every core its node gives
        wide = {k: v for k, v in body.items() if k != "restartable"}
        if dop < cpu_max:
            wide["resources"] = {**body["resources"], "cpu": {"min": int(dop) + 1, "max": cpu_max}}
        try:
            r = await run(wide, "reward wider")
        except TangramServiceError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, TangramHTTPError) and cause.status == 422):
                raise
            log.info("tangram: no node runs the suite wider than DoP %s: its timeout is the verdict", dop)
    why = _broken(r, kind, spec)
    if why:
        raise TangramServiceError(f"tangram service {settings.url}: the {kind} reward action did not run ({why})")
    if kind == "model":
        try:
            if body["op"] == "logprobs":
                return result(logprob_score(r.output, str(spec.get("reduce") or "mean")), r), r
            return result(model_score(r.output), r), r
        except (TypeError, ValueError) as exc:
            raise TangramServiceError(f"tangram service {settings.url}: reward model "
                                      f"{spec.get('model')!r} returned an unreadable output: {exc}") from exc
    try:
        return result(score_tests(r, score_mode(spec)), r), r
    except NoVerdict as exc:
        raise TangramServiceError(f"tangram service {settings.url}: the test-suite reward gave no verdict: "
                                  f"{exc}") from exc


def _trajectory_settings(settings: TangramSettings, fields: Mapping[str, Any]) -> TangramSettings:
    url = fields.get("tangram_url")
    return settings.merged({"url": url}) if isinstance(url, str) and url else settings


async def score_sample(spec: Mapping[str, Any], fields: Mapping[str, Any], *, settings: TangramSettings,
                       text: str, prompt: str = "", ground_truth: Any = None, info: Any = None,
                       tools_kwargs: Any = None, reward_model: Any = None) -> dict[str, Any]:
    """The one reward path (the ``tangram`` manager and ``compute_score``): score ``text`` (the last
    generated turn) per ``spec``, in the environment the rollout handed over in ``fields`` (its
    ``extra_fields``) or in a new one; delete that environment afterwards; publish the sample's
    action timings and any failure to the step metrics."""
    trace = [dict(x) for x in (fields.get("tangram_trace") or []) if isinstance(x, Mapping)]
    handed = fields.get("tangram_environment")
    env_settings = _trajectory_settings(settings, fields)
    env_id = handed if isinstance(handed, str) and handed else None
    is_model = bool(spec.get("model")) and not spec.get("test_command")
    try:
        if fields.get("tangram_error"):
            raise TangramServiceError(f"tangram service {env_settings.url}: the rollout lost an action: "
                                      f"{fields['tangram_error']}")
        if env_id is None and not is_model:
            env_id, setup = await create_environment(settings, env_spec(info, tools_kwargs, reward_model),
                                                     labels={"reward": "1"})
            env_settings = settings
            if setup is not None:
                trace.append(timing_record("exec", "setup", setup))
        out, _ = await run_reward(spec, settings=env_settings if not is_model else settings,
                                  environment=env_id if not is_model else None, solution=text,
                                  prompt=prompt, ground_truth=ground_truth,
                                  trajectory=fields.get("tangram_trajectory") or env_id, trace=trace)
        guard.verdict(settings if is_model else env_settings)  # the service does the run's work
        out["tangram_actions"] = float(len(trace))
        metrics.publish(trace)
        return out
    except BaseException as exc:
        metrics.publish(trace, failed=1)
        if not fields.get("tangram_error"):  # the rollout's failure was counted where it happened
            # a reward action that did not run or gave no verdict counts as the service's failure in a row
            await reward_failed(settings if is_model else env_settings, exc)
        raise
    finally:
        if env_id is not None:
            await delete_environment(env_settings, env_id)


async def settle_unscored(fields: Mapping[str, Any], settings: TangramSettings, scoring: Any) -> Any:
    """Score a sample that verl's scorer handles, not Tangram (no spec, or the trainer's own function):
    ``await scoring`` unless one of its rollout's tool calls failed in the service (a trajectory the
    infrastructure broke is not scored, whatever scores it: it raises), then delete the environment its
    rollout handed over (it left the idle sweep's registry: nothing else would; a scorer that uses it,
    tangram's own compute_score, deletes it itself)."""
    handed = fields.get("tangram_environment")
    trace = [dict(x) for x in (fields.get("tangram_trace") or []) if isinstance(x, Mapping)]
    got: Any = None
    try:
        if fields.get("tangram_error"):
            if hasattr(scoring, "close"):
                scoring.close()  # never awaited
            metrics.publish(trace, failed=1)
            raise TangramServiceError(f"tangram service {_trajectory_settings(settings, fields).url}: the rollout "
                                      f"lost an action: {fields['tangram_error']}")
        got = await scoring
        return got
    finally:
        info = got.get("reward_extra_info", got) if isinstance(got, Mapping) else None
        scored_here = isinstance(info, Mapping) and info.get("tangram_status") not in (None, "none")
        if trace and not scored_here and not fields.get("tangram_error"):  # tangram's scorer publishes its own
            metrics.publish(trace)  # the rollout's tool calls count into the step whoever scores the sample
        if isinstance(handed, str) and handed and not scored_here:  # a Tangram score deleted it already
            await delete_environment(_trajectory_settings(settings, fields), handed)


async def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None,
                        **kwargs: Any) -> dict[str, Any] | float:
    """verl's custom reward function contract (async): score the last generated turn through the scheduler.

    The service comes from ``reward.custom_reward_function.reward_kwargs`` (``tangram_url``,
    ``tangram_token_file``, ``tangram_token``), else the process's settings (``TANGRAM_URL`` ...).
    verl's ``naive`` manager merges the rollout's ``extra_fields`` into ``extra_info``: the
    ``tangram_agent`` loop's last turn and environment are used from there. Samples without a
    tangram spec are scored by verl's ``default_compute_score`` (same result keys), in the loop's default
    executor as verl's naive manager runs it, with every reward kwarg that is not Tangram's own (all but
    ``tangram_*``, ``reward_model``, ``tools_kwargs``). verl applies its SandboxFusion settings
    (``reward.sandbox_fusion.url``) only when no custom function is set: to score code through
    SandboxFusion here, pass ``sandbox_fusion_url`` (and ``memory_limit_mb``) in
    ``reward.custom_reward_function.reward_kwargs``.
    """
    info = _plain(extra_info) or {}
    info = info if isinstance(info, Mapping) else {}
    spec = reward_spec(info, kwargs.get("reward_model"))
    if spec is None:
        from verl.utils.reward_score import default_compute_score

        scorer_kwargs = {k: v for k, v in kwargs.items()
                         if not k.startswith("tangram_") and k not in ("reward_model", "tools_kwargs")}

        async def scoring() -> dict[str, Any]:
            got = await asyncio.get_running_loop().run_in_executor(None, lambda: default_compute_score(
                data_source, solution_str, ground_truth, extra_info, **scorer_kwargs))
            return naive_keys(got)

        return await settle_unscored(info, _settings(kwargs), scoring())
    text = info.get("tangram_last_turn_text")
    if not isinstance(text, str) and int(info.get("num_turns") or 0) > 2:  # as the tangram manager refuses it
        raise ValueError(f"a {int(info['num_turns'])}-turn sample carries no tangram_last_turn_text: its whole "
                         "response holds tool outputs; run it with agent_name=tangram_agent")
    return await score_sample(spec, info, settings=_settings(kwargs),
                              text=text if isinstance(text, str) else solution_str,
                              prompt=str(info.get("prompt") or ""), ground_truth=ground_truth, info=info,
                              tools_kwargs=kwargs.get("tools_kwargs"), reward_model=kwargs.get("reward_model"))
