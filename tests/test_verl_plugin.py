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


def _probe(enabled: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("TANGRAM_ENABLED", "VERL_USE_EXTERNAL_PLUGINS")}
    if enabled:
        env["TANGRAM_ENABLED"] = "1"
    return subprocess.Popen([sys.executable, "-c", PROBE], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_import_verl_registers_the_integration_only_when_enabled():
    on, off = _probe(True), _probe(False)  # both at once: `import verl` takes seconds
    out_on, err_on = on.communicate(timeout=120)
    out_off, err_off = off.communicate(timeout=120)
    assert on.returncode == 0, err_on[-3000:]
    assert "agent_loop {'_target_': 'integrations.verl.agent_loop.TangramAgentLoop'}" in out_on
    assert "reward_manager <class 'integrations.verl.reward_manager.TangramRewardManager'>" in out_on
    assert "INFO integrations.verl: tangram: verl integration registered" in err_on
    assert off.returncode == 0, err_off[-3000:]
    assert "agent_loop None" in out_off and "reward_manager None" in out_off
    assert "integration registered" not in err_off
