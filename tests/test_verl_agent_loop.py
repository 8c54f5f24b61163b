"""verl's own rollout workers on both of verl's paths, with the reward computed by
verl's own ``RewardLoopWorker`` (the ``tangram`` manager) the way verl streams it:

* legacy (``trainer.use_v1=false``): ``AgentLoopWorker.generate_sequences`` on a DataProto;
* default (``trainer.use_v1=true``): ``AgentLoopWorkerTQ`` putting each sample into a real
  TransferQueue (on a local Ray instance), read back the way the trainer reads it.

Same mixed batch on both, the same rewards expected: ``tangram_agent`` trajectories that edit
files over several turns (the suite runs in the trajectory's own environment), a GSM8K sample
scored by verl's default scorer, a single-turn sample scored in a fresh environment, a
trajectory cut by ``max_assistant_turns`` and one cut by ``response_length`` (the reward scores
exactly the tokens verl kept). An unreachable service or a failed ``setup_command`` raises (the
legacy step fails; the default path marks the prompt's group failed) instead of scoring 0.0.
Environments are all deleted once the rewards ran. Real ``tangram serve``, real pytest suites;
only the LLM is scripted.
"""
from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl", reason="verl not installed: pip install -r scripts/test-requirements.txt")

from integrations.verl import config as tconfig  # noqa: E402
from integrations.verl import metrics as tmetrics  # noqa: E402
from integrations.verl.session import PENDING_DELETES, REGISTRY, TangramServiceError, close_clients  # noqa: E402
from tests.helpers import transfer_queue_session  # noqa: E402
from integrations.verl.testing import (ScriptedLLM, calc_setup_command, make_model_dir, reward_loop_workers,  # noqa: E402
                                       rollout_rows, serve, tool_call, verl_config)
from tangram.client import TangramClient  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parent.parent / "integrations" / "verl" / "examples"
# the real suite, xdist with the allocated DoP (plugin autoload off: a 10x faster start)
SUITE = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 pytest -p xdist.plugin -q -n ${parallel_num}"
GOOD = "def add(a, b):\n    return a + b\n"
BAD = "def add(a, b):\n    return a - b\n"
# past response_length (150 tokens, one per byte) the answer breaks calc.py
TRUNCATED = GOOD + "#" * 300 + "\nraise SystemExit('scored past response_length')\n"


@pytest.fixture(scope="module")
def service():
    with serve() as url:
        yield url


@pytest.fixture(scope="module")
def project():
    """The setup_command that writes the project into a new environment (sandboxes see no host files)."""
    return calc_setup_command()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(autouse=True)
def _clean():
    tconfig.set_active(None)
    tmetrics.drain()
    yield
    tconfig.set_active(None)


def script(prompt: str, turn: int) -> str:
    task = prompt.split("task: ", 1)[1].split(".", 1)[0] if "task: " in prompt else ""
    if task in ("good", "bad", "setup-fails"):
        code = GOOD if task == "good" else BAD
        if turn == 0:
            return "I will write it. " + tool_call("run_shell", command=f"cat > calc.py <<'PY'\n{code}PY\necho saved")
        if turn == 1:  # the file of the previous turn is still there
            return tool_call("run_shell", command="python -c 'import calc; print(\"add(2,3) =\", calc.add(2, 3))'")
        return "Done."
    if task == "gsm8k":
        return "6 * 7 = 42\n#### 42"
    if task in ("oneshot", "one-turn"):
        # one turn allowed: a tool call would never run; the answer is in the code block
        return f"```python\n{GOOD}```" + (tool_call("run_shell", command="ls") if task == "one-turn" else "")
    if task == "truncated":
        return TRUNCATED
    raise AssertionError(f"unexpected prompt {prompt!r}")


def _spec(project, **kw):
    return {"setup_command": project, "test_command": SUITE, "cpu_max": 2, "timeout_s": 120, **kw}


def mixed_rows(project):
    return [
        {"prompt": "task: good. Write calc.add.", "tangram": _spec(project)},
        {"prompt": "task: bad. Write calc.add.", "tangram": _spec(project)},
        {"prompt": "task: gsm8k. What is 6*7?", "agent_name": "single_turn_agent", "data_source": "openai/gsm8k",
         "ground_truth": "42"},
        {"prompt": "task: oneshot. Write calc.add.", "agent_name": "single_turn_agent",
         "tangram": _spec(project, solution_file="calc.py")},
    ]


