"""A small agentic-coding rollout, run for real on this machine.

Each trajectory gets a working directory holding a copy of a real Python
project (``numkit``, shipped with the package), issues a few shell actions
separated by LLM-generation gaps (the LLM is the one fake: a sleep), and ends
with a reward action that runs the project's pytest suite with an elastic
``pytest -n ${parallel_num}``.

Three ways to run the same rollout:

* ``tangram``: every action goes through the scheduler service (real HTTP,
  real local executor, cores pinned per action, elastic DoP for the reward).
* ``ray-tasks`` (:mod:`.ray_tasks`): every action a Ray task with a fixed
  ``num_cpus``, the reward at a fixed DoP.
* ``trajectory``: trajectory-level static allocation, as a pod per
  trajectory: a trajectory first waits for a free slot of ``pod_cores``
  cores, then holds it for its whole life, running every action (reward
  included, at DoP = ``pod_cores``) pinned to it with the same local
  executor.
"""
from __future__ import annotations

import asyncio
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

PROJECT_DIR = Path(__file__).resolve().parent / "project"
REWARD_PROFILE = "numkit-suite"


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    trajectories: int = 3
    turns: int = 3
    gap_s: float = 1.0  # mean LLM generation time between actions
    seed: int = 0
    cores: int = 2
    pod_cores: int = 1
    memory_mb: int = 256


@dataclass(slots=True)
class ActionSample:
    trajectory: int
    kind: str  # "shell" | "reward"
    act_s: float
    queued_s: float
    exec_s: float
    dop: int
    ok: bool


@dataclass(slots=True)
class RolloutResult:
    policy: str
    step_time_s: float
    samples: list[ActionSample] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    setup_s: list[float] = field(default_factory=list)  # creating an environment and copying the project in


def _py() -> str:
    return shlex.quote(sys.executable)


def shell_commands(turns: int) -> list[str]:
    """What an agent does in a repo before submitting: look, read, run, edit."""
    py = _py()
    steps = [
        "ls -R . | head -40",
        "grep -rn 'def ' numkit | head -20",
        f"{py} -c 'import numkit; print(numkit.factorize(360), numkit.gcd(84, 36))'",
        f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {py} -m pytest -q -p no:cacheprovider tests/test_arith.py -k modpow",
        "sed -i 's/^    return out$/    return sorted(out)/' numkit/primes.py && grep -n 'sorted' numkit/primes.py",
        "wc -l numkit/*.py tests/*.py",
    ]
    return [steps[i % len(steps)] for i in range(turns)]


def copy_command() -> str:
    return f"cp -r {shlex.quote(str(PROJECT_DIR))}/. ."


def reward_command() -> str:
    # plugin autoloading off: the project needs only xdist, and whatever else is
    # installed beside the scheduler (hydra, hypothesis, ...) would slow every worker's start
    return f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {_py()} -m pytest -q -p no:cacheprovider -p xdist.plugin -n ${{parallel_num}}"


def gaps(spec: RolloutSpec, trajectory: int) -> list[float]:
    """LLM generation times before each action (seeded, exponential around the mean)."""
    rng = random.Random(spec.seed * 1000 + trajectory)
    return [rng.uniform(0.5, 1.5) * spec.gap_s for _ in range(spec.turns + 1)]


# --------------------------------------------------------------------------- #
# tangram: through the service


