"""The rollout as a verl user on Ray would write it: every action a Ray task.

Each shell action is a task with ``num_cpus=1``, the reward a task with a fixed
``num_cpus`` running ``pytest -n`` at that same fixed DoP, each trajectory's
environment a working directory the tasks run in. Ray queues a task until its
CPUs are free (it accounts CPUs, it does not pin them). One local Ray instance
(as many CPUs as the demo's cores) serves every repeat; its state lives in a
temp dir removed at close.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from tangram.core.model import render_command
from tangram.demo.rollout import (ActionSample, RolloutResult, RolloutSpec, copy_command, gaps, reward_command,
                                  shell_commands)

INSTALL_HINT = "Ray tasks baseline skipped: ray is not installed (pip install -e '.[ray]' adds it)"


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


# as the pods' actions (tangram: 120 s a shell action, 600 s the reward): past it, killed, and a failed action
ACTION_TIMEOUT_S = 600


def _make_task(ray):
    # defined here, pickled by value: Ray's workers need nothing but the standard library
    def run_action(cwd: str, command: str, dop: int, timeout_s: float = 600) -> tuple[int, float, str]:
        """Run ``command``; a command past ``timeout_s`` is killed (its process group) and fails, exit 124."""
        import os as _os
        import signal
        import subprocess
        import time as _time

        t = _time.perf_counter()
        with subprocess.Popen(["bash", "-c", command], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**_os.environ, "TANGRAM_DOP": str(dop)},
                              start_new_session=True) as proc:
            try:
                _, err = proc.communicate(timeout=timeout_s)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                try:
                    _os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, err = proc.communicate()
                rc, err = 124, (err or "") + f"\ntimed out after {timeout_s} s"
        return rc, _time.perf_counter() - t, (err or "")[-2000:]

    return ray.remote(run_action)


class RayTasks:
    """A local Ray instance for the demo; :meth:`run` one rollout on it."""

    def __init__(self, cores: int, reward_dop: int):
        import ray

        self.ray = ray
        self.reward_dop = max(1, min(reward_dop, cores))
        # short path: Ray's unix sockets live under it
        self.tmp = tempfile.mkdtemp(prefix="tgr-ray-", dir="/tmp" if len(tempfile.gettempdir()) > 40 else None)
        os.makedirs(os.path.join(self.tmp, "ray"))
        # Ray keeps some files in its default dir ($RAY_TMPDIR/ray) whatever _temp_dir says
        self._old_env = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = self.tmp
        try:
            ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False,
                     _temp_dir=os.path.join(self.tmp, "ray"), configure_logging=False)
            self.task = _make_task(ray)
            ray.get(self.task.options(num_cpus=1).remote(self.tmp, "true", 1))  # workers up before timing
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            if self.ray.is_initialized():
                self.ray.shutdown()
        finally:
            if self._old_env is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = self._old_env
            shutil.rmtree(self.tmp, ignore_errors=True)

    async def run(self, spec: RolloutSpec, workdir: Path, progress: Callable[[], None]) -> RolloutResult:
        result = RolloutResult("ray-tasks", 0.0)
        t0 = time.perf_counter()

        async def action(i: int, kind: str, cwd: str, cmd: str, dop: int) -> bool:
            issued = time.perf_counter()
            try:
                rc, exec_s, err = await self.task.options(num_cpus=dop).remote(cwd, cmd, dop, ACTION_TIMEOUT_S)
            except Exception:  # the task itself failed (a worker died, ...): a failed action, not a dead demo
                rc, exec_s = -1, time.perf_counter() - issued
            act = time.perf_counter() - issued
            result.samples.append(ActionSample(i, kind, act, max(0.0, act - exec_s), exec_s, dop, rc == 0))
            return rc == 0

        async def one(i: int) -> None:
            cwd = workdir / f"traj-{i}"
            cwd.mkdir(parents=True)
            try:
                rc, _, err = await self.task.options(num_cpus=1).remote(str(cwd), copy_command(), 1)
                if rc != 0:
                    raise RuntimeError(f"copying the project failed: {err}")
                g = gaps(spec, i)
                for gap, cmd in zip(g, shell_commands(spec.turns)):
                    await asyncio.sleep(gap)  # the LLM generates the next action
                    await action(i, "shell", str(cwd), cmd, 1)
                    progress()
                await asyncio.sleep(g[-1])
                cmd = render_command(reward_command(), self.reward_dop)
                ok = await action(i, "reward", str(cwd), cmd, self.reward_dop)
                result.rewards.append(1.0 if ok else 0.0)
                progress()
            finally:
                shutil.rmtree(cwd, ignore_errors=True)

        await asyncio.gather(*(one(i) for i in range(spec.trajectories)))
        result.step_time_s = time.perf_counter() - t0
        return result
