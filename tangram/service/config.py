"""The cluster config of ``tangram serve`` (YAML), validated field by field.

Every error is a :class:`ConfigError` naming the path of the offending field
(``cpu_nodes[1].cores``), so a typo in a 200-line file is found at once.
Without a file the embedded default is one local CPU node with this
machine's cores and memory, the local executor, a GPU node only if CUDA is
present, and no API pools. See ``examples/cluster.yaml`` for every field.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tangram.core.errors import ConfigError  # re-exported: the service's config errors
from tangram.core.fields import Fields
from tangram.core.grants import parse_cpulist
from tangram.managers.basic import ADAPTIVE, BOOKS_NEED, CONSERVATIVE
from tangram.policy.snapshot import (DEFAULT_ARRIVAL_GAP, DEFAULT_GENERATION_CREDIT, DEFAULT_OFFERED_LOAD_CAPS,
                                     DEFAULT_RESTART_GAIN)
from tangram.service.sandbox_protocol import SandboxFusionConfig, parse_sandbox_fusion
from tangram.service.config_files import anchored as _anchored
from tangram.service.config_files import merged as _merged
from tangram.service.config_files import read_yaml as _read_yaml
from tangram.service.scheduler_config import parse_scheduler
from tangram.service.tokens import (  # noqa: F401 - re-exported: where tangram serve and clients find tokens
    DEFAULT_TOKEN_FILE,
    client_token,
    default_token_file,
    read_token_file,
    token_path,
)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8471
DEFAULT_MAX_BODY = 1 << 20


@dataclass(frozen=True, slots=True)
class CpuNodeConfig:
    name: str
    executor: str = "local"  # local | docker | auto (this machine's Docker Engine if one answers, else local)
    endpoint: str | None = None  # docker: unix:// tcp:// ssh://
    cores: tuple[int, ...] = ()  # core ids this node may hand out
    memory_mb: int = 0
    numa: tuple[tuple[int, ...], ...] = ()  # core ids per NUMA node (discovered when empty)
    image: str | None = None  # docker: default image of environments
    workdir: str | None = None  # local: where environment directories live
    isolation: str = "sandbox"  # local: sandbox (bubblewrap) | none (trusted code only; warned at every start)
    allow_network: bool = False  # local sandbox: environments that ask for a network may have one
    readonly: tuple[str, ...] = ()  # local sandbox: extra read-only paths (toolchains) commands may use
    images: tuple[str, ...] = ()  # docker: images environments may ask for (empty: only the default image)

    def allowed_images(self) -> tuple[str, ...]:
        from tangram.executors.docker_image import SANDBOX_IMAGE  # no docker SDK import

        return self.images or (self.image or SANDBOX_IMAGE,)


@dataclass(frozen=True, slots=True)
class GpuServiceConfig:
    """A model servable on a GPU node (its footprint feeds the EOE service cache)."""

    name: str
    state_mb: int = 0
    sharded: bool = False
    overhead_mb: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)  # handed to the model executor


@dataclass(frozen=True, slots=True)
class GpuNodeConfig:
    name: str
    gpus: tuple[int, ...]
    memory_mb_per_gpu: int | None = None
    device: str | None = None  # "cuda" / "cpu" (tests)
    services: tuple[GpuServiceConfig, ...] = ()
    # load the services at start, on idle GPUs (tangram.managers.gpu_warm); None: warm_start_on decides
    warm_start: bool | None = None


def warm_start_on(node: GpuNodeConfig, cuda_visible: bool) -> bool:
    """Whether ``node`` warm-starts: as configured; unset, where its devices are CUDA devices (``device:
    cuda``, or no device given and ``cuda_visible``: False for a scale-out host, which picks its own). Virtual
    CPU devices share the host's memory, which a plan that fills them would fill: they load on demand unless
    told otherwise."""
    if node.warm_start is not None:
        return node.warm_start
    return node.device == "cuda" or (node.device is None and cuda_visible)


@dataclass(frozen=True, slots=True)
class ApiPoolConfig:
    name: str
    concurrency: int | None = None
    quota: int | None = None
    period_s: float | None = None
    window: str = "sliding"
    arrival_margin_s: float | None = None  # see tangram.managers.basic
    books: str = ADAPTIVE  # without a margin: "adaptive" or "conservative" (tangram.managers.basic)


DEFAULT_MAX_ENVIRONMENTS = 16_384  # a rollout of 1,024 prompts x 8 samples holds 8,192 at once: twice that


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    token: str | None = None
    # where the token lives; a file that does not exist yet is created (0600) by `tangram serve`
    token_file: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    header_timeout_s: float = 10.0  # a connection must send a complete request head within this
    body_timeout_s: float = 30.0  # and its body within this once the head arrived
    tls_cert: str | None = None  # PEM files: serve HTTPS (bind beyond loopback only with TLS)
    tls_key: str | None = None
    # admission (tangram/service/admission.py): unfinished actions per job and in total
    max_queued_per_job: int = 1024
    max_queued_total: int = 4096
    engine_window: int = 0  # waiting actions the engine sees at once (0: max(64, 4 x scheduler.lookahead))
    # durable state (tangram/service/state.py): None keeps it in memory (nothing survives the process)
    state_dir: str | None = None
    env_ttl_s: float = 3600.0  # an environment unused this long, with nothing running, is reclaimed (0: never)
    keep_results: int = 100_000  # finished outcomes kept; older ids answer 410 Gone
    # live environments at most (a directory or a container each): past it POST /v1/environments is 503
    max_environments: int = DEFAULT_MAX_ENVIRONMENTS  # with Retry-After: one caller cannot exhaust a node


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    service: ServiceConfig = field(default_factory=ServiceConfig)
    cpu_nodes: tuple[CpuNodeConfig, ...] = ()
    gpu_nodes: tuple[GpuNodeConfig, ...] = ()
    api_pools: tuple[ApiPoolConfig, ...] = ()
    profiles: tuple[str, ...] = ()
    depth: int = 2
    lookahead: int = 32
    default_duration_s: float = 1.0
    dop_caps: Mapping[str, int] = field(default_factory=dict)  # class -> cap on its key resource (`tangram tune`)
    order: str = "aging"  # queue order (tangram.policy.order): "fcfs" or "aging"
    aging_k: float = 4.0
    aging_cap_s: float | None = None  # cap on the aging window in seconds (tangram.policy.order); None: none
    progress_s: float = 0.0  # key credit per ended action of the same trajectory (tangram.policy.order); 0: off
    # API key credit per second of the trajectory's generation (tangram.policy.order); 0: off
    generation_credit: float = DEFAULT_GENERATION_CREDIT
    affinity_k: float = 4.0  # GPU affinity window, in restores (tangram.policy.affinity); 0: off
    expect_arrivals: bool = True  # headroom for the next actions of trajectories in generation
    arrival_gap: str = DEFAULT_ARRIVAL_GAP  # when they are expected (tangram.core.gaps): "residual" or "mean"
    learn_unprofiled: bool = True  # an elastic action without a profile learns its class's (tangram.core.estimator)
    # restart a straggling restartable run wider when that is expected to take at most this share of its
    # time left (tangram.policy.restart); 0: never
    restart_gain: float = DEFAULT_RESTART_GAIN
    # resource type -> factor of the offered-load DoP cap (tangram.policy.offered_load); {}: off
    offered_load_caps: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_OFFERED_LOAD_CAPS))
    # scale-out (tangram/scaleout/config.py validates it): health loop, docker TLS, GPU hosts on Ray
    scaleout: Mapping[str, Any] | None = None
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)


# ---------------------------------------------------------------------------- #
# loading


def load_config(path: str | Path | list[str | Path] | tuple[str | Path, ...] | None) -> ClusterConfig:
    """Read and validate a YAML file; ``None`` gives the embedded default.

    Several files are merged in order: a later file's sections are merged
    into the earlier ones key by key (a list or a value replaces), so a
    fragment such as the ``scheduler:`` section written by
    ``tangram tune --config-out`` applies on top of a cluster file.
    """
    if path is None:
        return default_config()
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    if not paths:
        return default_config()
    doc: dict[str, Any] = {}
    for q in paths:
        part = _anchored(_read_yaml(Path(q)), Path(q).parent)
        doc = _merged(doc, part)
    p = Path(paths[0])
    cfg = parse_config(doc, base_dir=p.parent)
    # relative profile paths are relative to the config file
    profiles = tuple(str((p.parent / q).resolve()) if not os.path.isabs(q) else q for q in cfg.profiles)
    return _replace(cfg, profiles=profiles)


def default_config() -> ClusterConfig:
    return parse_config({})


def parse_config(doc: Any, *, base_dir: str | Path | None = None) -> ClusterConfig:
    """Validate a config document; relative file paths in it are relative to ``base_dir``."""
    root = _mapping(doc, "<root>")
    _known(root, "<root>", {"service", "scheduler", "cpu_nodes", "gpu_nodes", "api_pools", "profiles", "scaleout",
                            "sandbox_fusion"})
    service = _service(root.get("service", {}), "service", base_dir)
    sched = parse_scheduler(root.get("scheduler", {}))
    if "cpu_nodes" in root:
        cpu_nodes = tuple(_cpu_node(n, f"cpu_nodes[{i}]") for i, n in enumerate(_list(root["cpu_nodes"], "cpu_nodes")))
    else:
        cpu_nodes = (_local_node(),)
    if "gpu_nodes" in root:
        gpu_nodes = tuple(_gpu_node(n, f"gpu_nodes[{i}]") for i, n in enumerate(_list(root["gpu_nodes"], "gpu_nodes")))
    else:
        gpu_nodes = _detect_cuda_node()
    api_raw = root.get("api_pools", {})
    if isinstance(api_raw, Mapping):  # {name: limits} or a list of {name, ...}
        api_items = [({"name": k, **_mapping(v, f"api_pools.{k}")}, f"api_pools.{k}") for k, v in api_raw.items()]
    else:
        api_items = [(v, f"api_pools[{i}]") for i, v in enumerate(_list(api_raw, "api_pools"))]
    api_pools = tuple(_api_pool(v, where) for v, where in api_items)
    profiles_raw = root.get("profiles", [])
    if isinstance(profiles_raw, str):
        profiles_raw = [profiles_raw]
    profiles = tuple(_str(p, f"profiles[{i}]") for i, p in enumerate(_list(profiles_raw, "profiles")))
    names: dict[str, str] = {}
    for i, n in enumerate(cpu_nodes):
        _unique(names, n.name, f"cpu_nodes[{i}].name")
    gnames: dict[str, str] = {}
    for i, n in enumerate(gpu_nodes):
        _unique(gnames, n.name, f"gpu_nodes[{i}].name")
    anames: dict[str, str] = {}
    for p, (_, where) in zip(api_pools, api_items):
        _unique(anames, p.name, f"{where}.name")
    scaleout = None
    if root.get("scaleout") is not None:  # scale-out hook: validated now, so errors name their field
        from tangram.scaleout.config import parse_scaleout

        parse_scaleout(root["scaleout"])
        scaleout = dict(root["scaleout"])
    sandbox = parse_sandbox_fusion(root.get("sandbox_fusion", {}), "sandbox_fusion", base_dir)
    if sandbox.key is not None and sandbox.key == service.token:
        raise ConfigError("sandbox_fusion.key", "must differ from the service token (it goes into URLs)")
    return ClusterConfig(service=service, cpu_nodes=cpu_nodes, gpu_nodes=gpu_nodes, api_pools=api_pools,
                         profiles=profiles, **sched, scaleout=scaleout, sandbox_fusion=sandbox)


def _service(raw: Any, where: str, base_dir: str | Path | None = None) -> ServiceConfig:
    m = _mapping(raw, where)
    _known(m, where, {"host", "port", "token", "token_file", "max_body_bytes", "header_timeout_s", "body_timeout_s",
                      "tls_cert", "tls_key", "max_queued_per_job", "max_queued_total",
                      "engine_window", "state_dir", "env_ttl_s", "keep_results", "max_environments"})
    token = m.get("token")
    if token is not None:
        token = _str(token, f"{where}.token")
    token_file = None
    if m.get("token_file") is not None:
        if token is not None:
            raise ConfigError(f"{where}.token_file", "give either token or token_file")
        token_file = token_path(_str(m["token_file"], f"{where}.token_file"), base_dir)
        if os.path.exists(token_file):  # else `tangram serve` creates it
            token = read_token_file(token_file, f"{where}.token_file")
    tls = tuple(token_path(_str(m[k], f"{where}.{k}"), base_dir) if m.get(k) is not None else None
                for k in ("tls_cert", "tls_key"))  # relative to the config file, as token_file is
    if (tls[0] is None) != (tls[1] is None):
        raise ConfigError(f"{where}.{'tls_key' if tls[1] is None else 'tls_cert'}", "TLS needs both tls_cert and tls_key")
    for k, f in zip(("tls_cert", "tls_key"), tls):
        if f is not None and not os.path.isfile(f):
            raise ConfigError(f"{where}.{k}", f"no such file: {f}")
    return ServiceConfig(
        host=_str(m.get("host", DEFAULT_HOST), f"{where}.host"),
        port=_int(m.get("port", DEFAULT_PORT), f"{where}.port", lo=0, hi=65535),
        token=token,
        token_file=token_file,
        max_body_bytes=_int(m.get("max_body_bytes", DEFAULT_MAX_BODY), f"{where}.max_body_bytes", lo=1024),
        header_timeout_s=_number(m.get("header_timeout_s", 10.0), f"{where}.header_timeout_s"),
        body_timeout_s=_number(m.get("body_timeout_s", 30.0), f"{where}.body_timeout_s"),
        tls_cert=tls[0],
        tls_key=tls[1],
        max_queued_per_job=_int(m.get("max_queued_per_job", 1024), f"{where}.max_queued_per_job", lo=1),
        max_queued_total=_int(m.get("max_queued_total", 4096), f"{where}.max_queued_total", lo=1),
        engine_window=_int(m.get("engine_window", 0), f"{where}.engine_window", lo=0),
        state_dir=token_path(_str(m["state_dir"], f"{where}.state_dir"), base_dir) if m.get("state_dir") else None,
        env_ttl_s=0.0 if m.get("env_ttl_s", 3600.0) == 0 else _number(m.get("env_ttl_s", 3600.0), f"{where}.env_ttl_s"),
        keep_results=_int(m.get("keep_results", 100_000), f"{where}.keep_results", lo=1),
        max_environments=_int(m.get("max_environments", DEFAULT_MAX_ENVIRONMENTS), f"{where}.max_environments",
                              lo=1),
    )


def _cpu_node(raw: Any, where: str) -> CpuNodeConfig:
    m = _mapping(raw, where)
    _known(m, where, {"name", "executor", "endpoint", "cores", "memory_mb", "numa", "image", "workdir", "isolation",
                      "allow_network", "readonly", "images"})
    executor = m.get("executor", "local")
    if executor not in ("local", "docker", "auto"):
        raise ConfigError(f"{where}.executor", f"must be 'local', 'docker' or 'auto', got {executor!r}")
    name = _str(m.get("name", "local" if executor in ("local", "auto") else None), f"{where}.name")
    endpoint = None
    if executor in ("docker", "auto"):  # auto: this machine's engine, so its default socket
        endpoint = _str(m.get("endpoint", "unix:///var/run/docker.sock"), f"{where}.endpoint")
        if not endpoint.startswith(("unix://", "tcp://", "ssh://", "http://", "https://", "npipe://")):
            raise ConfigError(f"{where}.endpoint", f"must be a Docker endpoint URL (unix://, tcp://, ssh://), got {endpoint!r}")
        if executor == "auto" and not endpoint.startswith("unix://"):
            raise ConfigError(f"{where}.endpoint", f"an auto node is this machine: a unix:// socket, got {endpoint!r}")
    elif "endpoint" in m:
        raise ConfigError(f"{where}.endpoint", "only docker nodes have an endpoint")
    if executor in ("local", "auto"):  # this machine: checked against what it has
        local = _local_node()
        cores = _cores(m["cores"], f"{where}.cores", available=local.cores) if "cores" in m else local.cores
        memory_mb = _int(m.get("memory_mb", local.memory_mb), f"{where}.memory_mb", lo=0)
        if local.memory_mb and memory_mb > local.memory_mb:
            raise ConfigError(f"{where}.memory_mb", f"{memory_mb} MB requested, this machine has {local.memory_mb} MB")
    else:
        # scale-out hook: left out, cores (empty) and memory (0) are discovered from the engine
        # (tangram/scaleout/docker_nodes.py: docker info + a probe container)
        cores = _cores(m["cores"], f"{where}.cores") if "cores" in m else ()
        memory_mb = _int(m["memory_mb"], f"{where}.memory_mb", lo=0) if "memory_mb" in m else 0
    numa: tuple[tuple[int, ...], ...] = ()
    if "numa" in m:
        groups = _list(m["numa"], f"{where}.numa")
        numa = tuple(_cores(g, f"{where}.numa[{i}]") for i, g in enumerate(groups))
        flat = [c for g in numa for c in g]
        if len(flat) != len(set(flat)):
            raise ConfigError(f"{where}.numa", "a core is listed in two NUMA nodes")
        missing = set(cores) - set(flat)
        if missing:
            raise ConfigError(f"{where}.numa", f"cores {sorted(missing)[:8]} belong to no NUMA node")
    image = _str(m["image"], f"{where}.image") if m.get("image") is not None else None
    workdir = _str(m["workdir"], f"{where}.workdir") if m.get("workdir") is not None else None
    isolation = m.get("isolation", "sandbox")
    if isolation not in ("sandbox", "none"):
        raise ConfigError(f"{where}.isolation", f"must be 'sandbox' or 'none', got {isolation!r}")
    if executor == "docker" and isolation != "sandbox":
        raise ConfigError(f"{where}.isolation", "docker nodes always isolate commands in containers")
    allow_network = _bool(m.get("allow_network", False), f"{where}.allow_network")
    readonly = tuple(_str(p, f"{where}.readonly[{i}]") for i, p in enumerate(_list(m.get("readonly", []), f"{where}.readonly")))
    for i, p in enumerate(readonly):
        if not os.path.isabs(p):
            raise ConfigError(f"{where}.readonly[{i}]", f"must be an absolute path, got {p!r}")
    images = tuple(_str(x, f"{where}.images[{i}]") for i, x in enumerate(_list(m.get("images", []), f"{where}.images")))
    if images and executor != "docker":
        raise ConfigError(f"{where}.images", "only docker nodes run images")
    if images and image is not None and image not in images:
        images = (image, *images)
    return CpuNodeConfig(name=name, executor=executor, endpoint=endpoint, cores=cores, memory_mb=memory_mb,
                         numa=numa, image=image, workdir=workdir, isolation=isolation,
                         allow_network=allow_network, readonly=readonly, images=images)


def _gpu_node(raw: Any, where: str) -> GpuNodeConfig:
    m = _mapping(raw, where)
    _known(m, where, {"name", "gpus", "memory_mb_per_gpu", "device", "services", "warm_start"})
    name = _str(m.get("name"), f"{where}.name")
    if "gpus" not in m:
        raise ConfigError(f"{where}.gpus", "is required (a count or a list of device ids)")
    gpus = _cores(m["gpus"], f"{where}.gpus")
    if len(gpus) not in (1, 2, 4, 8) and len(gpus) % 8:
        raise ConfigError(f"{where}.gpus", f"buddy chunks need 1, 2, 4 or a multiple of 8 GPUs, got {len(gpus)}")
    mem = m.get("memory_mb_per_gpu")
    mem = _int(mem, f"{where}.memory_mb_per_gpu", lo=1) if mem is not None else None  # None: ask the device
    device = m.get("device")
    if device is not None and device not in ("cuda", "cpu"):
        raise ConfigError(f"{where}.device", f"must be 'cuda' or 'cpu', got {device!r}")
    services = []
    for i, s in enumerate(_list(m.get("services", []), f"{where}.services")):
        sw = f"{where}.services[{i}]"
        sm = _mapping(s, sw)
        _known(sm, sw, {"name", "state_mb", "sharded", "overhead_mb", "options"})
        sname = _str(sm.get("name"), f"{sw}.name")
        if "@" in sname:
            raise ConfigError(f"{sw}.name", f"must not contain '@', got {sname!r}")
        state_mb = _int(sm.get("state_mb", 0), f"{sw}.state_mb", lo=0)
        overhead_mb = _int(sm.get("overhead_mb", 0), f"{sw}.overhead_mb", lo=0)
        sharded = _bool(sm.get("sharded", False), f"{sw}.sharded")
        opts = dict(_mapping(sm.get("options", {}), f"{sw}.options"))
        services.append(GpuServiceConfig(name=sname, state_mb=state_mb, sharded=sharded,
                                         overhead_mb=overhead_mb, options=opts))
    warm = None if m.get("warm_start") is None else _bool(m["warm_start"], f"{where}.warm_start")
    return GpuNodeConfig(name=name, gpus=gpus, memory_mb_per_gpu=mem, device=device, services=tuple(services),
                         warm_start=warm)


def _api_pool(raw: Any, where: str) -> ApiPoolConfig:
    m = _mapping(raw, where)
    _known(m, where, {"name", "concurrency", "quota", "period_s", "window", "arrival_margin_s", "books"})
    name = _str(m.get("name"), f"{where}.name").removeprefix("api:")
    if not name or any(c in name for c in "@/ "):
        raise ConfigError(f"{where}.name", f"must be a plain name (no '@', '/', spaces), got {name!r}")
    conc = _int(m["concurrency"], f"{where}.concurrency", lo=1) if m.get("concurrency") is not None else None
    quota = _int(m["quota"], f"{where}.quota", lo=1) if m.get("quota") is not None else None
    period = _number(m["period_s"], f"{where}.period_s") if m.get("period_s") is not None else None
    if conc is None and quota is None:
        raise ConfigError(where, "needs a concurrency limit, a quota, or both")
    if (quota is None) != (period is None):
        raise ConfigError(f"{where}.period_s", "a quota needs its period" if period is None else "given without a quota")
    window = m.get("window", "sliding")
    if window not in ("sliding", "fixed"):
        raise ConfigError(f"{where}.window", f"must be 'sliding' or 'fixed', got {window!r}")
    margin = m.get("arrival_margin_s")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < math.inf):
        raise ConfigError(f"{where}.arrival_margin_s", f"must be a non-negative finite number, got {margin!r}")
    margin = None if margin is None else float(margin)
    books = m.get("books", ADAPTIVE)
    if books not in (ADAPTIVE, CONSERVATIVE):
        raise ConfigError(f"{where}.books", f"must be '{ADAPTIVE}' or '{CONSERVATIVE}', got {books!r}")
    if "books" in m and (quota is None or margin is not None):
        raise ConfigError(f"{where}.books", BOOKS_NEED)
    return ApiPoolConfig(name=name, concurrency=conc, quota=quota, period_s=period, window=window,
                         arrival_margin_s=margin, books=books)


# ---------------------------------------------------------------------------- #
# this machine


def _local_node() -> CpuNodeConfig:
    """This machine: the cores this process may use, its memory (capped by a cgroup limit)."""
    from tangram.managers.cpu import discover_local_node

    node = discover_local_node("local")
    return CpuNodeConfig(name="local", executor="local", cores=tuple(node.cores), memory_mb=node.memory_mb)


def _detect_cuda_node() -> tuple[GpuNodeConfig, ...]:
    """One GPU node with every visible CUDA device, if torch sees any (never imports torch otherwise)."""
    import glob
    import importlib.util

    # importing torch costs ~200 MiB and a second: only on a machine that has NVIDIA devices
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/proc/driver/nvidia/gpus"):
        return ()
    if importlib.util.find_spec("torch") is None:
        return ()
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install means no GPU pool
        return ()
    if n <= 0:
        return ()
    usable = 8 if n >= 8 else 4 if n >= 4 else 2 if n >= 2 else 1  # buddy chunks
    return (GpuNodeConfig(name="gpu0", gpus=tuple(range(usable)), device="cuda"),)


# ---------------------------------------------------------------------------- #
# field helpers


def _replace(cfg: ClusterConfig, **kw: Any) -> ClusterConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


_FIELDS = Fields(ConfigError)
_mapping, _list, _known, _str, _int = _FIELDS.mapping, _FIELDS.list, _FIELDS.known, _FIELDS.string, _FIELDS.integer
_number, _bool = _FIELDS.positive, _FIELDS.boolean


def _cores(v: Any, where: str, *, available: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """A count (``16``: ids 0..15, or the first 16 available), a list of ids, or ``"0-7,16-23"``."""
    if isinstance(v, bool):
        raise ConfigError(where, f"must be a count, a list of ids or a range string, got {v!r}")
    if isinstance(v, int):
        if v < 1:
            raise ConfigError(where, f"must be >= 1, got {v}")
        if available is not None:
            if v > len(available):
                raise ConfigError(where, f"{v} requested, this machine has {len(available)}")
            return tuple(available[:v])
        return tuple(range(v))
    ids: list[int] = []
    if isinstance(v, str):
        try:
            ids = parse_cpulist(v)
        except ValueError:
            raise ConfigError(where, f"not a core list like '0-7,16': {v!r}") from None
    elif isinstance(v, (list, tuple)):
        for i, c in enumerate(v):
            ids.append(_int(c, f"{where}[{i}]", lo=0))
    else:
        raise ConfigError(where, f"must be a count, a list of ids or a range string, got {type(v).__name__}")
    if not ids:
        raise ConfigError(where, "is empty")
    if len(ids) != len(set(ids)):
        raise ConfigError(where, "lists an id twice")
    if available is not None:
        missing = sorted(set(ids) - set(available))
        if missing:
            raise ConfigError(where, f"cores {missing[:8]} are not available to this process")
    return tuple(sorted(ids))


def _unique(seen: dict[str, str], name: str, where: str) -> None:
    if name in seen:
        raise ConfigError(where, f"name {name!r} is already used by {seen[name]}")
    seen[name] = where
