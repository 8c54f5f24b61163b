"""Discrete-event simulation of rollout steps over the real engine.

The event loop owns a virtual clock and a heap of events:

* ``GEN``    a trajectory's LLM generation finished: submit its next action
* ``FINISH`` an action finished: ``engine.complete`` (frees its units), the
             trajectory starts its next generation
* ``READY``  a trajectory's pod is up (``trajectory`` baseline)
* ``RETRY``  a 429'd API call tries again (``api-naive`` baseline)
* ``TICK``   a quota period refilled, or a warm start's load ended: ``engine.tick``

Every ``Started`` the engine returns is "executed" by drawing nothing new: each trajectory's
script (turns, generation gaps, action classes, true single-unit durations) is drawn up front from
its own seeded stream, so every policy sees exactly the same work. The execution time at the
allocated DoP is ``T1 / (E(m) * m)`` (plus a GPU restore or an environment start when they
happen). The scheduler only knows profiled classes' mean ``T1``.
"""
from __future__ import annotations

import heapq
import math
import random
from typing import Any

import numpy as np

from tangram.core.engine import Engine
from tangram.core.grants import restore_seconds
from tangram.core.model import Action, Demand
from tangram.simulator.bounds import memory_script
from tangram.simulator.collections_deferred import full_collections_deferred
from tangram.simulator.errors import WorkloadError
from tangram.managers.basic import ADAPTIVE, FIXED, ApiLimit, BasicManager
from tangram.managers.gpu import GpuManager, GpuNode, ModelSpec
from tangram.simulator.managers import CachedCountingManager, SimGpuManager
from tangram.simulator.policies import PolicySpec, policy_spec
from tangram.simulator.summary import summarize
from tangram.simulator.warm import WarmStart
from tangram.simulator.records import SimResult, _Item, _Rec, _Traj
from tangram.simulator.replicas import jitter_stream, perturb_generation
from tangram.simulator.workload import MEM_FRACTION, ActionClass, Workload

GEN, FINISH, READY, RETRY, TICK = range(5)
POD_CLASS = "pod"


def _true_duration(cls: ActionClass, t1: float, m: int) -> float:
    if cls.elasticity is None:
        return t1
    return cls.elasticity.duration(t1, m)


