"""The ``verl.plugins`` entry point: ``import verl`` registers the integration
(agent loop ``tangram_agent``, reward manager ``tangram``) when TANGRAM_ENABLED=1,
logs it at INFO, and stays out of the way otherwise. Each case is a fresh process,
as in a Ray worker."""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl not installed: pip install -r scripts/test-requirements.txt")

pytestmark = pytest.mark.verl

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
import verl
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
print("agent_loop", _agent_loop_registry.get("tangram_agent"))
print("reward_manager", REWARD_MANAGER.get("tangram"))
"""


def test_entry_point_is_declared_in_the_installed_metadata():
    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("tangram") == "integrations.verl.plugin", (
        f"verl.plugins entry points: {eps} (reinstall: pip install -e .)")


def test_import_verl_registers_the_integration_when_enabled():
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    env["TANGRAM_ENABLED"] = "1"
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, text=True, capture_output=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "agent_loop {'_target_': 'integrations.verl.agent_loop.TangramAgentLoop'}" in proc.stdout
    assert "reward_manager <class 'integrations.verl.reward_manager.TangramRewardManager'>" in proc.stdout
    assert "INFO integrations.verl: tangram: verl integration registered" in proc.stderr


def test_plugin_does_nothing_when_not_enabled(monkeypatch, caplog):
    import importlib

    import integrations.verl as iv
    import integrations.verl.plugin as plugin

    monkeypatch.delenv("TANGRAM_ENABLED", raising=False)
    calls = []
    monkeypatch.setattr(iv, "register", lambda: calls.append(1))
    with caplog.at_level("INFO", logger="integrations.verl"):
        importlib.reload(plugin)
    assert plugin.REGISTERED is False and calls == []
    assert not [r for r in caplog.records if r.levelname == "INFO"]
    monkeypatch.setenv("TANGRAM_ENABLED", "true")
    importlib.reload(plugin)
    assert plugin.REGISTERED is True and calls == [1]


def test_flag_on_the_driver_command_line_registers_and_tells_child_processes(monkeypatch):
    import importlib

    import integrations.verl as iv
    import integrations.verl.plugin as plugin

    monkeypatch.delenv("TANGRAM_ENABLED", raising=False)
    calls = []
    monkeypatch.setattr(iv, "register", lambda: calls.append(1))
    monkeypatch.setattr(sys, "argv", ["main_ppo.py", "+actor_rollout_ref.rollout.custom.tangram.enabled=true"])
    try:
        importlib.reload(plugin)
        assert plugin.REGISTERED is True and calls == [1]
        assert os.environ.get("TANGRAM_ENABLED") == "1"
    finally:
        os.environ.pop("TANGRAM_ENABLED", None)
    assert not plugin.flag_in_argv(["+actor_rollout_ref.rollout.custom.tangram.enabled=false"])
    assert plugin.flag_in_argv(["+tangram.enabled=True"])


def test_run_script_overrides_compose_into_a_valid_verl_config(tmp_path, monkeypatch):
    """Run examples/run_grpo_tangram.sh with a fake python3 that records its arguments,
    then compose verl's real config with them: the flag and the paths must all hold."""
    import json

    from integrations.verl.config import settings_from_config
    from integrations.verl.testing import make_model_dir, verl_config

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    (fake / "python3").chmod(0o755)
    out = tmp_path / "args.txt"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "ARGS_OUT": str(out),
           "TANGRAM_URL": "http://10.0.0.5:8471", "TANGRAM_TOKEN_FILE": "/shared/tangram/token"}
    script = REPO / "integrations" / "verl" / "examples" / "run_grpo_tangram.sh"
    subprocess.run(["bash", str(script), "trainer.total_epochs=1"], env=env, check=True, timeout=60)
    args = out.read_text().splitlines()
    assert args[:2] == ["-m", "verl.trainer.main_ppo"] and args[-1] == "trainer.total_epochs=1"
    overrides = [a for a in args[2:] if not a.startswith("actor_rollout_ref.model.path=")]
    cfg = verl_config(make_model_dir(tmp_path / "m"), overrides)
    s = settings_from_config(cfg)
    assert (s.enabled, s.url, s.token_file, s.token, s.reward_cpu_max) == (
        True, "http://10.0.0.5:8471", "/shared/tangram/token", None, 8)
    env_vars = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert env_vars.TANGRAM_ENABLED == "1" and env_vars.TANGRAM_TOKEN_FILE == "/shared/tangram/token"
    assert cfg.actor_rollout_ref.rollout.multi_turn.max_tool_response_length >= 8000
    assert Path(cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path).is_file()
    assert Path(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path).is_file()
    assert cfg.reward.reward_manager.name == "tangram"
    # verl's own dataclass conversion accepts the rollout section with the custom block
    from verl.utils.config import omega_conf_to_dataclass

    rc = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert rc.custom["tangram"]["enabled"] is True
    json.dumps(rc.custom)  # plain data


def test_a_validation_logged_on_its_own_gets_its_own_tangram_metrics():
    """verl logs the validation before training on its own (no training/global_step): its actions go
    into that log as val-tangram/*, not into the first training step's tangram/* metrics."""
    from verl.utils.tracking import Tracking

    from integrations.verl import metrics

    metrics.install_logger_hook()
    metrics.drain()  # what earlier tests of this process left
    metrics.publish([{"exec_s": 1.0, "queued_s": 0.5, "overhead_s": 0.1, "dop": 2}])
    val = {"val-core/x/acc/mean@1": 0.5}
    Tracking("p", "e", default_backend=[]).log(data=val, step=0)
    assert val["val-tangram/actions"] == 1 and val["val-tangram/exec_mean_s"] == 1.0
    step = {"training/global_step": 1}
    Tracking("p", "e", default_backend=[]).log(data=step, step=1)
    assert step["tangram/actions"] == 0
    other = {"perf/throughput": 1.0}  # any other log is left alone
    Tracking("p", "e", default_backend=[]).log(data=other, step=1)
    assert other == {"perf/throughput": 1.0}


async def test_a_sample_verls_scorer_scores_still_counts_its_rollouts_tool_calls():
    """A sample without a tangram reward (verl's scorer scores it) ran its tool calls through tangram: they
    count into the step's tangram/* metrics, once; a sample tangram scored publishes its own."""
    from integrations.verl import metrics
    from integrations.verl.config import TangramSettings
    from integrations.verl.reward import settle_unscored

    metrics.drain()
    trace = [{"kind": "exec", "name": "shell", "exec_s": 2.0, "queued_s": 0.5, "overhead_s": 0.1, "dop": 1}] * 3

    async def verl_scores():
        return {"score": 1.0, "acc": 1.0}

    got = await settle_unscored({"tangram_trace": trace}, TangramSettings(), verl_scores())
    assert got["score"] == 1.0
    assert metrics.drain()["tangram/actions"] == 3

    async def tangram_scored():
        return {"score": 1.0, "tangram_status": "succeeded"}

    await settle_unscored({"tangram_trace": trace}, TangramSettings(), tangram_scored())
    assert metrics.drain()["tangram/actions"] == 0  # counted by tangram's own reward path instead
