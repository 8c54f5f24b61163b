"""MOPD rollout: every trajectory scored by several real teacher models sharing devices.

Teachers (:mod:`tangram.demo.teachers`): SmolLM2-135M-Instruct gives the
per-token log-probabilities of the trajectory's response given its prompt
(``logprobs``); all-MiniLM-L6-v2 scores how close the response stays to the
prompt (``score`` of the pair). Trajectories are FanOutQA dev questions with
a response written from their decompositions and answers (the policy LLM's
text; its generation time, exponential with mean ``gap_s`` and drawn once per
trajectory from ``seed``, is the only simulated part).

Two deployments of the same models:

* ``tangram``: one GPU node with ``devices`` (default 1) devices that each
  hold one teacher at a time (device memory: the largest teacher + a
  margin), so the teachers' states do not fit at once; every teacher action
  takes any device, and the GPU manager evicts and restores on execution;
* ``static``: a server per teacher on a device of its own (one device per
  teacher), its model resident for the whole run (a fixed deployment).

Both are warmed first (each teacher served once, not timed). On a CPU the
"devices" are virtual: they share the same cores and memory, so restore
times and device memory are those of copies in host RAM.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tangram.demo.results import document, percentile, policy_entry
from tangram.demo.search import QA_FILE, QA_PACKAGE, package_file

MARGIN_MB = 32  # device memory beyond the largest teacher: never room for a second one


@dataclass(frozen=True, slots=True)
class MopdSpec:
    trajectories: int = 8
    gap_s: float = 1.0
    seed: int = 0
    devices: int = 1  # shared by all teachers under tangram; static gets one per teacher
    teachers: tuple[str, ...] = ("smollm2", "minilm")


@dataclass(frozen=True, slots=True)
class Trajectory:
    prompt: str
    response: str


def _text(answer: Any) -> str:
    if isinstance(answer, dict):
        return "; ".join(f"{k}: {_text(v)}" for k, v in answer.items())
    if isinstance(answer, (list, tuple)):
        return ", ".join(_text(v) for v in answer)
    return str(answer)


def load_trajectories(n: int) -> list[Trajectory]:
    """FanOutQA dev questions as prompts; their decomposition and answers as the response."""
    raw = json.loads(package_file(QA_PACKAGE, QA_FILE).read_text(encoding="utf-8"))
    out = []
    for q in raw[:n] if n <= len(raw) else [raw[i % len(raw)] for i in range(n)]:
        steps = []

        def walk(nodes: list[dict]) -> None:
            for d in nodes:
                if d.get("decomposition"):
                    walk(d["decomposition"])
                else:
                    steps.append(f"{d['question']} {_text(d.get('answer'))}.")

        walk(q.get("decomposition") or [])
        response = " ".join(["Let me break this down.", *steps, f"So the answer is: {_text(q.get('answer'))}."])
        out.append(Trajectory(f"Question: {q['question']}\nAnswer:", " " + response))
    return out


def teacher_action(teacher: str, t: Trajectory) -> dict[str, Any]:
    if teacher == "smollm2":
        return {"kind": "model", "model": "smollm2", "op": "logprobs", "inputs": [t.prompt], "tokens": [t.response],
                "timeout_s": 600}
    if teacher == "minilm":
        return {"kind": "model", "model": "minilm", "op": "score", "inputs": [[t.prompt, t.response]], "timeout_s": 600}
    raise ValueError(f"teacher: unknown {teacher!r} (smollm2, minilm)")


def gaps(spec: MopdSpec) -> list[float]:
    rng = random.Random(spec.seed)
    return [rng.expovariate(1.0 / spec.gap_s) if spec.gap_s > 0 else 0.0 for _ in range(spec.trajectories)]


@dataclass(slots=True)
class TeacherSample:
    teacher: str
    act_s: float
    exec_s: float
    ok: bool
    value: float | None = None  # mean log-prob (smollm2) or similarity (minilm)


@dataclass(slots=True)
class MopdResult:
    samples: list[TeacherSample] = field(default_factory=list)
    step_time_s: float = 0.0
    restores: int = 0
    restore_s: float = 0.0
    peak_device_mb: int = 0


def _value(teacher: str, output: Any) -> float | None:
    if not output:
        return None
    if teacher == "smollm2":
        lps = output[0]
        return statistics.fmean(lps) if lps else None
    return float(output[0])


async def rollout(clients: dict[str, Any], spec: MopdSpec, trajectories: list[Trajectory],
                  progress: Callable[[], None] = lambda: None) -> MopdResult:
    """Each trajectory, after its generation gap, is scored by every teacher at once (``clients``: per teacher)."""
    result = MopdResult()

    async def score(teacher: str, t: Trajectory) -> TeacherSample:
        t0 = time.monotonic()
        r = await clients[teacher].run_action(teacher_action(teacher, t))
        progress()
        return TeacherSample(teacher, time.monotonic() - t0, r.timing.exec_s, r.ok,
                             _value(teacher, r.output) if r.ok else None)

    async def one(t: Trajectory, gap: float) -> None:
        await asyncio.sleep(gap)
        result.samples.extend(await asyncio.gather(*(score(name, t) for name in spec.teachers)))

    t0 = time.monotonic()
    await asyncio.gather(*(one(t, g) for t, g in zip(trajectories, gaps(spec))))
    result.step_time_s = time.monotonic() - t0
    return result


class _PeakMemory:
    """Samples the device memory the GPU managers' books hold (every ``every_s``)."""

    def __init__(self, managers: list[Any], every_s: float = 0.005):
        self.managers = managers
        self.every_s = every_s
        self.peak = 0

    def used(self) -> int:
        total = 0
        for m in self.managers:
            for pool in m.held():
                c = m.cache(pool)
                total += sum(c.memory_mb_per_gpu - c.free_mb(d) for d in range(c.num_gpus))
        return total

    async def run(self) -> None:
        while True:
            self.peak = max(self.peak, self.used())
            await asyncio.sleep(self.every_s)


