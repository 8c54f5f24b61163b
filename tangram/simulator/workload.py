"""Workloads of the simulator: parsed, validated YAML (see ``tangram/workloads/``).

A workload describes one RL job's rollout step (or several jobs that share one
cluster, under ``jobs:``): trajectories per step, turns per trajectory, the
LLM generation time before every action, the action classes of a turn (drawn
by weight), the reward actions at a trajectory's end, the GPU services, the
cluster, and the parameters of the baselines. Every error names its field.

Schema (distributions: a number, or ``{dist: fixed|lognormal|uniform, ...}``,
see :mod:`tangram.simulator.dists`)::

    name: ai-coding
    trajectories: 1024            # per step (``--batch`` overrides)
    steps: 1
    turns: <dist>                 # actions per trajectory (rounded)
    generation_s: <dist>          # LLM generation before each action and before the rewards
    memory_mb: 16384              # reserved per trajectory on its CPU node
    env_start_s: 1.0              # environment creation, added to its first CPU action
    actions:                      # a turn's action class, drawn by weight
      <class>: {weight, duration_s: <dist of T1>, resources: {cpu|gpu|api:<name>: <demand>},
                elasticity: {amdahl: s} | {table: {m: E}}, profiled, restartable: bool, service: name | [names]}
    rewards: {<class>: ...}       # run in order at the trajectory's end
    services: {<name>: {size_gb, t1_scale}}      # GPU models (DoPs follow from memory)
    cluster: {cpu_nodes, cores_per_node, mem_gb_per_node, gpu_nodes, gpus_per_node,
              gpu_mem_gb, restore_gbps, api: {<name>: {concurrency, quota, period_s, arrival_margin_s, books}}}
    baselines: {trajectory: {pod_cores, start_s, start_per_concurrent_s},
                static_services: {<service>: {dop, replicas}}, serverless: {load_gbps},
                api_naive: {reject_s, backoff_s, backoff_max_s, max_retries}, compare: [policies]}
    jobs: [{workload: <name or file>, trajectories, name}]   # instead of the above: jobs sharing the cluster
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml

from tangram.core.model import GPU_DOPS, Demand, Elasticity, parse_demand
from tangram.core.errors import DemandError
from tangram.managers.basic import ADAPTIVE, BOOKS_NEED, CONSERVATIVE
from tangram.simulator.dists import _FIELDS, Dist, parse_dist, _num
from tangram.simulator.errors import WorkloadError

BUILTIN_PACKAGE = "tangram.workloads"
MEM_FRACTION = 0.9  # share of a GPU's memory a service's weights may take (rest: activations)


@dataclass(frozen=True, slots=True)
class ApiPool:
    name: str
    concurrency: int | None
    quota: int | None
    period_s: float
    # how late after dispatch the provider can receive a call (ApiLimit.arrival_margin_s);
    # None: the managed quota counts a call until its answer. The simulated provider
    # receives a call at its dispatch, within any margin.
    arrival_margin_s: float | None = None
    # without a margin (ApiLimit.books): "adaptive" guesses one until the provider's first 429,
    # which the simulated provider never sends to managed calls; "conservative" counts to the answer
    books: str = ADAPTIVE


@dataclass(frozen=True, slots=True)
class Cluster:
    cpu_nodes: int = 0
    cores_per_node: int = 0
    mem_gb_per_node: float = 0.0
    gpu_nodes: int = 0
    gpus_per_node: int = 0
    gpu_mem_gb: float = 80.0
    restore_gbps: float = 25.0
    api: tuple[ApiPool, ...] = ()

    @property
    def total_cores(self) -> int:
        return self.cpu_nodes * self.cores_per_node

    @property
    def total_gpus(self) -> int:
        return self.gpu_nodes * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    size_gb: float
    t1_scale: float = 1.0


@dataclass(frozen=True, slots=True)
class ActionClass:
    name: str
    kind: str  # "env" (a turn's action) or "reward"
    rtype: str  # "cpu", "gpu" or "api:<name>"
    demand: Demand
    duration: Dist  # T1: duration on one unit of the key resource
    elasticity: Elasticity | None
    profiled: bool
    weight: float = 1.0
    services: tuple[str, ...] = ()
    per_trajectory_service: bool = True
    restartable: bool = False  # Action.restartable: its runs may be stopped and started again wider


@dataclass(frozen=True, slots=True)
class Baselines:
    pod_cores: int = 4
    pod_start_s: float = 5.0
    pod_start_per_concurrent_s: float = 0.0
    static: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # service -> (dop, replicas)
    serverless_load_gbps: float = 5.0
    reject_s: float = 0.1
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    max_retries: int = 6
    compare: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Job:
    name: str
    trajectories: int
    turns: Dist
    generation: Dist
    actions: tuple[ActionClass, ...]
    rewards: tuple[ActionClass, ...]
    memory_mb: int = 0
    env_start_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    jobs: tuple[Job, ...]
    services: Mapping[str, Service]
    cluster: Cluster
    baselines: Baselines
    steps: int = 1
    source: str = ""

    @property
    def trajectories(self) -> int:
        return sum(j.trajectories for j in self.jobs)

    def with_batch(self, n: int) -> "Workload":
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise WorkloadError("batch", f"must be a positive integer, got {n!r}")
        return replace(self, jobs=tuple(replace(j, trajectories=n) for j in self.jobs))

    def with_steps(self, n: int) -> "Workload":
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise WorkloadError("steps", f"must be a positive integer, got {n!r}")
        return replace(self, steps=n)

    def with_cluster(self, cluster: Cluster) -> "Workload":
        wl = replace(self, cluster=cluster)
        _check_services(wl)
        return wl

    def gpu_options(self, service: str) -> tuple[int, ...]:
        """DoPs at which ``service``'s weights fit the GPUs' memory (and a node)."""
        s = self.services[service]
        c = self.cluster
        return tuple(m for m in GPU_DOPS if m <= c.gpus_per_node and s.size_gb / m <= c.gpu_mem_gb * MEM_FRACTION)


# --------------------------------------------------------------------------- #
# loading


def builtin_names() -> list[str]:
    root = resources.files(BUILTIN_PACKAGE)
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def builtin_raw(name: str) -> dict:
    """Built-in workload ``name``'s mapping as its file has it (a variant derives from it)."""
    return _builtin_raw(name, "")


