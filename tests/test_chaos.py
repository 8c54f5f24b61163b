"""A short run of the fault suite (``scripts/chaos.py``): service SIGKILLs and action cancels during a real
rollout; no action lost, nothing run twice, files kept across restarts, nothing leaked."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def test_short_chaos_run_loses_and_leaks_nothing():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "scripts/chaos.py", "--json", "--envs", "2", "--steps", "5",
                        "--max-faults", "4", "--seed", "1"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=280)
    report = json.loads(p.stdout)
    assert report["faults_injected"] >= 2 and report["faults"]["service_sigkill"] >= 1, report
    assert report["actions_lost"] == 0 and report["double_runs"] == 0, report
    assert report["files_kept"] is True and report["leaks"] == 0, report
    assert p.returncode == 0