def _gpu_totals(managers: list[Any]) -> tuple[int, float]:
    stats = [m.stats() for m in managers]
    return sum(s["restores"] for s in stats), sum(s["restore_s"] for s in stats)


async def _run_deployment(configs: dict[str, Any], spec: MopdSpec, trajectories: list[Trajectory],
                          progress: Callable[[], None]) -> MopdResult:
    """Start one in-process service per config, warm every teacher, run the rollout."""
    from aiohttp import web

    from tangram.client import TangramClient
    from tangram.service.app import RUNTIME_KEY, create_app

    runners, clients, managers = [], {}, []
    by_config: dict[int, Any] = {}
    try:
        for teacher in spec.teachers:
            cfg = configs[teacher]
            if id(cfg) not in by_config:
                app = create_app(cfg)
                runner = web.AppRunner(app)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", 0).start()
                runners.append(runner)
                rt = app[RUNTIME_KEY]
                managers.extend(m for m in rt.engine.managers if hasattr(m, "cache"))
                by_config[id(cfg)] = TangramClient(f"http://127.0.0.1:{runner.addresses[0][1]}")
            clients[teacher] = by_config[id(cfg)]
        for teacher in spec.teachers:  # warm-up: not timed, not counted
            r = await clients[teacher].run_action(teacher_action(teacher, trajectories[0]))
            if not r.ok:
                raise RuntimeError(f"teacher {teacher} failed to warm up: {r.error}")
        restores0, restore_s0 = _gpu_totals(managers)
        peak = _PeakMemory(managers)
        sampler = asyncio.ensure_future(peak.run())
        try:
            result = await rollout(clients, spec, trajectories, progress)
        finally:
            sampler.cancel()
        restores1, restore_s1 = _gpu_totals(managers)
        result.restores, result.restore_s = restores1 - restores0, restore_s1 - restore_s0
        result.peak_device_mb = max(peak.peak, peak.used())
        return result
    finally:
        for c in set(by_config.values()):
            await c.close()
        for r in runners:
            await r.cleanup()