async def run_with_service(client, spec: RolloutSpec, progress: Callable[[], None]) -> RolloutResult:
    result = RolloutResult("tangram", 0.0)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        t = time.perf_counter()
        env = await client.create_environment(memory_mb=spec.memory_mb, labels={"trajectory": str(i)})
        try:
            setup = await client.exec(env, copy_command(), cpu=1, timeout_s=60)
            if not setup.ok:
                raise RuntimeError(f"copying the project failed: {setup.stderr}")
            result.setup_s.append(time.perf_counter() - t)
            g = gaps(spec, i)
            for gap, cmd in zip(g, shell_commands(spec.turns)):
                await asyncio.sleep(gap)  # the LLM generates the next action
                await _timed(result, i, "shell", client.exec(env, cmd, cpu=1, timeout_s=120))
                progress()
            await asyncio.sleep(g[-1])
            r = await _timed(result, i, "reward", client.exec(
                env, reward_command(), cpu={"min": 1, "max": spec.cores}, profile=REWARD_PROFILE, timeout_s=600))
            result.rewards.append(1.0 if r.ok else 0.0)
            progress()
        finally:
            await client.delete_environment(env)

    await asyncio.gather(*(one(i) for i in range(spec.trajectories)))
    result.step_time_s = time.perf_counter() - t0
    return result


async def _timed(result: RolloutResult, i: int, kind: str, call):
    t = time.perf_counter()
    r = await call
    act = time.perf_counter() - t
    result.samples.append(ActionSample(
        trajectory=i, kind=kind, act_s=act, queued_s=r.timing.queued_s, exec_s=r.timing.exec_s,
        dop=int((r.allocation or {}).get("dop") or 1), ok=r.ok,
    ))
    return r


# --------------------------------------------------------------------------- #
# trajectory: a pod of fixed cores per trajectory, held for its whole life


async def run_static(executor, spec: RolloutSpec, cores: list[int], progress: Callable[[], None]) -> RolloutResult:
    from tangram.core.model import render_command
    from tangram.executors.base import Placement

    result = RolloutResult("trajectory", 0.0)
    pod_cores = max(1, min(spec.pod_cores, len(cores)))
    slots: asyncio.Queue[tuple[int, ...]] = asyncio.Queue()
    for k in range(len(cores) // pod_cores):
        slots.put_nowait(tuple(cores[k * pod_cores:(k + 1) * pod_cores]))
    t0 = time.perf_counter()

    async def run(env: str, cmd: str, pod: tuple[int, ...], n: int) -> object:
        placement = Placement(action_id=f"{env}-{n}", node="local", dop=len(pod), cores=pod)
        return await executor.exec(env, render_command(cmd, len(pod)), placement, timeout_s=600,
                                   env={"TANGRAM_DOP": str(len(pod))})

    async def provision(i: int) -> tuple[str, tuple[int, ...]]:
        pod = await slots.get()  # pending until a pod slot frees up
        env = f"static-{i}"
        await executor.create_environment(env, memory_mb=spec.memory_mb)
        await run(env, copy_command(), pod, 0)
        return env, pod

    async def one(i: int) -> None:
        # the pod is requested when the trajectory starts, while the LLM writes its first action
        pod_task = asyncio.ensure_future(provision(i))
        env, pod = None, None
        try:
            g = gaps(spec, i)
            for n, (gap, cmd) in enumerate(zip(g, shell_commands(spec.turns)), start=1):
                await asyncio.sleep(gap)
                issued = time.perf_counter()
                if env is None:
                    env, pod = await pod_task
                started = time.perf_counter()
                r = await run(env, cmd, pod, n)
                done = time.perf_counter()
                result.samples.append(ActionSample(i, "shell", done - issued, started - issued, done - started,
                                                   len(pod), r.status == "succeeded"))
                progress()
            await asyncio.sleep(g[-1])
            issued = time.perf_counter()
            if env is None:
                env, pod = await pod_task
            started = time.perf_counter()
            r = await run(env, reward_command(), pod, spec.turns + 1)
            done = time.perf_counter()
            ok = r.status == "succeeded"
            result.samples.append(ActionSample(i, "reward", done - issued, started - issued, done - started,
                                               len(pod), ok))
            result.rewards.append(1.0 if ok else 0.0)
            progress()
        finally:
            if env is None:
                env, pod = await pod_task
            await executor.destroy_environment(env)
            slots.put_nowait(pod)

    await asyncio.gather(*(one(i) for i in range(spec.trajectories)))
    result.step_time_s = time.perf_counter() - t0
    return result
