"""A minimal pinned executor, used only when ``tangram.executors.local`` is absent.

It honours the :class:`~tangram.executors.base.EnvironmentExecutor` contract
with the smallest mechanism that really pins: ``sched_setaffinity`` on the
placement's cores in the child before ``exec`` (inherited by every process
the command starts, e.g. pytest-xdist workers). Environments are temporary
directories; the process group is killed on timeout or cancellation.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from typing import Mapping

from tangram.executors.base import CANCELLED, FAILED, SUCCEEDED, TIMEOUT, EnvironmentExecutor, ExecResult, Placement


class PinnedSubprocessExecutor(EnvironmentExecutor):
    name = "subprocess"

    def __init__(self, root: str | None = None):
        self._root = root
        self._envs: dict[str, str] = {}

    async def create_environment(self, env_id, *, image=None, memory_mb=0, labels=None) -> None:
        if image:
            raise ValueError("the subprocess executor cannot run images; use the docker executor")
        if env_id not in self._envs:
            self._envs[env_id] = tempfile.mkdtemp(prefix=f"tangram-{env_id}-", dir=self._root)

    async def destroy_environment(self, env_id) -> None:
        path = self._envs.pop(env_id, None)
        if path:
            shutil.rmtree(path, ignore_errors=True)

    async def exec(self, env_id: str, command: str, placement: Placement, *, timeout_s: float | None = None,
                   env: Mapping[str, str] | None = None) -> ExecResult:
        cwd = self._envs.get(env_id)
        if cwd is None:
            raise KeyError(f"unknown environment {env_id!r}")
        cores = set(placement.cores)

        def pin() -> None:
            os.setsid()
            if cores:
                os.sched_setaffinity(0, cores)

        full_env = {**os.environ, "TANGRAM_DOP": str(placement.dop), **(env or {})}
        proc = await asyncio.create_subprocess_exec(
            "/bin/bash", "-c", command, cwd=cwd, env=full_env, preexec_fn=pin,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except asyncio.TimeoutError:
            await _kill(proc)
            return ExecResult(TIMEOUT, None, error=f"timed out after {timeout_s} s")
        except asyncio.CancelledError:
            await _kill(proc)
            raise
        status = SUCCEEDED if proc.returncode == 0 else FAILED
        return ExecResult(status, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"),
                          error=None if status == SUCCEEDED else f"exit code {proc.returncode}",
                          isolation="sched_setaffinity", details={"cores": sorted(cores)})

    async def close(self) -> None:
        for env_id in list(self._envs):
            await self.destroy_environment(env_id)


async def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    await proc.wait()


__all__ = ["PinnedSubprocessExecutor", "CANCELLED"]
