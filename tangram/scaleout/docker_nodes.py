"""CPU nodes as Docker Engine endpoints: clients, topology discovery, health probe.

An endpoint is ``unix:///path``, ``tcp://host:2376`` (TLS when certificates
are given: the Docker daemon's ``--tlsverify`` set-up) or ``ssh://user@host``
(the ``ssh`` binary, so no paramiko is needed). The node's topology comes
from the engine itself, because the control plane runs elsewhere:

* ``docker info``: ``NCPU`` and ``MemTotal`` (the whole machine);
* a short-lived probe container (the sandbox image, no network) reading
  ``/proc/self/status`` ``Cpus_allowed_list`` (the cores a container may use
  there: a daemon restricted by a cpuset gives fewer than NCPU) and
  ``/sys/devices/system/node/node*/cpulist`` (the NUMA domains).

Whatever the config gives (cores, memory, NUMA) wins over what is found.
``docker`` is imported lazily.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from tangram.managers.cpu import CpuNode, format_cpulist, parse_cpulist

log = logging.getLogger("tangram.scaleout.docker")

MAX_CORES = 4096  # more than this from an engine is a bogus report, not a machine: refused before expanding it
PROBE_TIMEOUT_S = 60.0  # a probe container that has not exited by then is abandoned (docker info suffices)

# prints "cpus <list>" then "numa <i> <list>" per NUMA domain; `|| true`: a machine without sysfs NUMA
PROBE_SCRIPT = r"""sed -n 's/^Cpus_allowed_list:[[:space:]]*/cpus /p' /proc/self/status
for f in /sys/devices/system/node/node[0-9]*/cpulist; do
  [ -r "$f" ] || continue
  n=${f%/cpulist}; n=${n##*/node}
  echo "numa $n $(cat "$f")"
done || true
"""


@dataclass(frozen=True, slots=True)
class DockerTls:
    """Client certificates for a ``tcp://`` endpoint of a ``--tlsverify`` daemon."""

    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    verify: bool = True

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | None) -> "DockerTls | None":
        if not m:
            return None
        unknown = set(m) - {"ca_cert", "client_cert", "client_key", "verify"}
        if unknown:
            raise ValueError(f"tls.{sorted(unknown)[0]}: unknown field (ca_cert, client_cert, client_key, verify)")
        if bool(m.get("client_cert")) != bool(m.get("client_key")):
            raise ValueError("tls: client_cert and client_key go together")
        return cls(m.get("ca_cert"), m.get("client_cert"), m.get("client_key"), bool(m.get("verify", True)))


