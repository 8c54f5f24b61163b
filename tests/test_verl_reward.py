"""Rewards through the scheduler for configurations that keep their own loop:
the async ``compute_score`` (loaded the way verl loads a custom reward function)
and the ``tangram`` reward manager (built by verl's ``load_reward_manager``),
scoring real pytest runs (``pytest -n ${parallel_num}``, elastic DoP from a
profile) and a reward model served on a (virtual, CPU) GPU node."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl not installed: pip install -r scripts/test-requirements.txt")

from integrations.verl import config as tconfig  # noqa: E402
from integrations.verl import reward as R  # noqa: E402
from integrations.verl.session import close_clients  # noqa: E402
from integrations.verl.testing import make_model_dir, serve, verl_config  # noqa: E402
from tangram.service.wire import parse_action  # noqa: E402
from tangram.client import TangramClient  # noqa: E402

pytestmark = pytest.mark.verl

REWARD_PY = Path(R.__file__).resolve()
# the real suite, xdist with the allocated DoP (plugin autoload off: a 10x faster start)
SUITE = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 pytest -p xdist.plugin -q -n ${parallel_num}"
GOOD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
HALF = "```python\ndef add(a, b):\n    return a + b if a >= 0 else 0\n```"
BAD = "def add(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def project():
    """The setup_command writing a tiny real pytest project (the agent must write calc.py)."""
    from integrations.verl.testing import calc_setup_command

    return calc_setup_command()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    d = tmp_path_factory.mktemp("svc")
    # a profile for the suite's class: the scheduler may give it more than one core
    (d / "profiles.json").write_text(json.dumps({"version": 1, "classes": {
        "pytest-calc": {"t1_s": 4.0, "efficiency": {"1": 1.0, "2": 0.95}, "samples": 5}}}))
    (d / "cluster.yaml").write_text(
        "profiles: [profiles.json]\n"
        "gpu_nodes:\n"
        "  - name: g0\n    gpus: 2\n    device: cpu\n    memory_mb_per_gpu: 1024\n"
        "    services:\n      - name: toy-rm\n"
        "        options: {factory: 'integrations.verl.testing:toy_reward_model'}\n")
    with serve(config=str(d / "cluster.yaml")) as url:
        yield url


@pytest.fixture
def settings(service):
    s = tconfig.TangramSettings(enabled=True, url=service, reward_cpu_max=2)
    tconfig.set_active(s)
    yield s
    tconfig.set_active(None)


def _info(project, **kw):
    return {"tangram": {"setup_command": project, "solution_file": "calc.py",
                        "test_command": SUITE, "profile": "pytest-calc",
                        "cpu_max": 2, **kw}}


async def _stats(url):
    async with TangramClient(url) as c:
        return await c.stats()


async def test_compute_score_loaded_by_verl_scores_real_test_runs(settings, project, service, tmp_path):
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = verl_config(make_model_dir(tmp_path / "m"), [
        f"reward.custom_reward_function.path={REWARD_PY}", "reward.custom_reward_function.name=compute_score"])
    fn = get_custom_reward_fn(cfg)
    try:
        good = await fn(data_source="x", solution_str=GOOD, ground_truth=None, extra_info=_info(project))
        assert good["score"] == 1.0 and good["tangram_status"] == "succeeded"
        # elastic: the profile says 2 cores pay off and (on a machine with 2+) both are free
        assert good["tangram_dop"] == float(min(2, len(os.sched_getaffinity(0))))
        assert good["tangram_exec_s"] > 0 and good["tangram_queued_s"] >= 0
        frac = await fn(data_source="x", solution_str=HALF, ground_truth=None,
                        extra_info=_info(project, score="fraction"))
        assert frac["score"] == pytest.approx(2 / 3)
        # one-shot environments are gone with their action
        assert (await _stats(service))["environments"] == 0
    finally:
        await close_clients()


async def test_samples_without_a_tangram_spec_fall_back_to_verl_default_scoring(settings):
    score = await R.compute_score("openai/gsm8k", "... #### 42", "42", extra_info={})
    # verl's default scorer, and the same keys as a tangram-scored sample (verl stacks them per key)
    assert score["score"] == 1.0 and tuple(score) == R.REWARD_KEYS and score["tangram_status"] == "none"


async def test_compute_score_takes_the_service_from_reward_kwargs_and_the_token_from_a_file(
        project, tmp_path, monkeypatch):
    """The reward worker never sees the rollout config: verl hands compute_score its reward_kwargs."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    for var in ("TANGRAM_URL", "TANGRAM_TOKEN", "TANGRAM_TOKEN_FILE", "TANGRAM_ENABLED"):
        monkeypatch.delenv(var, raising=False)
    tconfig.set_active(None)
    info = _info(project)
    del info["tangram"]["profile"]  # a bare service: no profiles
    secret = "s3cr3t-" + os.urandom(4).hex()
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    with serve(token=secret, tmp=tmp_path) as url:
        cfg = verl_config(make_model_dir(tmp_path / "m"), [
            f"reward.custom_reward_function.path={REWARD_PY}", "reward.custom_reward_function.name=compute_score",
            f"+reward.custom_reward_function.reward_kwargs.tangram_url={url}",
            f"+reward.custom_reward_function.reward_kwargs.tangram_token_file={token_file}"])
        from omegaconf import OmegaConf

        assert secret not in OmegaConf.to_yaml(cfg)  # what verl prints holds the path, not the token
        fn = get_custom_reward_fn(cfg)
        try:
            good = await fn(data_source="x", solution_str=GOOD, ground_truth=None, extra_info=info)
            assert good["score"] == 1.0
            # without the token file the service refuses, and the reward says so instead of scoring 0.0
            bad_cfg = verl_config(make_model_dir(tmp_path / "m2"), [
                f"reward.custom_reward_function.path={REWARD_PY}", "reward.custom_reward_function.name=compute_score",
                f"+reward.custom_reward_function.reward_kwargs.tangram_url={url}"])
            with pytest.raises(R.TangramServiceError, match="401") as e:
                await get_custom_reward_fn(bad_cfg)(data_source="x", solution_str=GOOD, ground_truth=None,
                                                    extra_info=info)
            assert url in str(e.value) and secret not in str(e.value)
        finally:
            await close_clients()