def limit_rows(project):
    return [
        {"prompt": "task: one-turn. Write calc.add.", "tangram": _spec(project, solution_file="calc.py")},
        {"prompt": "task: truncated. Write calc.add.", "tangram": _spec(project, solution_file="calc.py")},
    ]


def _cfg(model_dir, url, *extra):
    return verl_config(model_dir, [
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={EXAMPLES / 'tool_config.yaml'}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={EXAMPLES / 'agent_loop.yaml'}",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=8000",
        "reward.reward_manager.name=tangram",
        "+actor_rollout_ref.rollout.custom.tangram.enabled=true",
        f"+actor_rollout_ref.rollout.custom.tangram.url={url}",
        "+actor_rollout_ref.rollout.custom.tangram.reward_cpu_max=2",
        *extra])


# ---------------------------------------------------------------------------------------------- #
# the two paths


async def run_legacy(cfg, rows):
    """verl's legacy path: AgentLoopWorker.generate_sequences; rewards streamed to RewardLoopWorker."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto

    import integrations.verl.reward_manager  # noqa: F401  (registers "tangram"; the plugin does it in real runs)

    worker = AgentLoopWorker(cfg, None, None, reward_loop_workers(cfg))
    worker.llm_client = ScriptedLLM(worker.tokenizer, script)
    out = await worker.generate_sequences(DataProto(batch=None, non_tensor_batch=rollout_rows(rows),
                                                    meta_info={"global_steps": 1, "validate": False}))
    keys = out.meta_info["reward_extra_keys"]
    infos = [{k: out.non_tensor_batch[k][i] for k in keys} for i in range(len(rows))]
    return out.batch["rm_scores"].sum(dim=-1).tolist(), infos, worker.llm_client


@pytest.fixture(scope="module")
def transfer_queue():
    with transfer_queue_session("tgv-") as tq:
        yield tq


async def run_v1(tq, cfg, rows):
    """verl's default path: AgentLoopWorkerTQ puts every finished sample into TransferQueue."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.utils import tensordict_utils as tu

    import integrations.verl.reward_manager  # noqa: F401

    worker = AgentLoopWorkerTQ.__ray_actor_class__(cfg, None, None, reward_loop_workers(cfg))
    worker.llm_client = ScriptedLLM(worker.tokenizer, script)
    cols = rollout_rows(rows)
    uids = [f"p{i}-{uuid.uuid4().hex[:8]}" for i in range(len(rows))]
    cols["uid"] = np.array(uids, dtype=object)
    batch = tu.get_tensordict(cols)
    tu.assign_non_tensor_data(batch, "global_steps", 1)
    await worker.generate_sequences(batch)
    while worker.background_tasks:
        await asyncio.wait_for(asyncio.gather(*list(worker.background_tasks), return_exceptions=True), 300)
    tags = (await asyncio.to_thread(tq.kv_list, "train")).get("train", {})
    status = [tags[u]["status"] for u in uids]
    done = [f"{u}_0_0" for u, s in zip(uids, status) if s == "finished"]
    scores, infos = [], []
    if done:
        data = await asyncio.to_thread(tq.kv_batch_get, done, "train", ["rm_scores", "extra_fields"])
        got = {k: (float(r.sum()), f["reward_extra_info"])
               for k, r, f in zip(done, data["rm_scores"].unbind(0), data["extra_fields"])}
        for u in uids:
            s, info = got.get(f"{u}_0_0", (None, None))
            scores.append(s)
            infos.append(info)
    await asyncio.to_thread(tq.kv_clear, list(tags), "train")
    return scores, infos, status, worker.llm_client


async def _environments(url):
    async with TangramClient(url) as c:
        return (await c.stats())["environments"]


def _check_mixed(scores, infos, llm):
    assert scores == [1.0, 0.0, 1.0, 1.0]
    # the same reward keys for every sample, whichever scorer ran
    assert all(set(i) == set(infos[0]) for i in infos) and "tangram_status" in infos[0]
    assert [i["tangram_status"] for i in infos] == ["succeeded", "failed", "none", "succeeded"]
    assert infos[0]["tangram_actions"] == 4.0  # setup, two tool calls, the reward
    assert all(i["tangram_dop"] in (1.0, 2.0) for i in (infos[0], infos[1], infos[3]))
    # files persisted across turns: turn 2 saw turn 1's calc.py
    later = [p for _, p in llm.calls if "add(2,3) =" in p]
    assert any("add(2,3) = 5" in p for p in later) and any("add(2,3) = -1" in p for p in later)


# ---------------------------------------------------------------------------------------------- #