class Simulation:
    def __init__(self, workload: Workload, policy: str | PolicySpec, *, seed: int = 0, check: bool = False,
                 replica: int = 0):
        self.wl = workload
        self.spec = policy if isinstance(policy, PolicySpec) else policy_spec(policy)
        self.seed, self.replica = seed, replica  # replica 0: the seed's own run; r > 0: its timing moved
        self.check = check
        self.now = 0.0
        self._heap: list = []
        self._stale: set[tuple[str, float]] = set()  # (action, due) of FINISH events a restart voided
        self._seq = 0
        self._recs: dict[str, _Rec] = {}
        self.done: list[_Rec] = []
        self._rng = jitter_stream(seed, replica)
        self._ticks: set[float] = set()
        self._creating = 0
        self._static: dict[str, tuple[int, int]] = dict(workload.baselines.static)
        c = workload.cluster
        self.capacity: dict[str, int] = {}
        self.reserved: dict[str, float] = {}
        self.busy: dict[str, float] = {}
        self.step_times: list[float] = []
        self.lb_step: list[float] = []  # per step: the longest trajectory's lower bound
        # per step: (releases, holds, step start) of the trajectories that reserve memory (bounds.memory_*)
        self.mem_scripts: list[tuple[list[float], list[float], float]] = []
        self.job_step_times: dict[str, list[float]] = {j.name: [] for j in workload.jobs}
        self._dops: dict[tuple, np.ndarray] = {}
        self._build_engine(c)
        self._server = {p.name: [p.concurrency, p.quota, p.period_s, 0, -1, 0] for p in c.api}  # naive API server
        self._warm = WarmStart(self, TICK) if self.spec.gpu_warm and self._real_gpu else None

    # ------------------------------------------------------------------ #
    # setup

    def _build_engine(self, c) -> None:
        clock = lambda: self.now  # noqa: E731
        managers = []
        caps = {}
        for i in range(c.cpu_nodes):
            caps[f"cpu@c{i}"] = c.cores_per_node
            caps[f"mem@c{i}"] = int(c.mem_gb_per_node * 1024)
        if c.cpu_nodes:
            self.capacity["cpu"] = c.total_cores
            self.capacity["mem"] = int(c.mem_gb_per_node * 1024) * c.cpu_nodes  # MiB
        uses_gpu = any(cl.rtype == "gpu" for j in self.wl.jobs for cl in j.actions + j.rewards)
        if self.spec.gpu_mode == "static" and uses_gpu:
            for cl_svc in sorted({s for j in self.wl.jobs for cl in j.actions + j.rewards if cl.rtype == "gpu" for s in cl.services}):
                if cl_svc not in self._static:
                    raise WorkloadError(f"baselines.static_services.{cl_svc}", "static-services needs {dop, replicas} for every GPU service")
                dop, rep = self._static[cl_svc]
                caps[f"api:static.{cl_svc}"] = rep
            self.capacity["gpu"] = sum(d * r for d, r in self._static.values())
            if self.capacity["gpu"] > c.total_gpus:
                raise WorkloadError("baselines.static_services",
                                    f"dedicates {self.capacity['gpu']} GPUs, the cluster has {c.total_gpus}")
        if self.spec.cpu_mode == "pod" and c.cpu_nodes:  # a pod runs each of its actions on its own cores
            need = max((cl.demand.min for j in self.wl.jobs for cl in j.actions + j.rewards if cl.rtype == "cpu"),
                       default=1)
            if not need <= self.wl.baselines.pod_cores <= c.cores_per_node:
                raise WorkloadError("baselines.trajectory.pod_cores", f"a pod must hold every CPU action ({need} "
                                    f"cores) on one node ({c.cores_per_node}), got {self.wl.baselines.pod_cores}")
        managers.append(CachedCountingManager(caps))
        self.gpu = None
        self._real_gpu = False
        if c.gpu_nodes and uses_gpu and self.spec.gpu_mode == "serverless":
            self.gpu = SimGpuManager(
                {f"gpu@g{i}": c.gpus_per_node for i in range(c.gpu_nodes)},
                gpu_mem_gb=c.gpu_mem_gb, sizes_gb={n: s.size_gb for n, s in self.wl.services.items()},
                restore_gbps=self.wl.baselines.serverless_load_gbps,
                clock=clock, exclusive=True, affinity=False,
            )
        elif c.gpu_nodes and uses_gpu and self.spec.gpu_mode == "eoe":
            # the real evict-on-execution manager (buddy chunks + LRU service cache)
            mem_mb = int(c.gpu_mem_gb * 1024 * MEM_FRACTION)
            self.gpu = GpuManager(
                [GpuNode(f"g{i}", c.gpus_per_node, mem_mb) for i in range(c.gpu_nodes)],
                [ModelSpec(n, state_mb=int(math.ceil(s.size_gb * 1024)), sharded=True) for n, s in self.wl.services.items()],
            )
            self._real_gpu = True
        if self.gpu is not None:
            managers.append(self.gpu)
            self.capacity["gpu"] = c.total_gpus
        api = {}
        for p in c.api:
            if self.spec.api_mode == "naive":
                api[f"api:{p.name}"] = ApiLimit(concurrency=10**9)
            else:
                api[f"api:{p.name}"] = ApiLimit(concurrency=p.concurrency, quota=p.quota,
                                               period_s=p.period_s if p.quota is not None else None, window=FIXED,
                                               arrival_margin_s=p.arrival_margin_s if p.quota is not None else None,
                                               books=p.books if p.quota is not None else ADAPTIVE)
            self.capacity[f"api:{p.name}"] = p.concurrency if p.concurrency is not None else p.quota
        self._has_quota = any(lim.quota is not None for lim in api.values())
        if api:
            managers.append(BasicManager(api, clock=clock))
        self.engine = Engine(managers, clock=clock, params=self.spec.params, policy=self.spec.plan, keep_finished=256)
        for k in self.capacity:
            self.reserved[k] = 0.0
            self.busy[k] = 0.0

    def _scripts(self, step: int) -> list[_Traj]:
        trajs = []
        for job in self.wl.jobs:
            actions = job.actions
            weights = [a.weight for a in actions]
            for t in range(job.trajectories):
                rng = random.Random(f"{self.seed}/{job.name}/{step}/{t}")
                n = job.turns.draw_int(rng) if actions else 0
                tsvc = {}
                items = []
                for _ in range(n):
                    cls = rng.choices(actions, weights)[0] if len(actions) > 1 else actions[0]
                    items.append(self._item(rng, job.generation.draw(rng), cls, tsvc))
                for k, cls in enumerate(job.rewards):
                    items.append(self._item(rng, job.generation.draw(rng) if k == 0 else 0.0, cls, tsvc))
                trajs.append(_Traj(f"{job.name}/s{step}/t{t}", job, items, step))
        return perturb_generation(trajs, self.seed, self.replica)

    def _item(self, rng, gen_s, cls: ActionClass, tsvc) -> _Item:
        svc = None
        if cls.services:
            if cls.name not in tsvc:
                tsvc[cls.name] = cls.services[rng.randrange(len(cls.services))]
            svc = tsvc[cls.name] if cls.kind == "reward" else cls.services[rng.randrange(len(cls.services))]
        t1 = cls.duration.draw(rng)
        if svc is not None:
            t1 *= self.wl.services[svc].t1_scale
        it = _Item(gen_s, cls, t1, svc)
        it.lb, it.work = self._bounds(it)
        return it

    # ------------------------------------------------------------------ #
    # actions

    def _gpu_options(self, cls: ActionClass, svc: str) -> tuple[int, ...]:
        return tuple(m for m in self.wl.gpu_options(svc) if m in cls.demand.options)

    def _feasible_dops(self, it: _Item) -> np.ndarray:
        key = (it.cls.name, it.service)
        opts = self._dops.get(key)
        if opts is None:
            cls = it.cls
            if cls.rtype == "cpu":
                opts = [m for m in cls.demand.options if m <= self.wl.cluster.cores_per_node] or [cls.demand.min]
            elif cls.rtype == "gpu":
                opts = list(self._gpu_options(cls, it.service)) or [cls.demand.min]
            else:
                opts = [cls.demand.min]
            opts = self._dops[key] = np.asarray(opts, dtype=np.float64)
        return opts

    def _bounds(self, it: _Item) -> tuple[float, float]:
        """The action's fastest feasible run (never queued), and the fewest unit-seconds
        it can run in (the pooled bound's job size)."""
        dops = self._feasible_dops(it)
        if it.cls.elasticity is None:  # the same duration at every DoP
            return it.t1, it.t1 * float(dops.min())
        durations = it.cls.elasticity.durations(it.t1, dops)
        return float(durations.min()), float((durations * dops).min())

    def _action(self, rec: _Rec) -> Action:
        it, tr = rec.item, rec.traj
        cls = it.cls
        # a model's requests are a class of their own: their T1 scales with the model (t1_scale)
        name = f"{cls.name}.{it.service}" if it.service else cls.name
        kw: dict[str, Any] = dict(action_class=name, trajectory=tr.id)
        if cls.profiled:
            scale = self.wl.services[it.service].t1_scale if it.service else 1.0
            kw["t1_s"] = cls.duration.mean * scale
            kw["elasticity"] = cls.elasticity
        if cls.rtype == "cpu":
            demands = {"cpu": cls.demand}
            kw["mem_mb"] = tr.job.memory_mb
            kw["restartable"] = cls.restartable
        elif cls.rtype == "gpu":
            kw["service"] = it.service
            if self.spec.gpu_mode == "static":
                demands = {f"api:static.{it.service}": Demand.fixed(1)}
                kw["action_class"] = f"{cls.name}.{it.service}"
            elif self.spec.gpu_mode == "serverless":
                demands = {"gpu": Demand.fixed(self._serverless_dop(cls, it.service))}
            else:
                opts = self._gpu_options(cls, it.service)
                demands = {"gpu": Demand.choices(opts)}
                # what a miss costs at each DoP, as the service cache restores it (sharded state)
                size_mb = math.ceil(self.wl.services[it.service].size_gb * 1024)
                kw["restore_s"] = {m: restore_seconds(math.ceil(size_mb / m), self.wl.cluster.restore_gbps)
                                   for m in opts}
        else:
            demands = {cls.rtype: cls.demand}
            kw["payload"] = {"kind": "http"}  # the API call itself (the quota books' guess applies)
        return Action.build(rec.id, demands, **kw)

    def _serverless_dop(self, cls: ActionClass, svc: str) -> int:
        opts = self._gpu_options(cls, svc)  # the DoPs its weights fit, fewest first
        if not self.spec.serverless_fewest and svc in self._static and self._static[svc][0] in opts:
            return self._static[svc][0]
        return opts[0]

    # ------------------------------------------------------------------ #
    # event loop

    def _push(self, t: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj))

    def run(self) -> SimResult:
        with full_collections_deferred():  # see collections_deferred.py: ~10% of a large run
            return self._run()

    def _run(self) -> SimResult:
        step_start = 0.0
        for step in range(self.wl.steps):
            trajs = self._scripts(step)
            self._left = len(trajs)
            self._lb_steps = 0.0
            self.mem_scripts.append(([], [], step_start))
            for tr in trajs:
                self._lb_steps = max(self._lb_steps, sum(i.gen_s + i.lb for i in tr.items))
                if tr.job.memory_mb and (script := memory_script(tr.items, step_start)) is not None:
                    self.mem_scripts[-1][0].append(script[0])
                    self.mem_scripts[-1][1].append(script[1])
                if tr.items:
                    self._push(step_start + tr.items[0].gen_s, GEN, tr)
                else:
                    self._left -= 1
            self._loop()
            end = max((tr.end for tr in trajs), default=step_start)
            self.step_times.append(end - step_start)
            for job in self.wl.jobs:
                ends = [tr.end for tr in trajs if tr.job is job]
                self.job_step_times[job.name].append((max(ends) if ends else step_start) - step_start)
            self.lb_step.append(self._lb_steps)
            step_start = max(end, self.now)
        if self.engine.waiting or self.engine.running:
            raise RuntimeError(f"simulation ended with {len(self.engine.waiting)} waiting, {len(self.engine.running)} running")
        return SimResult(summarize(self), self.done)

    def _loop(self) -> None:
        heap = self._heap
        while heap:
            t, _, kind, obj = heapq.heappop(heap)
            self.now = t
            if kind == GEN:
                self._on_gen(obj)
            elif kind == FINISH:
                if self._stale and (obj.id, t) in self._stale:  # a run stopped to restart it wider
                    self._stale.discard((obj.id, t))
                    continue
                self._on_finish(obj)
            elif kind == READY:
                self._on_ready(obj)
            elif kind == RETRY:
                self._attempt(obj)
            else:
                self._ticks.discard(t)
                self._started(self._warm.loaded(t) if self._warm is not None else self.engine.tick())
            if self._has_quota:
                w = self.engine.next_wakeup()
                if w is not None and w > self.now and w not in self._ticks:
                    self._ticks.add(w)
                    self._push(w, TICK, None)
            if self.check:
                self.engine.check_invariants()
                if self.engine.starts_refused:  # an invariant: not an assert that `python -O` drops
                    raise AssertionError("a manager refused a start the policy planned")

    def _on_gen(self, tr: _Traj) -> None:
        it = tr.items[tr.idx]
        rec = _Rec(f"{tr.id}/a{tr.idx}", tr, it, it.cls.rtype, self.now)
        rec.lb = it.lb
        rec.work = it.work
        if it.cls.rtype == "cpu" and self.spec.cpu_mode == "pod":
            if tr.pod is None:
                tr.pod = "pending"
                tr.pending = rec
                pod = _Rec(f"{tr.id}/pod", tr, None, POD_CLASS, self.now)
                self._recs[pod.id] = pod
                a = Action.build(pod.id, {"cpu": Demand.fixed(self.wl.baselines.pod_cores)}, action_class=POD_CLASS,
                                 trajectory=tr.id, mem_mb=tr.job.memory_mb)
                self._started(self.engine.submit(a))
            elif tr.pod == "ready":
                self._run_in_pod(rec)
            else:
                tr.pending = rec
            return
        self._recs[rec.id] = rec
        self._started(self.engine.submit(self._action(rec)))

    def _started(self, started) -> None:
        now = self.now
        for s in started:
            rec = self._recs[s.action.id]
            d = s.dispatch
            if s.restart:
                self._restart(rec, d.dop)
                continue
            rec.start = now
            if rec.rtype == POD_CLASS:
                tr = rec.traj
                tr.pod = "creating"
                tr.pod_start = now
                tr.mem_from = now
                self._creating += 1
                b = self.wl.baselines
                rec.setup_s = b.pod_start_s + b.pod_start_per_concurrent_s * (self._creating - 1)
                self._push(now + rec.setup_s, READY, tr)
                continue
            it = rec.item
            cls = it.cls
            m = d.dop
            rec.pool_units = m
            if cls.rtype == "gpu" and self.spec.gpu_mode == "static":
                m = self._static[it.service][0]
            rec.units = m
            rec.run_s = _true_duration(cls, it.t1, m)
            if self.gpu is not None and "gpu" in d.units:
                rec.restore_s = self._restore_s(rec.id, d.pools["gpu"])
            if cls.rtype == "cpu" and not rec.traj.env_started:
                rec.traj.env_started = True
                rec.traj.mem_from = now
                rec.setup_s = rec.traj.job.env_start_s
            if self.spec.api_mode == "naive" and cls.rtype.startswith("api:"):
                self._attempt(rec)
                continue
            rec.due = now + rec.setup_s + rec.restore_s + rec.run_s
            self._push(rec.due, FINISH, rec)

    def _restart(self, rec: _Rec, m: int) -> None:
        """The engine stopped ``rec``'s run to start it again at ``m`` units: the run so far is lost
        (counted busy and reserved, as it was), the new one needs its whole work again."""
        now = self.now
        began = rec.run_from if rec.restarts else rec.start
        ready = rec.start + rec.setup_s  # its environment is up (its first CPU action pays the start)
        rtype = rec.item.cls.rtype
        if rtype in self.busy:
            self.busy[rtype] += rec.units * max(0.0, now - max(began, ready))
            self.reserved[rtype] += rec.pool_units * (now - began)
        self._stale.add((rec.id, rec.due))
        rec.restarts += 1
        rec.run_from = now
        rec.units = rec.pool_units = m
        rec.run_s = _true_duration(rec.item.cls, rec.item.t1, m)
        rec.due = max(now, ready) + rec.run_s  # a restart before the environment is up still waits for it
        self._push(rec.due, FINISH, rec)

    def _restore_s(self, holder: str, pool: str) -> float:
        if not self._real_gpu:
            return self.gpu.take_restore_s(holder)
        decision = self.gpu.lease(pool, holder)
        if decision is None or decision.hit:
            return 0.0
        seconds = restore_seconds(decision.restore_mb_per_device, self.wl.cluster.restore_gbps)
        self.gpu.restored(pool, holder, seconds)  # counted as part of the action's execution
        return seconds

    def _run_in_pod(self, rec: _Rec) -> None:
        cls = rec.item.cls
        cores = self.wl.baselines.pod_cores
        m = max([o for o in cls.demand.options if o <= cores] or [cls.demand.min])
        m = min(m, cores) if not cls.demand.elastic else m
        rec.start = self.now
        rec.units = m
        rec.run_s = _true_duration(cls, rec.item.t1, m)
        self._push(self.now + rec.run_s, FINISH, rec)

    def _on_ready(self, tr: _Traj) -> None:
        self._creating -= 1
        tr.pod = "ready"
        pod = self._recs[f"{tr.id}/pod"]
        rec, tr.pending = tr.pending, None
        # the pod's start-up is the first action's set-up; its wait for cores, the first action's queueing
        rec.start = pod.start
        rec.setup_s = pod.setup_s
        cls = rec.item.cls
        cores = self.wl.baselines.pod_cores
        m = max([o for o in cls.demand.options if o <= cores] or [cls.demand.min])
        rec.units = m
        rec.run_s = _true_duration(cls, rec.item.t1, m)
        self._push(self.now + rec.run_s, FINISH, rec)

    def _attempt(self, rec: _Rec) -> None:
        """api-naive: the API itself enforces its limits and answers 429 over them."""
        srv = self._server[rec.rtype[4:]]
        conc, quota, period, in_flight, window, used = srv
        w = int(self.now // period)
        if w != window:
            srv[4], srv[5] = w, 0
            used = 0
        ok = (conc is None or in_flight < conc) and (quota is None or used < quota)
        b = self.wl.baselines
        if ok:
            srv[3] += 1
            srv[5] += 1
            rec.attempt_start = self.now
            self._push(self.now + rec.run_s, FINISH, rec)
            return
        rec.retries += 1
        if self.spec.api_gives_up and rec.retries > b.max_retries:
            rec.failed = True
            self._push(self.now + b.reject_s, FINISH, rec)
            return
        delay = min(b.backoff_s * 2 ** (rec.retries - 1), b.backoff_max_s) * (0.5 + self._rng.random())
        self._push(self.now + b.reject_s + delay, RETRY, rec)

    def _on_finish(self, rec: _Rec) -> None:
        now = self.now
        rec.end = now
        tr = rec.traj
        in_pod = rec.rtype == "cpu" and self.spec.cpu_mode == "pod"
        if not in_pod:
            del self._recs[rec.id]
        naive = self.spec.api_mode == "naive" and rec.rtype.startswith("api:")
        if naive:
            if not rec.failed:
                self._server[rec.rtype[4:]][3] -= 1
                # time spent on 429s and backoff counts as queueing: the call waited for the API
                rec.start = rec.attempt_start
            else:
                rec.start = now
        rtype = "gpu" if rec.rtype == "gpu" or (rec.item and rec.item.cls.rtype == "gpu") else rec.rtype
        if rtype in self.busy:
            self.busy[rtype] += rec.units * rec.run_s
            if not in_pod and not (rtype == "gpu" and self.spec.gpu_mode == "static"):
                held_from = rec.run_from if rec.restarts else rec.start
                self.reserved[rtype] += rec.pool_units * (now - held_from)
        self.done.append(rec)
        if not in_pod:
            self._started(self.engine.complete(rec.id, "failed" if rec.failed else "succeeded", restore_s=rec.restore_s))
        tr.idx += 1
        if tr.idx < len(tr.items):
            self._push(now + tr.items[tr.idx].gen_s, GEN, tr)
            return
        # the trajectory ended: its pod, memory and node pin go away
        tr.end = now
        if tr.mem_from >= 0 and "mem" in self.reserved:
            # the trajectory's memory is reserved from its placement to its end; nothing "runs" on it
            self.reserved["mem"] += tr.job.memory_mb * (now - tr.mem_from)
        self._left -= 1
        if tr.pod is not None:
            pod = self._recs.pop(f"{tr.id}/pod")
            self.reserved["cpu"] += self.wl.baselines.pod_cores * (now - pod.start)
            self._started(self.engine.complete(pod.id))
        self._started(self.engine.close_trajectory(tr.id))


def simulate(workload: Workload, policy: str | PolicySpec, *, seed: int = 0, check: bool = False, replica: int = 0) -> SimResult:
    return Simulation(workload, policy, seed=seed, check=check, replica=replica).run()