def client_kwargs(endpoint: str, *, tls: DockerTls | None = None, timeout: float = 60.0,
                  max_pool_size: int = 64) -> dict[str, Any]:
    """Keyword arguments of ``docker.DockerClient`` for ``endpoint`` (pure: testable without docker)."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ValueError(f"endpoint: a Docker endpoint URL (unix://, tcp://, ssh://), got {endpoint!r}")
    scheme = endpoint.split("://", 1)[0]
    kw: dict[str, Any] = {"base_url": endpoint, "timeout": timeout, "max_pool_size": max_pool_size}
    if tls is not None:
        if scheme not in ("tcp", "https"):
            raise ValueError(f"tls: only a tcp:// endpoint uses TLS, got {endpoint!r}")
        kw["tls"] = tls
    if scheme == "ssh":
        kw["use_ssh_client"] = True  # the system ssh (keys, agent, known_hosts); no paramiko
    return kw


def make_client(endpoint: str, *, tls: DockerTls | None = None, timeout: float = 60.0,
                max_pool_size: int = 64) -> Any:
    import docker  # lazy: the ``docker`` extra

    kw = client_kwargs(endpoint, tls=tls, timeout=timeout, max_pool_size=max_pool_size)
    if kw.get("tls") is not None:
        t: DockerTls = kw["tls"]
        cert = (t.client_cert, t.client_key) if t.client_cert else None
        kw["tls"] = docker.tls.TLSConfig(client_cert=cert, ca_cert=t.ca_cert,
                                         verify=(t.ca_cert or True) if t.verify else False)
    if kw.get("tls") is None:
        return docker.DockerClient(**kw)
    # requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE override a session's own CA file
    # (psf/requests#3829): the daemon's CA would be ignored and every call fail verification.
    # So: no environment for these sessions, and the API version asked with such a session too
    # (the SDK's "auto" asks before we could switch it off).
    probe = docker.DockerClient(**{**kw, "version": docker.constants.MINIMUM_DOCKER_API_VERSION})
    probe.api.trust_env = False
    try:
        version = probe.api.version(api_version=False)["ApiVersion"]
    finally:
        probe.close()
    client = docker.DockerClient(**{**kw, "version": version})
    client.api.trust_env = False
    return client


class LazyClient:
    """A docker client made on first use, and again after a failed attempt.

    The engine of a node may be down when the service starts (or restart on
    another socket file): the node then starts marked down, and its executor
    connects once the node answers.
    """

    def __init__(self, factory: Callable[[], Any]):
        self._factory = factory
        self._client: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._get(), name)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


class NotOnEngine(ValueError):
    """The config asks a docker node for cores or memory its engine does not have (or it reports nonsense)."""

    def __init__(self, field: str, reason: str):
        self.field = field
        super().__init__(reason)


def _bounded_cpulist(text: str, name: str) -> list[int]:
    """``parse_cpulist``, refusing a list of more than MAX_CORES before it is built."""
    size = 0
    for part in text.strip().split(","):
        lo, _, hi = part.strip().partition("-")
        if lo:
            size += max(0, int(hi or lo) - int(lo) + 1)
    if size > MAX_CORES:
        raise NotOnEngine("cores", f"docker node {name!r} reports {size} cores ({text.strip()[:40]!r}); "
                          f"more than {MAX_CORES} is not a real machine")
    return parse_cpulist(text)


def parse_probe(text: str, name: str = "?") -> tuple[list[int], list[list[int]]]:
    """The probe's output -> (allowed cores, NUMA domains as found)."""
    cores: list[int] = []
    numa: list[tuple[int, list[int]]] = []
    for line in text.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0] == "cpus":
            cores = _bounded_cpulist(parts[1], name)
        elif len(parts) == 3 and parts[0] == "numa" and parts[1].isdigit():
            numa.append((int(parts[1]), _bounded_cpulist(parts[2], name)))
    return cores, [d for _, d in sorted(numa)]


def topology(name: str, ncpu: int, mem_total: int, probe_out: str | None, *,
             cores: Sequence[int] | None = None, memory_mb: int | None = None,
             numa: Sequence[Sequence[int]] | None = None) -> CpuNode:
    """Merge what the engine said with what the config gives (the config wins)."""
    if ncpu > MAX_CORES or (ncpu < 1 and not cores):  # 0: the engine cannot tell, and the config's cores do
        raise NotOnEngine("cores", f"docker node {name!r} reports {ncpu} CPUs (NCPU); expected 1 to {MAX_CORES} "
                          "(give cores in the config if that engine cannot tell)")
    if not memory_mb and int(mem_total) < (1 << 20):
        raise NotOnEngine("memory_mb", f"docker node {name!r} reports {mem_total} bytes of memory (MemTotal); "
                          f"give memory_mb in the config if that engine cannot tell")
    found_cores, found_numa = parse_probe(probe_out or "", name)
    if cores is None or not list(cores):
        cores = found_cores or list(range(ncpu))
    else:  # the config's cores must exist there
        there = set(found_cores) or set(range(ncpu))
        missing = sorted(set(cores) - there)
        if there and missing:
            raise NotOnEngine("cores", f"cores {missing[:8]} do not exist on that engine "
                              f"(it has {format_cpulist(sorted(there))})")
    if memory_mb and mem_total and memory_mb > int(mem_total) // (1 << 20):
        raise NotOnEngine("memory_mb", f"{memory_mb} MB requested, that engine has {int(mem_total) // (1 << 20)} MB")
    usable = set(cores)
    if numa is None or not list(numa):
        doms = [[c for c in d if c in usable] for d in found_numa]
        doms = [d for d in doms if d]
        rest = sorted(usable - {c for d in doms for c in d})
        if rest:
            doms.append(rest)
        numa = doms
    if memory_mb is None or memory_mb <= 0:
        memory_mb = int(mem_total) // (1 << 20)
    node = CpuNode(name=name, cores=tuple(sorted(usable)), numa=tuple(tuple(sorted(d)) for d in numa),
                   memory_mb=int(memory_mb))
    node.validate(f"docker node {name!r}")
    return node