async def test_legacy_path_mixed_batch_and_limits(service, project, model_dir):
    try:
        scores, infos, llm = await run_legacy(_cfg(model_dir, service), mixed_rows(project))
        _check_mixed(scores, infos, llm)
        m = tmetrics.drain()
        assert m["tangram/actions"] == 4 + 4 + 2 and m["tangram/failed"] == 0
        assert m["tangram/act_mean_s"] > 0 and m["tangram/queue_mean_s"] >= 0 and m["tangram/dop_mean"] >= 1
        # ACT as the service counts it: queueing + execution + overhead
        assert m["tangram/act_mean_s"] == pytest.approx(
            m["tangram/queue_mean_s"] + m["tangram/exec_mean_s"] + m["tangram/overhead_mean_s"])

        cfg = _cfg(model_dir, service, "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=1",
                   "actor_rollout_ref.rollout.response_length=150")
        scores, infos, _ = await run_legacy(cfg, limit_rows(project))
        assert scores == [1.0, 1.0]  # the last turn verl kept, not the previous one / the cut-off tail
        assert await _environments(service) == 0 and REGISTRY.live_environments() == {} and not PENDING_DELETES
    finally:
        await close_clients()


async def test_legacy_path_with_verl_naive_manager_and_compute_score(service, project, model_dir, monkeypatch):
    """The same rewards when verl's own `naive` manager calls the async compute_score (it merges the
    rollout's extra_fields into extra_info: the last turn and the environment travel there).
    That reward_kwargs alone carry the service is checked in test_verl_reward.py."""
    reward_py = Path(__file__).resolve().parent.parent / "integrations" / "verl" / "reward.py"
    monkeypatch.delenv("TANGRAM_URL", raising=False)
    cfg = _cfg(model_dir, service, "reward.reward_manager.name=naive",
               f"reward.custom_reward_function.path={reward_py}", "reward.custom_reward_function.name=compute_score",
               f"+reward.custom_reward_function.reward_kwargs.tangram_url={service}")
    try:
        scores, infos, llm = await run_legacy(cfg, mixed_rows(project))
        _check_mixed(scores, infos, llm)
        assert await _environments(service) == 0
    finally:
        await close_clients()


async def test_v1_path_mixed_batch_and_limits(service, project, model_dir, transfer_queue):
    try:
        scores, infos, status, llm = await run_v1(transfer_queue, _cfg(model_dir, service), mixed_rows(project))
        assert status == ["finished"] * 4
        _check_mixed(scores, infos, llm)

        cfg = _cfg(model_dir, service, "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=1",
                   "actor_rollout_ref.rollout.response_length=150")
        scores, _, status, _ = await run_v1(transfer_queue, cfg, limit_rows(project))
        assert status == ["finished"] * 2 and scores == [1.0, 1.0]
        assert await _environments(service) == 0 and REGISTRY.live_environments() == {}
        # through the named Ray actor (a Ray job), drained into verl's own logger's step dict
        from verl.utils.tracking import Tracking

        from integrations.verl.metrics import install_logger_hook

        install_logger_hook()
        step = {"training/global_step": 1}
        Tracking("p", "e", default_backend=[]).log(data=step, step=1)
        assert step["tangram/actions"] == 10 + 4 and step["tangram/failed"] == 0 and step["tangram/act_mean_s"] > 0
    finally:
        await close_clients()


async def test_unreachable_service_and_failed_setup_fail_loudly(service, project, model_dir, transfer_queue):
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    try:
        cfg = _cfg(model_dir, dead, "+actor_rollout_ref.rollout.custom.tangram.retry_s=1")
        with pytest.raises(TangramServiceError, match=r"127\.0\.0\.1:9.*(cannot reach|failed)"):
            await run_legacy(cfg, mixed_rows(project)[:1])
        _, _, status, _ = await run_v1(transfer_queue, cfg, mixed_rows(project)[:1])
        assert status == ["failure"]  # verl drops the prompt's group instead of training on 0.0
        assert tmetrics.drain()["tangram/failed"] >= 2

        broken = [{"prompt": "task: setup-fails. Write calc.add.", "tangram": _spec(project, setup_command="exit 3")},
                  {"prompt": "task: oneshot. Write calc.add.", "agent_name": "single_turn_agent",
                   "tangram": _spec(project, solution_file="calc.py", setup_command="exit 3")}]
        for row in broken:
            with pytest.raises(TangramServiceError, match="setup_command failed"):
                await run_legacy(_cfg(model_dir, service), [row])
        assert await _environments(service) == 0
    finally:
        await close_clients()