def _builtin_raw(name: str, others: str) -> Any:
    """The parsed file of built-in ``name``; ``others`` names what else the caller would take."""
    names = builtin_names()
    if name not in names:
        raise WorkloadError("workload", f"unknown workload {name!r} (built in: {', '.join(names)}{others})")
    return _read_yaml(resources.files(BUILTIN_PACKAGE).joinpath(f"{name}.yaml").read_text(), name)


def _read_yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise WorkloadError(where, f"malformed YAML: {exc}") from None


def _load_raw(name_or_path: str) -> tuple[dict, str]:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise WorkloadError("workload", f"no such file {name_or_path!r}")
        raw = _read_yaml(p.read_text(), str(p))
        src = str(p)
    else:
        raw = _builtin_raw(name_or_path, "; or a YAML file")
        src = f"builtin:{name_or_path}"
    if not isinstance(raw, dict):
        raise WorkloadError("workload", f"{src}: expected a mapping at the top level")
    return raw, src


def load_workload(name_or_path: str) -> Workload:
    raw, src = _load_raw(name_or_path)
    return parse_workload(raw, source=src)


def load_cluster(path: str) -> Cluster:
    p = Path(path)
    if not p.is_file():
        raise WorkloadError("cluster", f"no such file {path!r}")
    raw = _read_yaml(p.read_text(), str(p))
    if isinstance(raw, dict) and "cluster" in raw:
        raw = raw["cluster"]
    return parse_cluster(raw, "cluster")


