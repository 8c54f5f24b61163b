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