async def test_reward_manager_scores_a_batch_concurrently(settings, project, service, tmp_path):
    import numpy as np
    import torch
    from verl.protocol import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    import integrations.verl.reward_manager  # noqa: F401  (registers "tangram"; the plugin does it in real runs)

    model_dir = make_model_dir(tmp_path / "m")
    cfg = verl_config(model_dir, ["reward.reward_manager.name=tangram",
                                  "+actor_rollout_ref.rollout.custom.tangram.enabled=true",
                                  f"+actor_rollout_ref.rollout.custom.tangram.url={service}",
                                  "+actor_rollout_ref.rollout.custom.tangram.reward_cpu_max=2"])
    from integrations.verl.testing import make_tokenizer

    tok = make_tokenizer()
    mgr = load_reward_manager(cfg, tok)
    assert type(mgr).__name__ == "TangramRewardManager"

    def item(text, info):
        p = tok.encode("<|im_start|>user\nwrite add<|im_end|>\n", add_special_tokens=False)
        r = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        resp = torch.tensor([r + [tok.pad_token_id] * 5])
        mask = torch.tensor([[1] * len(p) + [1] * len(r) + [0] * 5])
        return DataProto.from_dict(
            tensors={"prompts": torch.tensor([p]), "responses": resp, "attention_mask": mask},
            non_tensors={"data_source": np.array(["x"], dtype=object),
                         "reward_model": np.array([{"ground_truth": None}], dtype=object),
                         "extra_info": np.array([info], dtype=object)})

    try:
        outs = await asyncio.gather(*[mgr.run_single(item(t, _info(project))) for t in (GOOD, BAD)])
        assert [o["reward_score"] for o in outs] == [1.0, 0.0]
        assert outs[1]["reward_extra_info"]["tangram_status"] == "failed"  # exit code 1: a verdict
        assert all(o["reward_extra_info"]["tangram_dop"] in (1.0, 2.0) for o in outs)
        assert (await _stats(service))["environments"] == 0

        # a reward model on the (virtual) GPU node: one `model` action per sample
        rm = {"tangram": {"model": "toy-rm", "op": "score", "gpu": 1}}
        outs = await asyncio.gather(*[mgr.run_single(item(t, rm)) for t in ("fine.", "great!!", "wow!!!!")])
        assert [o["reward_score"] for o in outs] == [0.0, 2.0, 4.0]
        assert all(o["reward_extra_info"]["tangram_status"] == "succeeded" for o in outs)
        st = await _stats(service)
        assert st["actions"].get("model:succeeded", 0) >= 3
    finally:
        await close_clients()


async def test_reward_errors_raise_naming_the_service_and_the_cause(settings, service):
    try:
        with pytest.raises(R.TangramServiceError, match="unknown model") as e:
            await R.run_reward({"model": "no-such-model"}, settings=settings, solution="x")
        assert service in str(e.value)
    finally:
        await close_clients()


def test_action_bodies_follow_the_wire_contract():
    s = tconfig.TangramSettings(reward_cpu_max=8, reward_timeout_s=300)
    body = R.suite_action({"test_command": "pytest -n ${parallel_num}", "profile": "p", "setup_command": "cp -r /r/. .",
                           "solution_file": "sol.py"}, s, solution=GOOD)
    assert body["kind"] == "exec" and body["resources"] == {"cpu": {"min": 1, "max": 8}} and body["profile"] == "p"
    assert body["command"].endswith("{ pytest -n ${parallel_num} ; }") and "environment" not in body
    assert body["env"]["TANGRAM_SOLUTION"] == "def add(a, b):\n    return a + b\n"
    in_env = R.suite_action({"test_command": "make test", "setup_command": "x", "cpu_max": 1}, s, environment="env-1")
    assert in_env["command"] == "make test" and in_env["environment"] == "env-1" and in_env["resources"]["cpu"] == 1
    assert "restartable" not in body and "restartable" not in in_env
    again = R.suite_action({"test_command": "pytest", "restartable": True}, s, environment="env-1")
    assert again["restartable"] is True
    assert parse_action(again)["restartable"] is True  # what the service accepts
    m = R.model_action({"model": "rm", "gpu": [1, 2], "template": "{prompt}|{response}"}, prompt="p", response="r",
                       ground_truth=None)
    assert m == {"kind": "model", "model": "rm", "op": "score", "inputs": ["p|r"], "resources": {"gpu": [1, 2]}}
    assert R.model_score([[0.5]]) == 0.5 and R.model_score({"scores": [2]}) == 2.0
    assert R.pytest_counts("x\n2 passed, 1 failed in 0.3s\n") == {"passed": 2, "failed": 1}