def parse_workload(raw: dict, *, source: str = "") -> Workload:
    known = {"name", "description", "trajectories", "steps", "turns", "generation_s", "memory_mb", "env_start_s",
             "actions", "rewards", "services", "cluster", "baselines", "jobs"}
    unknown = set(raw) - known
    if unknown:
        raise WorkloadError(sorted(unknown)[0], f"unknown top-level key (expected one of {sorted(known)})")
    name = str(raw.get("name", Path(source).stem if source else "workload"))
    if "cluster" not in raw:
        raise WorkloadError("cluster", "is required")
    cluster = parse_cluster(raw["cluster"], "cluster")
    services = dict(_parse_services(raw.get("services") or {}, "services"))
    if "jobs" in raw:
        jobs_raw = raw["jobs"]
        if not isinstance(jobs_raw, list) or not jobs_raw:
            raise WorkloadError("jobs", "expected a non-empty list")
        jobs = []
        for i, j in enumerate(jobs_raw):
            f = f"jobs[{i}]"
            if not isinstance(j, dict) or "workload" not in j:
                raise WorkloadError(f"{f}.workload", "is required (a built-in name or a YAML file)")
            sub_raw, _ = _load_raw(str(j["workload"]))
            sub_raw = dict(sub_raw)
            sub_raw["cluster"] = raw["cluster"]
            sub = parse_workload(sub_raw, source=str(j["workload"]))
            for sname, svc in sub.services.items():
                services.setdefault(sname, svc)
            job = sub.jobs[0]
            n = j.get("trajectories", job.trajectories)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise WorkloadError(f"{f}.trajectories", f"must be a positive integer, got {n!r}")
            jobs.append(replace(job, name=str(j.get("name", sub.name)), trajectories=n))
        names = [j.name for j in jobs]
        if len(set(names)) != len(names):
            raise WorkloadError("jobs", f"job names must be unique, got {names}")
    else:
        jobs = [_parse_job(raw, name)]
    baselines = _parse_baselines(raw.get("baselines") or {}, "baselines")
    steps = raw.get("steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise WorkloadError("steps", f"must be a positive integer, got {steps!r}")
    wl = Workload(name=name, jobs=tuple(jobs), services=services, cluster=cluster, baselines=baselines,
                  steps=steps, source=source)
    _check_services(wl)
    return wl


def _int(raw: Any, field: str, *, minimum: int = 0) -> int:
    return _FIELDS.integer(raw, field, lo=minimum)


def parse_cluster(raw: Any, f: str) -> Cluster:
    if not isinstance(raw, dict):
        raise WorkloadError(f, f"expected a mapping, got {type(raw).__name__}")
    known = {"cpu_nodes", "cores_per_node", "mem_gb_per_node", "gpu_nodes", "gpus_per_node", "gpu_mem_gb",
             "restore_gbps", "api", "source"}
    unknown = set(raw) - known
    if unknown:
        raise WorkloadError(f"{f}.{sorted(unknown)[0]}", f"unknown key (expected one of {sorted(known)})")
    api = []
    api_raw = raw.get("api") or {}
    if not isinstance(api_raw, dict):
        raise WorkloadError(f"{f}.api", "expected a mapping of pool name to limits")
    for pname, lim in api_raw.items():
        pf = f"{f}.api.{pname}"
        if not isinstance(lim, dict):
            raise WorkloadError(pf, "expected a mapping with concurrency and/or quota + period_s")
        unknown = set(lim) - {"concurrency", "quota", "period_s", "arrival_margin_s", "books", "source"}
        if unknown:
            raise WorkloadError(f"{pf}.{sorted(unknown)[0]}",
                                "unknown key (expected concurrency, quota, period_s, arrival_margin_s, books)")
        conc = _int(lim["concurrency"], f"{pf}.concurrency", minimum=1) if "concurrency" in lim else None
        quota = _int(lim["quota"], f"{pf}.quota", minimum=1) if "quota" in lim else None
        if conc is None and quota is None:
            raise WorkloadError(pf, "needs concurrency and/or quota")
        period = _num(lim.get("period_s", 1.0), f"{pf}.period_s", positive=True, allow_zero=False)
        margin = _num(lim["arrival_margin_s"], f"{pf}.arrival_margin_s", positive=True) if "arrival_margin_s" in lim else None
        books = lim.get("books", ADAPTIVE)
        if books not in (ADAPTIVE, CONSERVATIVE):
            raise WorkloadError(f"{pf}.books", f"must be '{ADAPTIVE}' or '{CONSERVATIVE}', got {books!r}")
        if "books" in lim and (quota is None or margin is not None):
            raise WorkloadError(f"{pf}.books", BOOKS_NEED)
        api.append(ApiPool(str(pname), conc, quota, period, margin, books))
    c = Cluster(
        cpu_nodes=_int(raw.get("cpu_nodes", 0), f"{f}.cpu_nodes"),
        cores_per_node=_int(raw.get("cores_per_node", 0), f"{f}.cores_per_node"),
        mem_gb_per_node=_num(raw.get("mem_gb_per_node", 0), f"{f}.mem_gb_per_node", positive=True),
        gpu_nodes=_int(raw.get("gpu_nodes", 0), f"{f}.gpu_nodes"),
        gpus_per_node=_int(raw.get("gpus_per_node", 0), f"{f}.gpus_per_node"),
        gpu_mem_gb=_num(raw.get("gpu_mem_gb", 80), f"{f}.gpu_mem_gb", positive=True, allow_zero=False),
        restore_gbps=_num(raw.get("restore_gbps", 25), f"{f}.restore_gbps", positive=True, allow_zero=False),
        api=tuple(api),
    )
    if c.gpus_per_node > 8:
        raise WorkloadError(f"{f}.gpus_per_node", f"at most 8 (one buddy root per node), got {c.gpus_per_node}")
    if c.cpu_nodes and not c.cores_per_node:
        raise WorkloadError(f"{f}.cores_per_node", "must be >= 1 when cpu_nodes > 0")
    if c.gpu_nodes and not c.gpus_per_node:
        raise WorkloadError(f"{f}.gpus_per_node", "must be >= 1 when gpu_nodes > 0")
    return c


def _parse_services(raw: Any, f: str):
    if not isinstance(raw, dict):
        raise WorkloadError(f, "expected a mapping of service name to {size_gb, t1_scale}")
    for name, s in raw.items():
        sf = f"{f}.{name}"
        if not isinstance(s, dict) or "size_gb" not in s:
            raise WorkloadError(f"{sf}.size_gb", "is required")
        unknown = set(s) - {"size_gb", "t1_scale", "source"}
        if unknown:
            raise WorkloadError(f"{sf}.{sorted(unknown)[0]}", "unknown key (expected size_gb, t1_scale)")
        yield str(name), Service(str(name), _num(s["size_gb"], f"{sf}.size_gb", positive=True, allow_zero=False),
                                 _num(s.get("t1_scale", 1.0), f"{sf}.t1_scale", positive=True, allow_zero=False))


def _parse_job(raw: dict, name: str) -> Job:
    for k in ("trajectories", "turns", "generation_s"):
        if k not in raw:
            raise WorkloadError(k, "is required")
    actions = tuple(_parse_classes(raw.get("actions") or {}, "actions", "env"))
    rewards = tuple(_parse_classes(raw.get("rewards") or {}, "rewards", "reward"))
    if not actions and not rewards:
        raise WorkloadError("actions", "a workload needs at least one action or reward class")
    turns = parse_dist(raw["turns"], "turns")
    if turns.mean > 0 and not actions:
        raise WorkloadError("actions", "turns > 0 needs at least one action class")
    return Job(
        name=name,
        trajectories=_int(raw["trajectories"], "trajectories", minimum=1),
        turns=turns,
        generation=parse_dist(raw["generation_s"], "generation_s"),
        actions=actions,
        rewards=rewards,
        memory_mb=_int(raw.get("memory_mb", 0), "memory_mb"),
        env_start_s=_num(raw.get("env_start_s", 0.0), "env_start_s", positive=True),
    )


def _parse_classes(raw: Any, f: str, kind: str):
    if not isinstance(raw, dict):
        raise WorkloadError(f, "expected a mapping of class name to its description")
    known = {"weight", "duration_s", "resources", "elasticity", "profiled", "service", "source", "restartable"}
    for name, c in raw.items():
        cf = f"{f}.{name}"
        if not isinstance(c, dict):
            raise WorkloadError(cf, "expected a mapping")
        unknown = set(c) - known
        if unknown:
            raise WorkloadError(f"{cf}.{sorted(unknown)[0]}", f"unknown key (expected one of {sorted(known)})")
        if "duration_s" not in c:
            raise WorkloadError(f"{cf}.duration_s", "is required")
        res = c.get("resources")
        if not isinstance(res, dict) or len(res) != 1:
            raise WorkloadError(f"{cf}.resources", "expected exactly one resource type (cpu, gpu or api:<name>)")
        (rtype, amount), = res.items()
        rtype = str(rtype)
        if rtype not in ("cpu", "gpu") and not (rtype.startswith("api:") and len(rtype) > 4):
            raise WorkloadError(f"{cf}.resources.{rtype}", "unknown resource type (expected cpu, gpu or api:<name>)")
        try:
            if rtype == "gpu" and amount == "auto":
                demand = Demand.choices(GPU_DOPS)
            else:
                demand = parse_demand(amount, field=f"{cf}.resources.{rtype}")
        except DemandError as exc:
            raise WorkloadError(exc.field, exc.reason) from None
        el = None
        if "elasticity" in c:
            e = c["elasticity"]
            ef = f"{cf}.elasticity"
            try:
                if isinstance(e, dict) and set(e) <= {"amdahl", "source"} and "amdahl" in e:
                    el = Elasticity.amdahl(e["amdahl"], field=f"{ef}.amdahl")
                elif isinstance(e, dict) and "table" in e:
                    el = Elasticity.from_table(e["table"], field=f"{ef}.table")
                else:
                    raise WorkloadError(ef, "expected {amdahl: serial_fraction} or {table: {dop: efficiency}}")
            except DemandError as exc:
                raise WorkloadError(exc.field, exc.reason) from None
        if demand.elastic and el is None:
            raise WorkloadError(f"{cf}.elasticity", "an elastic demand needs an elasticity model")
        svc = c.get("service", ())
        services = (svc,) if isinstance(svc, str) else tuple(str(s) for s in svc)
        if rtype == "gpu" and not services:
            raise WorkloadError(f"{cf}.service", "a GPU action names its service (or a list to draw from)")
        profiled, restartable = (c.get(k, False) for k in ("profiled", "restartable"))
        for k, v in (("profiled", profiled), ("restartable", restartable)):
            if not isinstance(v, bool):
                raise WorkloadError(f"{cf}.{k}", f"must be true or false, got {v!r}")
        yield ActionClass(
            name=str(name), kind=kind, rtype=rtype, demand=demand,
            duration=parse_dist(c["duration_s"], f"{cf}.duration_s", allow_zero=False),
            elasticity=el, profiled=profiled, restartable=restartable,
            weight=_num(c.get("weight", 1.0), f"{cf}.weight", positive=True, allow_zero=False),
            services=services,
        )


def _parse_baselines(raw: Any, f: str) -> Baselines:
    if not isinstance(raw, dict):
        raise WorkloadError(f, "expected a mapping")
    known = {"trajectory", "static_services", "serverless", "api_naive", "compare"}
    unknown = set(raw) - known
    if unknown:
        raise WorkloadError(f"{f}.{sorted(unknown)[0]}", f"unknown key (expected one of {sorted(known)})")
    b: dict[str, Any] = {}
    t = raw.get("trajectory") or {}
    if t:
        b["pod_cores"] = _int(t.get("pod_cores", 4), f"{f}.trajectory.pod_cores", minimum=1)
        b["pod_start_s"] = _num(t.get("start_s", 5.0), f"{f}.trajectory.start_s", positive=True)
        b["pod_start_per_concurrent_s"] = _num(t.get("start_per_concurrent_s", 0.0),
                                               f"{f}.trajectory.start_per_concurrent_s", positive=True)
    st = raw.get("static_services") or {}
    static = {}
    for sname, cfg in st.items():
        sf = f"{f}.static_services.{sname}"
        if sname == "source":
            continue
        if not isinstance(cfg, dict):
            raise WorkloadError(sf, "expected {dop, replicas}")
        dop = _int(cfg.get("dop", 1), f"{sf}.dop", minimum=1)
        if dop not in GPU_DOPS:
            raise WorkloadError(f"{sf}.dop", f"must be one of {GPU_DOPS}, got {dop}")
        static[str(sname)] = (dop, _int(cfg.get("replicas", 1), f"{sf}.replicas", minimum=1))
    b["static"] = static
    sl = raw.get("serverless") or {}
    if sl:
        b["serverless_load_gbps"] = _num(sl.get("load_gbps", 5.0), f"{f}.serverless.load_gbps", positive=True, allow_zero=False)
    an = raw.get("api_naive") or {}
    if an:
        b["reject_s"] = _num(an.get("reject_s", 0.1), f"{f}.api_naive.reject_s", positive=True)
        b["backoff_s"] = _num(an.get("backoff_s", 1.0), f"{f}.api_naive.backoff_s", positive=True)
        b["backoff_max_s"] = _num(an.get("backoff_max_s", 30.0), f"{f}.api_naive.backoff_max_s", positive=True)
        b["max_retries"] = _int(an.get("max_retries", 6), f"{f}.api_naive.max_retries")
    cmp_ = raw.get("compare") or []
    if not isinstance(cmp_, list):
        raise WorkloadError(f"{f}.compare", "expected a list of policy names")
    b["compare"] = tuple(str(x) for x in cmp_)
    return Baselines(**b)


def _check_services(wl: Workload) -> None:
    for job in wl.jobs:
        for c in job.actions + job.rewards:
            where = f"{'rewards' if c.kind == 'reward' else 'actions'}.{c.name}"
            for s in c.services:
                if s not in wl.services:
                    raise WorkloadError(f"services.{s}", f"used by class {c.name!r} but not defined")
                if c.rtype == "gpu" and wl.cluster.gpu_nodes:
                    fits = wl.gpu_options(s)
                    if not fits:
                        raise WorkloadError(f"services.{s}.size_gb",
                                            f"{wl.services[s].size_gb} GB fits no DoP on {wl.cluster.gpus_per_node} x "
                                            f"{wl.cluster.gpu_mem_gb} GB GPUs")
                    if not any(m in c.demand for m in fits):
                        # each of its requests would find no DoP to run at, mid-run
                        d = c.demand
                        asked = list(d.picks) if d.picks is not None else f"{d.lo}-{d.hi}"
                        raise WorkloadError(f"{where}.resources.gpu",
                                            f"none of its DoPs ({asked}) holds service {s!r} "
                                            f"({wl.services[s].size_gb} GB: DoPs {list(fits)} on "
                                            f"{wl.cluster.gpu_mem_gb} GB GPUs)")
            if c.rtype.startswith("api:") and c.rtype[4:] not in {p.name for p in wl.cluster.api}:
                raise WorkloadError(f"cluster.api.{c.rtype[4:]}", f"used by class {c.name!r} but not configured")
            if c.rtype == "cpu" and not wl.cluster.cpu_nodes:
                raise WorkloadError("cluster.cpu_nodes", f"class {c.name!r} needs CPU nodes")
            if c.rtype == "cpu" and c.demand.min > wl.cluster.cores_per_node:
                raise WorkloadError(f"{where}.resources.cpu", f"needs at least {c.demand.min} cores, a node has "
                                    f"{wl.cluster.cores_per_node} (cluster.cores_per_node)")
            if c.rtype == "cpu" and job.memory_mb > wl.cluster.mem_gb_per_node * 1024:
                raise WorkloadError("memory_mb", f"{job.memory_mb} MiB per trajectory, a node has "
                                    f"{wl.cluster.mem_gb_per_node * 1024:g} MiB (cluster.mem_gb_per_node)")
            if c.rtype == "gpu" and not wl.cluster.gpu_nodes:
                raise WorkloadError("cluster.gpu_nodes", f"class {c.name!r} needs GPU nodes")
