"""verl's real AgentLoopWorker.generate_sequences (built without Ray) runs a small
batch through the ``tangram_agent`` loop: a scripted LLM calls the scheduler-backed
sandbox tool over several turns, the final reward is a real pytest suite run with
``pytest -n ${parallel_num}`` in the trajectory's environment on a real
``tangram serve``, and every environment is gone when the batch returns."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl", reason="verl not installed: pip install -r scripts/test-requirements.txt")

from integrations.verl import config as tconfig  # noqa: E402
from integrations.verl.session import REGISTRY, close_clients  # noqa: E402
from integrations.verl.testing import ScriptedLLM, make_model_dir, serve, tool_call, verl_config  # noqa: E402
from tangram.client import TangramClient  # noqa: E402

pytestmark = pytest.mark.verl

EXAMPLES = Path(__file__).resolve().parent.parent / "integrations" / "verl" / "examples"

# the real suite, xdist with the allocated DoP (plugin autoload off: a 10x faster start)
SUITE = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 pytest -p xdist.plugin -q -n ${parallel_num}"
GOOD = "def add(a, b):\n    return a + b\n"
BAD = "def add(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def service():
    with serve() as url:
        yield url


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A tiny real pytest project; the agent must write calc.py."""
    from integrations.verl.testing import calc_project

    return calc_project(tmp_path_factory.mktemp("proj"))


def _script(prompt: str, turn: int) -> str:
    code = GOOD if "task: good" in prompt else BAD
    if turn == 0:
        return "I will write the module. " + tool_call("run_shell", command=f"cat > calc.py <<'PY'\n{code}PY\necho saved")
    if turn == 1:  # the file written in the previous turn is still there
        return tool_call("run_shell", command="python -c 'import calc; print(\"add(2,3) =\", calc.add(2, 3))'")
    return "Done."


async def _stats(url):
    async with TangramClient(url) as c:
        return await c.stats()


def _batch(project: Path, tasks: list[str]):
    from verl.protocol import DataProto

    n = len(tasks)
    spec = {"setup_command": f"cp -r {project}/. .", "test_command": SUITE,
            "cpu_max": 2, "timeout_s": 120}
    nt = {
        "raw_prompt": np.array([[{"role": "user", "content": f"task: {t}. Write calc.add."}] for t in tasks],
                               dtype=object),
        "agent_name": np.array(["tangram_agent"] * n, dtype=object),
        "data_source": np.array(["tangram/test"] * n, dtype=object),
        "reward_model": np.array([{"style": "tangram", "ground_truth": ""} for _ in tasks], dtype=object),
        "extra_info": np.array([{"index": i, "tangram": dict(spec)} for i in range(n)], dtype=object),
        "tools_kwargs": np.array([{} for _ in tasks], dtype=object),
        "index": np.arange(n),
    }
    return DataProto(batch=None, non_tensor_batch=nt, meta_info={"global_steps": 1, "validate": False})


async def test_generate_sequences_end_to_end_through_the_scheduler(service, project, tmp_path, monkeypatch):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    monkeypatch.delenv("TANGRAM_ENABLED", raising=False)
    monkeypatch.delenv("TANGRAM_URL", raising=False)
    tconfig.set_active(None)
    model_dir = make_model_dir(tmp_path / "model")
    cfg = verl_config(model_dir, [
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={EXAMPLES / 'tool_config.yaml'}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={EXAMPLES / 'agent_loop.yaml'}",
        # the one flag (+ where the service is): nothing else says "tangram"
        "+actor_rollout_ref.rollout.custom.tangram.enabled=true",
        f"+actor_rollout_ref.rollout.custom.tangram.url={service}",
        "+actor_rollout_ref.rollout.custom.tangram.reward_cpu_max=2",
    ])
    worker = AgentLoopWorker(cfg, llm_client=None)
    llm = ScriptedLLM(worker.tokenizer, _script)
    worker.llm_client = llm
    try:
        out = await worker.generate_sequences(_batch(project, ["good", "bad"]))

        # rewards from the real test runs: the good trajectories pass, the bad one fails
        scores = out.batch["rm_scores"].sum(dim=-1).tolist()
        assert scores == [1.0, 0.0]
        assert list(out.non_tensor_batch["score"]) == [1.0, 0.0]

        # state persisted across turns: turn 2's tool output came from turn 1's file
        later = [p for _, p in llm.calls if "add(2,3) =" in p]
        assert any("add(2,3) = 5" in p for p in later) and any("add(2,3) = -1" in p for p in later)
        assert len({rid for rid, _ in llm.calls}) == 2  # one request id per trajectory

        # per-trajectory timings of every action (2 tool calls + setup + reward)
        nt = out.non_tensor_batch
        assert list(nt["tangram_actions"]) == [4.0, 4.0]
        for trace in nt["tangram_trace"]:
            assert [r["name"] for r in trace] == ["setup", "run_shell", "run_shell", "reward"]
            assert all(r["status"] == "succeeded" for r in trace[:3])
            assert all(r["queued_s"] >= 0 and r["exec_s"] > 0 and r["overhead_s"] >= 0 for r in trace)
        assert all(x > 0 for x in nt["tangram_total_exec_s"]) and list(nt["tangram_failed_actions"]) == [0.0, 1.0]
        assert all(m["compute_score"] > 0 for m in out.meta_info["metrics"])
        assert set(nt["tangram_dop"]) <= {1.0, 2.0}  # the reward's DoP (reward_extra_info)
        assert list(nt["tangram_status"]) == ["succeeded", "failed"]

        # environments were released at trajectory end, not per call
        st = await _stats(service)
        assert st["environments"] == 0 and st["running"] == 0
        assert REGISTRY.live_environments() == {}
        assert st["actions"].get("exec:succeeded", 0) >= 2 * 4 - 1  # the bad suite's exec "fails" (exit 1)
    finally:
        for k in REGISTRY.keys():
            await REGISTRY.release(k)
        await close_clients()
        tconfig.set_active(None)


async def test_agent_loop_releases_the_environment_when_the_trajectory_fails(service, project, tmp_path):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    tconfig.set_active(None)
    cfg = verl_config(make_model_dir(tmp_path / "model"), [
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={EXAMPLES / 'tool_config.yaml'}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={EXAMPLES / 'agent_loop.yaml'}",
        "+actor_rollout_ref.rollout.custom.tangram.enabled=true",
        f"+actor_rollout_ref.rollout.custom.tangram.url={service}",
    ])
    worker = AgentLoopWorker(cfg, llm_client=None)

    def script(prompt, turn):
        if turn == 0:
            return tool_call("run_shell", command="echo hi > x")
        raise RuntimeError("the LLM server went away")

    worker.llm_client = ScriptedLLM(worker.tokenizer, script)
    try:
        with pytest.raises(RuntimeError, match="went away"):
            await worker.generate_sequences(_batch(project, ["good"]))
        assert (await _stats(service))["environments"] == 0
        assert REGISTRY.live_environments() == {}
    finally:
        await close_clients()
        tconfig.set_active(None)