def configs(spec: MopdSpec, state_mb: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Per policy: teacher -> its service's config (one shared config, or one per teacher)."""
    from tangram.service.config import parse_config

    def service(name: str) -> dict:
        return {"name": name, "state_mb": state_mb[name], "options": {"factory": f"tangram.demo.teachers:{name}"}}

    device_mb = max(state_mb[t] for t in spec.teachers) + MARGIN_MB
    shared = parse_config({"cpu_nodes": [], "gpu_nodes": [{
        "name": "shared", "gpus": spec.devices, "device": _device(), "memory_mb_per_gpu": device_mb,
        "services": [service(t) for t in spec.teachers]}]})
    static = {t: parse_config({"cpu_nodes": [], "gpu_nodes": [{
        "name": f"{t}-server", "gpus": 1, "device": _device(), "memory_mb_per_gpu": state_mb[t] + MARGIN_MB,
        "services": [service(t)]}]}) for t in spec.teachers}
    return {"tangram": {t: shared for t in spec.teachers}, "static": static}


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def state_mb(teachers: tuple[str, ...]) -> dict[str, int]:
    """Each teacher's parameter + buffer size, measured on its loaded CPU master copy."""
    from tangram.demo import teachers as t

    out = {}
    for name in teachers:
        module = getattr(t, name)().module
        nbytes = sum(x.numel() * x.element_size() for x in list(module.parameters()) + list(module.buffers()))
        out[name] = max(1, -(-nbytes // 2**20))
    return out


def summarize(r: MopdResult, run_no: int = 0) -> dict[str, Any]:
    acts = [s.act_s for s in r.samples]
    exec_total = sum(s.exec_s for s in r.samples)
    out: dict[str, Any] = {
        "run": run_no,
        "actions": len(acts),
        "mean_act_s": statistics.fmean(acts) if acts else 0.0,
        "p50_act_s": percentile(acts, 50),
        "p99_act_s": percentile(acts, 99),
        "step_time_s": r.step_time_s,
        "restores": r.restores,
        "restore_s": r.restore_s,
        # of the devices' busy time (restore + run), as the simulator's restore_share_of_exec:
        # ``exec_s`` is the model's run alone, and a restore can outlast a short run
        "restore_share": r.restore_s / busy if (busy := r.restore_s + exec_total) > 0 else 0.0,
        "peak_device_mb": r.peak_device_mb,
        "failed": sum(not s.ok for s in r.samples),
    }
    for teacher in sorted({s.teacher for s in r.samples}):
        vals = [s.value for s in r.samples if s.teacher == teacher and s.value is not None]
        out[f"{teacher}_mean_value"] = statistics.fmean(vals) if vals else None
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


COUNTS = ("actions", "restores", "restore_s")  # summed over runs (the rest: medians, results.policy_entry)


def policy_summary(runs: list[MopdResult]) -> dict[str, Any]:
    """The shared demo shape for one policy (tangram.demo.results), counts summed over runs."""
    per_run = [summarize(r, i) for i, r in enumerate(runs)]
    out = policy_entry(per_run, summed=COUNTS)
    del out["run"]
    out["peak_device_mb"] = max(r["peak_device_mb"] for r in per_run)
    return out


async def demo(spec: MopdSpec = MopdSpec(), *, repeats: int = 1, baseline: bool = True,
               progress: Callable[[str, int], Callable[[], None]] | None = None) -> dict[str, Any]:
    """Run the rollout under evict-on-execution, then under static deployment; the demo document."""
    if spec.trajectories < 1 or spec.devices < 1:
        raise ValueError("trajectories and devices must be >= 1")
    trajectories = load_trajectories(spec.trajectories)
    sizes = state_mb(spec.teachers)
    cfgs = configs(spec, sizes)
    total = spec.trajectories * len(spec.teachers)
    tick = (lambda label: progress(label, total)) if progress else (lambda label: (lambda: None))
    policies = ["tangram", "static"] if baseline else ["tangram"]
    runs: dict[str, list[MopdResult]] = {p: [] for p in policies}
    for _ in range(repeats):
        for p in policies:
            runs[p].append(await _run_deployment(cfgs[p], spec, trajectories, tick(f"{p:8}")))
    summary = {p: policy_summary(rs) for p, rs in runs.items()}
    summary["tangram"]["devices"] = spec.devices
    if "static" in summary:
        summary["static"]["devices"] = len(spec.teachers)
    device = _device()
    notes = []
    if device == "cpu":
        notes.append("no CUDA device: the devices are virtual devices on the CPU, sharing its cores and memory; "
                     "restore times and device memory are those of copies in host RAM")
    return document(
        "mopd", summary, reference="tangram",
        projection=None,  # measured on this machine's devices only
        device=device, notes=notes,
        spec={**{k: getattr(spec, k) for k in spec.__dataclass_fields__}, "repeats": repeats,
              "state_mb": sizes, "device_mb": max(sizes.values()) + MARGIN_MB},
    )
