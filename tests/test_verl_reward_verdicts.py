"""Only a verdict on the model's response is a reward: against a real ``tangram serve`` and verl's own
objects, results that say nothing about the response (a suite that could not run, a timeout the
scheduler's DoP caused, output without pytest's summary, a reward model's NaN) raise, and samples verl
scores get exactly what verl would give them (a dataset's flat ``model`` key under ``style: rule``,
SandboxFusion's reward kwargs, verl's own reward model)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import threading

import numpy as np
import pytest

pytest.importorskip("verl", reason="verl not installed: pip install -r scripts/test-requirements.txt")

from integrations.verl import metrics  # noqa: E402
from integrations.verl import reward as R  # noqa: E402
from integrations.verl.session import close_clients  # noqa: E402
from integrations.verl.testing import make_model_dir, make_tokenizer, toy_reward_model, verl_config  # noqa: E402
from tangram.service.launch import start_serve  # noqa: E402
# project and settings are that module's fixtures (settings reads this module's service)
from tests.test_verl_reward import (BAD, CALC_PROFILE, GOOD, HALF, REWARD_PY, _info, _sample, _stats,  # noqa: E402,F401
                                    cluster_dir, project, settings)

pytestmark = pytest.mark.verl

SANDBOX_KEY = "sbx-verdicts-0123456789abcdef"
QUIET_SUITE = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 pytest -q"


def not_finite_reward_model():
    """A served reward model with a broken head (a ``factory`` of the service below): the log of the toy
    reward model's count of ``!`` less one, so NaN without a ``!``, -inf with one, finite from two on."""
    import torch

    from tangram.executors.torch_gpu import ServedModel

    counting = toy_reward_model()

    class LogOfCountLessOne(torch.nn.Module):
        def __init__(self, count):
            super().__init__()
            self.count = count

        def forward(self, input_ids):
            return torch.log(self.count(input_ids) - 1)

    return ServedModel(LogOfCountLessOne(counting.module), tokenizer=counting.tokenizer)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A real service: a profile class whose suite the scheduler runs wide and one it keeps at one core,
    a (virtual, CPU) GPU node with the broken reward model, and the SandboxFusion endpoint."""
    d = tmp_path_factory.mktemp("svc")
    narrow = {"pytest-narrow": {"t1_s": 4.0, "efficiency": {"1": 1.0, "2": 0.5}, "samples": 5}}
    cluster = cluster_dir(d, {**CALC_PROFILE, **narrow}, gpus=1, model="log-rm",
                          factory="tests.test_verl_reward_verdicts:not_finite_reward_model")
    (d / "sandbox.key").write_text(SANDBOX_KEY + "\n")
    srv = start_serve(["--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING", "--no-auth",
                       "--config", str(cluster), "--sandbox-key-file", str(d / "sandbox.key")],
                      throwaway_state=True)
    try:
        yield srv.url
    finally:
        srv.stop(grace_s=30)


async def _score(project, text=GOOD, **spec):
    return await R.compute_score("x", text, None, extra_info=_info(project, **spec))


async def test_a_suite_that_could_not_run_raises_and_failed_tests_stay_verdicts(settings, project):
    """pytest's usage error (``-n`` with xdist not loaded) and "no tests collected", a command not found
    or not executable, and a solution_file that cannot be written once scored every sample 0.0."""
    broken = {
        f"{QUIET_SUITE} -n 2": r"(?s)exited 4 \(pytest usage error.*pytest-xdist.*unrecognized arguments: -n",
        f"{QUIET_SUITE} -k no_such_test": "exited 5 .pytest collected no tests",
        "no-such-test-runner --all": "exited 127 .command not found.*no-such-test-runner",
        "./calc.py": "exited 126 .the command was found but cannot be executed",
    }
    try:
        for command, why in broken.items():
            with pytest.raises(R.TangramServiceError, match=why):
                await _score(project, test_command=command)
        with pytest.raises(R.TangramServiceError, match="could not be written to solution_file 'no/such/calc.py'"):
            await _score(project, solution_file="no/such/calc.py")
        # what a response can cause stays a verdict: failed tests (1), a module that does not import
        # (pytest's collection error, 2), a kill (137: out of memory), a command's own exit 86
        assert (await _score(project, BAD))["score"] == 0.0
        assert (await _score(project, "def add(a, b) return a + b"))["score"] == 0.0
        assert (await _score(project, test_command="kill -9 $$"))["score"] == 0.0
        assert (await _score(project, test_command="exit 86"))["score"] == 0.0
        # another program's 4 and 5 are its own (a runner exiting with its count of failures)
        assert (await _score(project, test_command="exit 4"))["score"] == 0.0
        assert (await _score(project, test_command="exit 5"))["score"] == 0.0
        # pytest's 4 when a conftest.py cannot import the response's code is the response's doing
        conftest = f"printf 'from calc import add\\n' > conftest.py && {QUIET_SUITE}"
        assert (await _score(project, "def add(a, b) return a + b", test_command=conftest))["score"] == 0.0
        assert (await _score(project, GOOD))["score"] == 1.0
        # the sample's own list: [] makes every exit code a verdict, another list raises on its codes
        assert (await _score(project, test_command=f"{QUIET_SUITE} -n 2", broken_exit_codes=[]))["score"] == 0.0
        with pytest.raises(R.TangramServiceError, match="exited 1 .listed in the sample's broken_exit_codes"):
            await _score(project, BAD, broken_exit_codes=[1])
        for bad in ("4", [4.0], [True], {"4": 1}):
            with pytest.raises(ValueError, match="broken_exit_codes"):
                await _score(project, broken_exit_codes=bad)
    finally:
        await close_clients()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: the suite passes only at DoP 2")
async def test_a_suite_that_times_out_below_its_cpu_max_runs_again_at_cpu_max(settings, project):
    """The scheduler keeps this profile class at one core under cpu_max 2; the suite only finishes in
    time at two (as a suite sized for cpu_max would, under load). It once scored 0.0 at the DoP that load
    happened to grant; now the timed-out run is run again at cpu_max, and that run is the verdict."""
    slow_at_one = f'[ "${{parallel_num}}" -ge 2 ] || sleep 60; {QUIET_SUITE}'
    try:
        metrics.drain()
        got = await _score(project, test_command=slow_at_one, profile="pytest-narrow", timeout_s=8)
        assert got["score"] == 1.0 and got["tangram_status"] == "succeeded" and got["tangram_dop"] == 2.0, got
        assert got["tangram_actions"] == 3.0  # the setup, the run that timed out at 1 core, the one at 2
        step = metrics.drain()
        assert step["tangram/actions"] == 3 and step["tangram/failed"] == 0  # both runs in the step's metrics
        # a timeout at cpu_max is the verdict at once
        late = await _score(project, test_command="sleep 60", profile="pytest-calc", timeout_s=2)
        assert late["score"] == 0.0 and late["tangram_status"] == "timeout" and late["tangram_actions"] == 2.0
        # a cpu_max above every node: the first run had all its node's cores, and the wider run the
        # service refuses (422) leaves the timeout the verdict rather than raising
        capped = await _score(project, test_command="sleep 60", profile="pytest-calc", timeout_s=2, cpu_max=512)
        assert capped["score"] == 0.0 and capped["tangram_status"] == "timeout" and capped["tangram_dop"] == 2.0
    finally:
        await close_clients()


async def test_a_fraction_is_read_from_pytests_summary_line_only(settings, project):
    """A count on stderr ("Found 0 errors") once won over pytest's summary, and output without a summary
    (a command that never reached pytest, or output the executor cut) scored 0.0."""
    assert R.pytest_counts("3 passed, 1 failed in 0.12s") == {"passed": 3, "failed": 1}
    assert R.pytest_counts("x\n==== 2 failed, 1 error in 1.02s ====\nlater: 5 passed\n") == {"failed": 2, "errors": 1}
    assert R.pytest_counts("1 error in 0.5s") == {"errors": 1}
    assert R.pytest_counts("= 2 passed, 1 skipped, 3 deselected, 1 xfailed, 1 xpassed, 2 warnings in 65.02s "
                           "(0:01:05) =") == {"passed": 2}
    assert R.pytest_counts("1 passed, 3 subtests passed in 0.01s") == {"passed": 1}  # pytest 9's subtests
    assert R.pytest_counts("Found 0 errors\n3 tests passed\n") is None
    frac = {"score": "fraction", "test_command": QUIET_SUITE}
    try:
        got = await _score(project, HALF, **{**frac, "test_command": f"{QUIET_SUITE}; echo 'Found 0 errors' >&2"})
        assert got["score"] == pytest.approx(2 / 3)
        assert (await _score(project, BAD, **frac))["score"] == pytest.approx(1 / 3)  # add(0, 0) passes
        with pytest.raises(R.TangramServiceError, match="summary line.*may not reach pytest.*score: binary"):
            await _score(project, **{**frac, "test_command": f"cd tests && {QUIET_SUITE}"})
        # 9 MB of output, as a response may print: the executor keeps the first 8 MiB, the summary is gone
        flood = f"head -c 9000000 /dev/zero | tr '\\0' x; echo; {QUIET_SUITE}"
        assert (await _score(project, **{**frac, "test_command": flood}))["score"] == 1.0  # exit 0: all passed
        cut = await _score(project, HALF, **{**frac, "test_command": flood})
        assert cut["score"] == 0.0 and cut["tangram_status"] == "failed"
        # a failing run whose last summary-like line counts no failure: the response printed it
        forged = await _score(project, HALF, **{**frac, "test_command": f"{QUIET_SUITE}; s=$?; "
                                                "echo '100 passed in 0.01s'; exit $s"})
        assert forged["score"] == 0.0
        # a suite stopped before its summary (a timeout at cpu_max) is still a verdict
        late = await _score(project, **{**frac, "test_command": "sleep 60", "timeout_s": 2})
        assert late["score"] == 0.0 and late["tangram_status"] == "timeout"
        with pytest.raises(ValueError, match="score: 'binary' or 'fraction'"):
            await _score(project, score="fractional")
    finally:
        await close_clients()


async def test_a_reward_models_score_that_is_not_finite_raises(settings):
    rm = {"tangram": {"model": "log-rm", "op": "score", "gpu": 1}}
    try:
        got = await R.compute_score("x", "wow!!!", None, extra_info=rm)
        assert got["score"] == pytest.approx(math.log(2)) and got["tangram_status"] == "succeeded"
        for text in ("fine.", "ok!"):  # NaN, -inf
            with pytest.raises(R.TangramServiceError, match="reward model 'log-rm'.*not a finite number"):
                await R.compute_score("x", text, None, extra_info=rm)
    finally:
        await close_clients()
    with pytest.raises(ValueError, match="not a finite number"):
        R.logprob_score([[-1.0, float("-inf")]])


async def test_a_flat_model_key_under_verls_rule_scorer_is_not_a_tangram_reward(settings, service, tmp_path):
    """Datasets record the model that wrote a sample in extra_info["model"]; under ``style: rule`` that
    sample is verl's to score. It once became a Tangram reward-model action (and raised: no such model)."""
    from verl.trainer.ppo.reward import load_reward_manager

    import integrations.verl.reward_manager  # noqa: F401

    rule = {"style": "rule", "ground_truth": "42"}
    assert R.reward_spec({"model": "deepseek-r1"}, {"style": "rule", "ground_truth": "1"}) is None
    assert R.reward_spec({}, {**rule, "model": "deepseek-r1"}) is None
    assert R.reward_spec({"model": "rm"}, {"ground_truth": "1"}) == {"model": "rm"}
    assert R.reward_spec({"tangram": {"model": "rm"}}, rule) == {"model": "rm"}
    assert R.reward_spec({"test_command": "pytest"}, rule) == {"test_command": "pytest"}
    try:
        got = await R.compute_score("openai/gsm8k", "#### 42", "42", extra_info={"model": "deepseek-r1"},
                                    reward_model=rule)
        assert got["score"] == 1.0 and got["tangram_status"] == "none"
        # as verl's naive manager calls a custom function: no reward_model at all
        got = await R.compute_score("openai/gsm8k", "#### 42", "42", extra_info={"model": "deepseek-r1"})
        assert got["score"] == 1.0 and got["tangram_status"] == "none"
        assert R.reward_spec({"model": "rm"}) is None  # a model reward there is extra_info.tangram.model
        tok = make_tokenizer()
        model_dir = make_model_dir(tmp_path / "m")
        naive = load_reward_manager(verl_config(model_dir, ["reward.reward_manager.name=naive"]), tok)
        ours = load_reward_manager(verl_config(model_dir, ["reward.reward_manager.name=tangram",
                                                           f"+actor_rollout_ref.rollout.custom.tangram.url={service}"]),
                                   tok)
        for text in ("#### 42", "#### 41"):
            sample = _sample(tok, [text], info={"model": "deepseek-r1"})
            sample.non_tensor_batch["reward_model"] = np.array([dict(rule)], dtype=object)
            want, got = await naive.run_single(sample), await ours.run_single(sample)
            assert got["reward_score"] == want["reward_score"], (want, got)
            assert {k: got["reward_extra_info"][k] for k in want["reward_extra_info"]} == want["reward_extra_info"]
            assert got["reward_extra_info"]["tangram_status"] == "none"
    finally:
        await close_clients()


