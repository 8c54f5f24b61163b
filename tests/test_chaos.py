"""Short runs of the fault suite (``scripts/chaos.py``) during a real rollout: service SIGKILLs and action
cancels (local sandbox), and the same plus kills of the service's Docker Engine (a private engine the suite
starts and removes: the whole engine crashed, and dockerd alone SIGKILLed while its containerd and containers
live on); no action lost, nothing run twice, files kept across restarts, nothing leaked. Faults come at seeded
action counts, so each kind is injected however loaded the machine is."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def _chaos(*args: str) -> tuple[dict, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "scripts/chaos.py", "--json", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=280)
    assert p.stdout, p.stderr[-3000:]
    return json.loads(p.stdout), p.returncode


def _clean(report: dict) -> None:
    assert report["actions_lost"] == 0 and report["double_runs"] == 0, report
    assert report["files_kept"] is True and report["leaks"] == 0, report


def test_short_chaos_run_loses_and_leaks_nothing():
    report, rc = _chaos("--executor", "local", "--envs", "2", "--steps", "5", "--max-faults", "4", "--seed", "1")
    assert report["faults_injected"] == 4, report
    assert report["faults"]["service_sigkill"] >= 1 and report["faults"]["action_cancel"] >= 1, report
    _clean(report)
    assert rc == 0


@pytest.mark.docker
def test_short_chaos_run_with_docker_engine_kills(docker_client):
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        from tests.helpers import missing

        missing("a private Docker Engine", "dockerd, run as root")
    # seed 2's schedule: service kill, dockerd kill, engine crash, cancel (by action count). dockerd is killed
    # before the crash, when no container start is pending: a dockerd 20.10 killed inside a container start
    # leaves a containerd task it cannot take over (docs/security.md), which this short run does not test
    report, rc = _chaos("--executor", "docker", "--envs", "2", "--steps", "4", "--max-faults", "4", "--seed", "2")
    faults = report["faults"]
    for kind in ("engine_crash", "engine_sigkill", "service_sigkill", "action_cancel"):
        assert faults.get(kind, 0) == 1, report  # each kind once, whatever the machine's load
    phase = report["phases"][0]
    assert phase["answers"].get("failed/retryable", 0) >= 1, report  # in-flight actions were told, not lost
    assert phase["containers_seen"] >= 2, report  # the leak check looked at real containers
    assert phase["leak_detail"]["engine_processes_after_removal"] == [], report  # containerd included
    _clean(report)
    assert rc == 0
