"""The Ray fixtures' clean-up: a temp root is removed only after every process that used it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import processes_using, stop_ray_and_remove

# a parent naming the dir and a child that does not (as the raylet and its workers);
# the child writes into the dir once its parent is gone, as an exiting worker does
SCRIPT = """
import os, subprocess, sys, time
root = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c",
    "import os, sys, time\\nwhile os.getppid() == int(sys.argv[1]): time.sleep(0.05)\\n"
    "time.sleep(0.3)\\nos.makedirs(sys.argv[2] + '/session/logs', exist_ok=True)",
    str(os.getpid()), root])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_waits_for_every_user_of_the_root_before_removing_it(tmp_path):
    root = str(tmp_path / "raylike")
    os.makedirs(root)
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT, root], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert {parent.pid, child} <= {pid for pid, _ in processes_using(root)}

    stop_ray_and_remove(root, lambda: (parent.kill(), parent.wait()))

    assert not os.path.exists(root)  # the child's late write came before the removal
    assert _running(child) is False


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_process_that_outlives_the_timeout_is_reported(tmp_path):
    root = str(tmp_path / "stuck")
    os.makedirs(root)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", root])
    try:
        with pytest.raises(AssertionError, match=str(proc.pid)):
            stop_ray_and_remove(root, lambda: None, timeout_s=0.3)
    finally:
        proc.kill()
        proc.wait()


def test_a_shutdown_that_fails_still_removes_the_root(tmp_path):
    root = tmp_path / "failed"
    (root / "session").mkdir(parents=True)

    def shutdown():
        raise RuntimeError("ray.shutdown failed")

    with pytest.raises(RuntimeError, match="ray.shutdown failed"):
        stop_ray_and_remove(str(root), shutdown)
    assert not root.exists()