def discover(client: Any, name: str, *, cores: Sequence[int] | None = None, memory_mb: int | None = None,
             numa: Sequence[Sequence[int]] | None = None, image: str | None = None,
             probe: bool = True) -> CpuNode:
    """The node behind ``client`` as a :class:`CpuNode` (blocking: call in a thread)."""
    info = client.info()
    out = None
    if probe:
        from tangram.executors.docker_image import SANDBOX_IMAGE, ensure_image

        img = image or SANDBOX_IMAGE
        if img == SANDBOX_IMAGE:
            ensure_image(client, img)  # no registry here: the sandbox image is imported locally
        try:
            out = _run_probe(client, img)
        except Exception as exc:  # noqa: BLE001 - the probe refines, `docker info` suffices
            log.warning("docker node %s: topology probe failed (%s); using docker info only", name, exc)
    return topology(name, int(info.get("NCPU") or 0), int(info.get("MemTotal") or 0), out,
                    cores=cores, memory_mb=memory_mb, numa=numa)


def _run_probe(client: Any, image: str) -> str:
    """The probe container's output. Detached, with a deadline: an attached run waits with no timeout."""
    from tangram.executors.docker_image import sandbox_run_kwargs

    c = client.containers.run(**sandbox_run_kwargs(image=image, command=["sh", "-c", PROBE_SCRIPT], detach=True,
                                                   labels={"org.arl-tangram.probe": "1"}))
    try:
        code = c.wait(timeout=PROBE_TIMEOUT_S).get("StatusCode")
        if code:
            raise RuntimeError(f"the probe exited {code}")
        raw = c.logs(stdout=True, stderr=False)
    finally:
        try:
            c.remove(force=True)
        except Exception as exc:  # noqa: BLE001 - best effort: it is labelled org.arl-tangram.probe
            log.warning("topology probe container %s not removed: %s", getattr(c, "id", "?"), exc)
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


class DockerPing:
    """Health probe of one endpoint: ``/_ping`` on a client of its own with a short timeout.

    Each ping runs in a daemon thread of its own, at most one at a time: a ping that hangs
    (an ``ssh://`` socket reads without a timeout) is joined by later calls, which then
    time out too, instead of piling up threads until the loop's shared pool is full and
    every node's ping fails. Daemon threads: a hung one must not block interpreter exit."""

    def __init__(self, endpoint: str, *, tls: DockerTls | None = None, timeout_s: float = 2.0):
        self.endpoint = endpoint
        self.tls = tls
        self.timeout_s = timeout_s
        self._client: Any = None
        self._inflight: asyncio.Future | None = None
        self._since = 0.0  # when the ping in flight started
        # a ping in flight this long is abandoned (its thread and client left to their socket) and a fresh
        # one started: joined for ever, a hung ping would keep a recovered daemon down
        self.abandon_after_s = max(30.0, 10 * timeout_s)

    def _ping(self) -> None:
        client = self._client
        if client is None:
            client = self._client = make_client(self.endpoint, tls=self.tls, timeout=self.timeout_s, max_pool_size=2)
        try:
            client.ping()
        except Exception:
            # a fresh connection next time (the daemon may come back on the same socket)
            if self._client is client:
                self._client = None
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass
            raise

    async def __call__(self) -> None:
        loop = asyncio.get_running_loop()
        fut = self._inflight
        stale = fut is not None and not fut.done() and time.monotonic() - self._since > self.abandon_after_s
        if stale:
            self._client = None  # the hung thread keeps its own
        if fut is None or fut.done() or fut.get_loop() is not loop or stale:
            self._since = time.monotonic()
            fut = self._inflight = loop.create_future()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, even if nobody waits
            threading.Thread(target=self._run, args=(loop, fut), daemon=True,
                             name=f"tangram-ping {self.endpoint}").start()
        await asyncio.shield(fut)  # a caller's timeout leaves the ping running: the next call joins it

    def _run(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        try:
            self._ping()
            exc = None
        except BaseException as e:  # noqa: BLE001 - handed to the waiting coroutine
            exc = e
        try:
            loop.call_soon_threadsafe(_settle, fut, exc)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for this ping any more

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