async def test_compute_score_hands_verls_scorer_its_reward_kwargs_off_the_event_loop(settings, service, tmp_path):
    """Code scored through SandboxFusion under the custom function: verl applies reward.sandbox_fusion only
    without one, so the URL comes in reward_kwargs. compute_score once dropped them (verl's scorer ran the
    code in the reward worker itself, prime_code) and ran the scorer on the event loop, stalling it."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    run_code = f"{service}/sandbox/{SANDBOX_KEY}/run_code"
    fn = get_custom_reward_fn(verl_config(make_model_dir(tmp_path / "m"), [
        f"reward.custom_reward_function.path={REWARD_PY}", "reward.custom_reward_function.name=compute_score",
        f"+reward.custom_reward_function.reward_kwargs.tangram_url={service}",
        f"+reward.custom_reward_function.reward_kwargs.sandbox_fusion_url={run_code}",
        "+reward.custom_reward_function.reward_kwargs.memory_limit_mb=256"]))
    truth = json.dumps({"inputs": ["3\n1 2 3\n", "1\n10\n"], "outputs": ["6\n", "10\n"]})
    right = "```python\nimport time\ntime.sleep(0.5)\nn = int(input())\nprint(sum(map(int, input().split())))\n```"
    ticks, scoring = 0, True

    async def tick():
        nonlocal ticks
        while scoring:
            await asyncio.sleep(0.02)
            ticks += 1

    try:
        before = (await _stats(service))["actions"].get("exec:succeeded", 0)
        ticker = asyncio.create_task(tick())
        loop_thread = threading.get_ident()
        got = await fn(data_source="codecontests", solution_str=right, ground_truth=truth, extra_info={})
        scoring = False
        await ticker
        assert got["score"] == 1.0 and got["tangram_status"] == "none", got
        # both test cases ran as the service's actions, not in this process
        assert (await _stats(service))["actions"].get("exec:succeeded", 0) - before == 2
        assert ticks >= 10 and threading.get_ident() == loop_thread  # the loop kept running meanwhile
    finally:
        await close_clients()


def test_a_reward_manager_that_verls_reward_model_would_bypass_is_refused(tmp_path):
    """With reward.reward_model.enable and no custom function, verl's RewardLoopWorker scores every sample
    with compute_score_disrm and never calls the manager: every tangram spec was ignored without a word."""
    from verl.trainer.ppo.reward import load_reward_manager

    import integrations.verl.reward_manager  # noqa: F401

    tok = make_tokenizer()
    model_dir = make_model_dir(tmp_path / "m")
    cfg = ["reward.reward_manager.name=tangram", "reward.reward_model.enable=true"]
    with pytest.raises(ValueError, match=r"reward\.reward_model\.enable.*`model` reward spec.*custom_reward_function"):
        load_reward_manager(verl_config(model_dir, cfg), tok)
    scorer = tmp_path / "judge.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
                      "    return 0.0\n")
    custom = [f"reward.custom_reward_function.path={scorer}", "reward.custom_reward_function.name=compute_score"]
    assert type(load_reward_manager(verl_config(model_dir, cfg + custom), tok)).__name__ == "TangramRewardManager"


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_a_solution_file_short_of_the_response_raises(shell, tmp_path):
    """The write step once took whatever its stdin held: a stdin cut on its way (a proxy dropping the
    half-close, an executor that stopped writing) tested a truncated response, and scored it."""
    import subprocess

    from integrations.verl.verdicts import SOLUTION_WRITE_FAILED, write_solution_step
    from tangram.client import ActionResult

    text = "def add(a, b):\n    return a + b  # é 中\n"
    size = len(text.encode())
    for given, path in ((text, "sol.py"), (text[:-5], "sol.py"), ("", "sol.py"), (text, "no/such/sol.py")):
        p = subprocess.run([shell, "-c", write_solution_step(path, size)], input=given.encode(), cwd=tmp_path,
                           capture_output=True, timeout=30)
        if given == text and path == "sol.py":
            assert p.returncode == 0 and (tmp_path / path).read_text() == text, p
            continue
        assert p.returncode == SOLUTION_WRITE_FAILED, p
        r = ActionResult(id="a", status="failed", exit_code=p.returncode, stderr=p.stderr.decode())
        why = R.exec_broken(r, {"solution_file": path, "test_command": "pytest"})
        assert why is not None and "could not be written to solution_file" in why and "arrived short" in why, why
        assert f"short of the response's {size} bytes" in why
    empty = subprocess.run([shell, "-c", write_solution_step("e.py", 0)], input=b"", cwd=tmp_path, timeout=30)
    assert empty.returncode == 0 and (tmp_path / "e.py").read_bytes() == b""


async def test_a_timeout_the_executor_never_reported_raises_and_its_own_stays_a_verdict(monkeypatch):
    """The service's safety net (no answer from the executor within timeout_s + its grace, as under a
    stalled Docker Engine) answers timeout with no exit code: it was scored 0.0 as a response that ran
    too long. An executor's own timeout kills the command and reports its exit status: a verdict."""
    from tangram.client import ActionResult

    spec = {"test_command": QUIET_SUITE}
    net = ActionResult(id="a", status="timeout", error="no result within 2 s")
    assert "no exit code" in R.exec_broken(net, spec) and "no result within 2 s" in R.exec_broken(net, spec)
    for own in (-15, -9, 137, 143):  # local (the signal, as Python reports it), Docker (128 + the signal)
        killed = ActionResult(id="a", status="timeout", exit_code=own, error="killed after 2 s")
        assert R.exec_broken(killed, spec) is None and R.score_tests(killed) == 0.0
        assert R.score_tests(killed, "fraction") == 0.0

    class Answers:  # the service's answer to the reward action, at its cpu_max (no wider run to try)
        def __init__(self, r):
            self.r = r

        async def run_action(self, body, idempotency_key=None):
            return dataclasses.replace(self.r, allocation={"dop": 2})

    s = R.TangramSettings(url="http://tangram.invalid", reward_cpu_max=2)
    monkeypatch.setattr(R, "get_client", lambda s: Answers(net))
    with pytest.raises(R.TangramServiceError, match=r"did not run \(timeout with no exit code.*no result within"):
        await R.run_reward(spec, settings=s)
    monkeypatch.setattr(R, "get_client", lambda s: Answers(killed))
    got, _ = await R.run_reward(spec, settings=s)
    assert got["score"] == 0.0 and got["tangram_status"] == "timeout"


async def test_a_suite_that_timed_out_after_a_restart_runs_again_with_its_whole_timeout(monkeypatch):
    """A restart (restartable) leaves the last run what the stopped runs left of timeout_s: its timeout, at
    cpu_max, was scored 0.0 although the suite may pass within timeout_s. It now runs once more, with the
    whole timeout_s and no restart, and that run is the verdict; a run that was not restarted at cpu_max keeps
    its timeout as the verdict."""
    from tangram.client import ActionResult

    spec = {"test_command": QUIET_SUITE, "restartable": True, "cpu_max": 4, "timeout_s": 60}
    timed_out = ActionResult(id="a", status="timeout", exit_code=-9, error="killed after 20 s")
    passed = ActionResult(id="b", status="succeeded", exit_code=0, allocation={"dop": 4})

    class Answers:
        def __init__(self, first):
            self.first, self.bodies = first, []

        async def run_action(self, body, idempotency_key=None):
            self.bodies.append(body)
            return self.first if len(self.bodies) == 1 else passed

    s = R.TangramSettings(url="http://tangram.invalid", reward_cpu_max=4)
    restarted = Answers(dataclasses.replace(timed_out, allocation={"dop": 4, "restarted_s": 40.0}))
    monkeypatch.setattr(R, "get_client", lambda s: restarted)
    got, _ = await R.run_reward(spec, settings=s)
    assert got["score"] == 1.0 and len(restarted.bodies) == 2
    first, again = restarted.bodies
    assert first["restartable"] is True and "restartable" not in again and again["timeout_s"] == 60
    assert again["resources"] == first["resources"]  # already at cpu_max: as wide as before
    # the stopped runs took the whole deadline: the service's answer has no exit code, and the suite runs again
    spent = Answers(ActionResult(id="c", status="timeout", error="no result within 60 s",
                                 allocation={"dop": 4, "restarted_s": 61.0}))
    monkeypatch.setattr(R, "get_client", lambda s: spent)
    got, _ = await R.run_reward(spec, settings=s)
    assert got["score"] == 1.0 and len(spent.bodies) == 2 and "restartable" not in spent.bodies[1]
    plain = Answers(dataclasses.replace(timed_out, allocation={"dop": 4}))
    monkeypatch.setattr(R, "get_client", lambda s: plain)
    got, _ = await R.run_reward(spec, settings=s)
    assert got["score"] == 0.0 and len(plain.bodies) == 1
