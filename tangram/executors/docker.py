"""Docker executor: one container per environment (DESIGN.md §5).

* ``create_environment`` starts a detached sandbox container (default image
  ``tangram-sandbox:latest`` with the host's userland bound read-only, see
  :mod:`tangram.executors.docker_image`), ``mem_limit`` = the trajectory's
  memory reservation.
* Before each exec the container's ``CpusetCpus`` and ``NanoCpus`` are set to
  the action's cores and quota through the raw update endpoint (the SDK's
  ``update`` lacks ``nano_cpus``); skipped when they already match (the
  common case of a trajectory whose consecutive actions get the same cores).
* The command runs through the low-level exec API in a worker thread.
  Killing the exec's client side leaves the process running, so the action's
  processes are found *inside* the container: the exec's environment holds
  ``TANGRAM_ACTION_TOKEN=<unique token>``, which every descendant inherits,
  and since a command can clear that (``env -i``) a sweep also follows parent
  links: what descends from a marked process, or was orphaned (reparented to
  the container's PID 1) without another running action's token, is the
  action's too (:mod:`tangram.executors.docker_scripts`). On timeout or cancel
  a second exec sweeps (SIGTERM, then SIGKILL after ``kill_grace_s``), and the
  call returns only once the first exec has ended. The wrapper sweeps with
  SIGKILL when the command exits normally, so whatever it left in the
  background does not keep running on cores that are free again.
* PID 1 of the container is a bash loop that reaps orphans (the image has no
  init): killed processes do not pile up as zombies.
* Hardened by default: no network, a memory limit (the environment's
  ``memory_mb``, else ``default_memory_mb``; no swap past it), a pids limit,
  ``no-new-privileges``, every capability dropped, images from
  ``allowed_images`` only (never a registry pull of a caller-chosen name), and
  the executor's own labels always win over a caller's. Output is read as a
  stream and capped at ``max_output_bytes`` per stream while it arrives
  (``details["truncated"]``); the rest is drained and dropped.
* The engine may die under a running action: its exec stream breaks and the
  action ends ``failed`` with ``node_down`` (answered ``retryable``). Every
  container is then suspect until its next use, which first starts it again
  if it is stopped and kills what an action left running in it (with
  ``live-restore`` processes outlive the engine). A container found stopped
  when an action is to run (an engine restart nobody noticed, its PID 1
  killed) is started again first, its files intact. Containers carry the
  restart policy ``unless-stopped`` too.

``docker`` is imported lazily; the core never imports it.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

from tangram.executors.base import (
    FAILED,
    SUCCEEDED,
    TIMEOUT,
    EnvironmentExecutor,
    ExecResult,
    Placement,
    wait_through_cancels,
)
from tangram.executors.docker_image import SANDBOX_IMAGE, SANDBOX_LABEL, ensure_image, sandbox_run_kwargs, update_cpus
from tangram.executors.docker_calls import engine_lost, quiet, send_and_close, why
from tangram.executors.docker_scripts import KILL_ALL, KILLER, REAPER, WRAPPER

log = logging.getLogger(__name__)

ENV_LABEL = "org.arl-tangram.env"
OWNER_LABEL = "org.arl-tangram.owner"  # the service (state directory) whose container it is
RESERVED_LABEL_PREFIXES = ("org.arl-tangram.",)  # this executor's own: nobody else sets them
DEFAULT_PIDS_MAX = 512
ADOPT_TRIES = 10  # x 0.5 s: how long a container being restored by its engine is waited for at start
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")



class DockerExecutor(EnvironmentExecutor):
    """Sandbox containers on one Docker Engine endpoint (several nodes = several executors)."""

    name = "docker"
    outlives_outages = True  # a container and its files survive a restart of its engine

    def __init__(self, client: Any = None, *, base_url: str | None = None, image: str = SANDBOX_IMAGE,
                 kill_grace_s: float = 0.5, max_pool_size: int = 64, max_output_bytes: int = 8 << 20,
                 name_prefix: str = "tangram-", run_kwargs: Mapping[str, Any] | None = None,
                 allowed_images: tuple[str, ...] | None = None, default_memory_mb: int = 4096,
                 pids_max: int = DEFAULT_PIDS_MAX):
        if not kill_grace_s >= 0:
            raise ValueError(f"kill_grace_s: must be >= 0, got {kill_grace_s!r}")
        if not isinstance(image, str) or not image:
            raise ValueError(f"image: must be a non-empty image name, got {image!r}")
        self._client = client
        self._own_client = client is None
        self.base_url = base_url
        self.image = image
        self.kill_grace_s = float(kill_grace_s)
        self.max_pool_size = int(max_pool_size)
        self.max_output_bytes = int(max_output_bytes)
        self.name_prefix = name_prefix
        self.run_kwargs = dict(run_kwargs or {})
        self.allowed_images = tuple(allowed_images) if allowed_images is not None else (image,)
        self.default_memory_mb = int(default_memory_mb)
        self.pids_max = int(pids_max)
        self.owner: str | None = None  # set by the service with durable state: its containers carry it
        self._envs: dict[str, str] = {}  # env id -> container id
        self._cpus: dict[str, tuple[str, int]] = {}  # container id -> (cpuset, nano cpus) last set
        self._images_checked: set[str] = set()
        self._suspect: set[str] = set()  # containers to revive and clean before their next exec (engine died)
        self._unanswered: set[str] = set()  # environments whose creation got no answer: a container may exist
        # Two thread pools: a running exec blocks its thread for the command's whole
        # life, and a kill (or a cpu update) must never wait behind those.
        self._exec_pool: ThreadPoolExecutor | None = None
        self._ctl_pool: ThreadPoolExecutor | None = None

    def _ctl(self, fn: Callable, *args: Any, **kw: Any) -> "asyncio.Future":
        if self._ctl_pool is None:
            self._ctl_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tangram-docker-ctl")
        return asyncio.get_running_loop().run_in_executor(self._ctl_pool, functools.partial(fn, *args, **kw))

    def _start_exec(self, fn: Callable, *args: Any) -> "asyncio.Future":
        if self._exec_pool is None:
            self._exec_pool = ThreadPoolExecutor(max_workers=self.max_pool_size,
                                                 thread_name_prefix="tangram-docker-exec")
        return asyncio.get_running_loop().run_in_executor(self._exec_pool, fn, *args)

    # ------------------------------------------------------------------ #

    @property
    def client(self) -> Any:
        if self._client is None:
            import docker  # lazy: the ``docker`` extra is optional

            if self.base_url:
                self._client = docker.DockerClient(base_url=self.base_url, max_pool_size=self.max_pool_size)
            else:
                self._client = docker.from_env(max_pool_size=self.max_pool_size)
        return self._client

    def container_id(self, env_id: str) -> str:
        cid = self._envs.get(env_id)
        if cid is None:
            raise ValueError(f"env_id: unknown environment {env_id!r} (call create_environment first)")
        return cid

    @property
    def stop_grace_s(self) -> float:
        # the engine's calls before its own timer starts (the exec's cores), then SIGTERM, kill_grace_s and
        # up to 10 s of SIGKILL rounds (_kill_inside), each a call on the shared control pool
        return self.kill_grace_s + 15.0

    async def create_environment(self, env_id: str, *, image: str | None = None, memory_mb: int = 0,
                                 labels: Mapping[str, str] | None = None, network: bool = False) -> None:
        if network:
            raise ValueError("network: containers of this executor never get a network")
        if not isinstance(env_id, str) or not env_id or _SAFE.search(env_id):
            raise ValueError(f"env_id: must be a non-empty name of [A-Za-z0-9_.-], got {env_id!r}")
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 0:
            raise ValueError(f"memory_mb: must be a non-negative integer, got {memory_mb!r}")
        image = image or self.image
        if image not in self.allowed_images:
            raise ValueError(f"image: {image!r} is not an allowed image (allowed: {list(self.allowed_images)})")
        for k in labels or {}:
            if k.startswith(RESERVED_LABEL_PREFIXES):
                raise ValueError(f"labels.{k}: the prefix is reserved for the service's own labels")
        if env_id in self._envs:
            return
        try:
            cid = await self._ctl(self._create, env_id, image, memory_mb, dict(labels or {}))
        except Exception:
            # the engine may have made the container and died before answering: remove it now, or once
            # the engine answers again (next creation, reattachment, close)
            self._unanswered.add(env_id)
            try:
                await self._ctl(self._remove_unanswered)
            except Exception:  # noqa: BLE001 - still down: later
                pass
            raise
        self._envs[env_id] = cid

    def _remove_unanswered(self) -> None:
        """Remove containers of creations that failed without an answer (the engine died under them)."""
        for env_id in list(self._unanswered):
            filters = {"label": [f"{ENV_LABEL}={env_id}"] + ([f"{OWNER_LABEL}={self.owner}"] if self.owner else [])}
            for c in self.client.containers.list(all=True, filters=filters):
                self._remove(c.id)
            self._unanswered.discard(env_id)

    def _create(self, env_id: str, image: str, memory_mb: int, labels: dict[str, str]) -> str:
        client = self.client
        if self._unanswered:
            self._remove_unanswered()
        if image == SANDBOX_IMAGE and image not in self._images_checked:
            ensure_image(client, image)
            self._images_checked.add(image)
        mem = memory_mb or self.default_memory_mb
        kw = {"command": REAPER, "mem_limit": f"{mem}m", "memswap_limit": f"{mem}m", "pids_limit": self.pids_max,
              "security_opt": ["no-new-privileges:true"], "cap_drop": ["ALL"],
              "restart_policy": {"Name": "unless-stopped"}, **self.run_kwargs}
        kw.update(image=image, name=f"{self.name_prefix}{env_id}-{uuid.uuid4().hex[:8]}",
                  labels={**labels, SANDBOX_LABEL: "1", ENV_LABEL: env_id,  # ours last: they win
                          **({OWNER_LABEL: self.owner} if self.owner else {})})
        container = client.containers.run(**sandbox_run_kwargs(**kw))
        return container.id

    def set_owner(self, owner: str) -> None:
        self.owner = owner

    def _owned(self, env_id: str | None = None) -> list:
        labels = [f"{OWNER_LABEL}={self.owner}"] + ([f"{ENV_LABEL}={env_id}"] if env_id else [])
        return self.client.containers.list(all=True, filters={"label": labels})

    async def adopt_environment(self, env_id: str, *, memory_mb: int = 0, network: bool = False) -> bool:
        if self.owner is None:
            return False
        found = await self._ctl(self._owned, env_id)
        if not found:
            return False
        c = found[0]
        # started again if stopped (e.g. the engine restarted: its files are still in the container), and
        # commands of the dead service that still run inside (an exec outlives its client) killed
        for attempt in range(ADOPT_TRIES):  # an engine that just came back may still be restoring it
            try:
                await self._ctl(self._revive, c.id)
                break
            except Exception as e:  # noqa: BLE001 - cannot be revived: not adopted, swept
                if attempt == ADOPT_TRIES - 1:
                    log.warning("docker executor: container %s of %s does not start: %s", c.id[:12], env_id,
                                why(e))
                    return False
                await asyncio.sleep(0.5)
        self._envs[env_id] = c.id
        return True

    def _lost(self, e: BaseException) -> bool:
        """Did the engine fail under us (vs. refusing)? Then every container of it is suspect."""
        if not engine_lost(e):
            return False
        self._suspect.update(self._envs.values())
        self._cpus.clear()  # a restarted container may have lost its cpuset update
        return True

    def _revive(self, cid: str) -> None:
        """After an engine failure: start the container if the engine stopped it, kill what actions left."""
        import docker

        state = self.client.api.inspect_container(cid)["State"]
        if not state.get("Running"):
            try:
                self.client.api.start(cid)
            except docker.errors.APIError as e:  # started meanwhile by its restart policy: fine
                if e.status_code != 304 and "already" not in str(e):
                    raise
        self._kill_all_inside(cid)

    async def reattach_environment(self, env_id: str) -> bool:
        import docker

        cid = self._envs.get(env_id)
        if cid is None:
            return False
        try:
            await self._ctl(self._revive, cid)
            if self._unanswered:
                await self._ctl(self._remove_unanswered)
        except docker.errors.NotFound:  # the engine lost it (its data root was wiped)
            self._envs.pop(env_id, None)
            self._cpus.pop(cid, None)
            return False
        self._suspect.discard(cid)
        return True

    def _kill_all_inside(self, cid: str) -> None:
        self._run_inside(cid, ["bash", "-c", KILL_ALL])

    def _run_inside(self, cid: str, argv: list[str]) -> None:
        """Run a short control command in the container. It enters by attaching to the container's
        cgroups, which ``pids.max`` does not limit (only forks inside it are), and forks nothing itself."""
        api = self.client.api
        ex = api.exec_create(cid, argv, stdout=True, stderr=True)
        api.exec_start(ex["Id"])

    async def sweep_unrecorded(self, keep: set[str]) -> list[str]:
        if self.owner is None:
            return []
        gone = []
        for c in await self._ctl(self._owned):
            env_id = c.labels.get(ENV_LABEL)
            if env_id not in keep and env_id not in self._envs:
                await self._ctl(self._remove, c.id)
                gone.append(env_id)
        return gone

    def detach(self) -> None:
        self._envs.clear()
        self._cpus.clear()

    async def destroy_environment(self, env_id: str) -> None:
        cid = self._envs.get(env_id)
        if cid is None:
            return
        await self._ctl(self._remove, cid)  # forgotten once removed: a failed removal may be tried again
        self._envs.pop(env_id, None)
        self._cpus.pop(cid, None)

    def _remove(self, cid: str) -> None:
        import docker

        try:
            self.client.api.remove_container(cid, force=True)
        except docker.errors.NotFound:
            pass

    async def close(self) -> None:
        for env_id in list(self._envs):
            await self.destroy_environment(env_id)
        if self._unanswered:
            try:
                await self._ctl(self._remove_unanswered)
            except Exception:  # noqa: BLE001 - the engine is down: the next start's sweep removes them
                log.warning("docker executor: could not remove containers of failed creations %s",
                            sorted(self._unanswered))
        if self._own_client and self._client is not None:
            self._client.close()
            self._client = None
        for pool in (self._exec_pool, self._ctl_pool):
            if pool is not None:
                pool.shutdown(wait=False)
        self._exec_pool = self._ctl_pool = None

    # ------------------------------------------------------------------ #
    # exec

    async def exec(self, env_id: str, command: str, placement: Placement, *, timeout_s: float | None = None,
                   env: Mapping[str, str] | None = None, stdin: bytes | None = None) -> ExecResult:
        cid = self.container_id(env_id)
        if not isinstance(command, str):
            raise ValueError(f"command: must be a string, got {type(command).__name__}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout_s!r}")
        cores = list(placement.cores)
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cores):
            raise ValueError(f"placement.cores: core ids must be non-negative integers, got {cores}")
        if placement.cpu_quota is not None and not placement.cpu_quota > 0:
            raise ValueError(f"placement.cpu_quota: must be positive, got {placement.cpu_quota!r}")
        quota = placement.cpu_quota if placement.cpu_quota is not None else (len(cores) or None)
        isolation = "docker-cpuset" if cores else "docker"
        details: dict[str, Any] = {"container": cid[:12],
                                   "cores": cores, "cpu_quota": quota, "dop": placement.dop}
        t0 = time.perf_counter()
        if cid in self._suspect:
            try:
                await self._ctl(self._revive, cid)
            except Exception as e:  # noqa: BLE001 - the engine is still down (or lost the container)
                return ExecResult(status=FAILED, error=f"docker engine: {why(e)}", isolation=isolation,
                                  details=details, node_down=engine_lost(e))
            self._suspect.discard(cid)
        if cores:
            from tangram.core.grants import format_cpulist

            want = (format_cpulist(cores), int(round(quota * 1e9)))
            details["cpu_update"] = self._cpus.get(cid) != want
            if details["cpu_update"]:
                try:
                    await self._ctl(update_cpus, self.client, cid, cpuset_cpus=want[0], nano_cpus=want[1])
                except Exception as e:  # the engine refused (container gone, bad cpuset) or is down: nothing ran
                    return ExecResult(status=FAILED, error=f"docker update of {cid[:12]}: {why(e)}",
                                      isolation=isolation, details=details, node_down=self._lost(e))
                self._cpus[cid] = want
        token = f"{_SAFE.sub('_', placement.action_id)[:40]}.{uuid.uuid4().hex[:12]}"
        envd = dict(env or {})
        envd["TANGRAM_DOP"] = str(placement.dop)
        envd["TANGRAM_ACTION_TOKEN"] = token + ".w"
        argv = ["bash", "-c", WRAPPER, command, token]
        run = self._start_exec(self._run_exec, cid, argv, envd, None if stdin is None else bytes(stdin))
        status, error = None, None
        try:
            await asyncio.wait_for(asyncio.shield(run), timeout_s)
        except asyncio.TimeoutError:
            status, error = TIMEOUT, f"killed after {timeout_s:g} s"
            if await self._kill_through_cancels(cid, token, run):  # cancelled meanwhile: the kill went on
                raise asyncio.CancelledError() from None
        except asyncio.CancelledError:
            await self._kill_through_cancels(cid, token, run)
            raise
        except Exception as e:  # the exec could not run (container stopped, OOM-killed) or the engine died
            return ExecResult(status=FAILED, error=f"docker exec in {cid[:12]}: {why(e)}", isolation=isolation,
                              details=details, node_down=self._lost(e))
        details["duration_s"] = time.perf_counter() - t0
        if not run.done():
            return ExecResult(status=status or FAILED, error=f"{error}; the exec did not end after the kill",
                              isolation=isolation, details=details)
        out, err, rc, exec_id, truncated = run.result()
        details["exec_id"] = exec_id
        details["truncated"] = truncated
        if status is None:
            status = SUCCEEDED if rc == 0 else FAILED
            error = None if rc == 0 else f"exit code {rc}"
        return ExecResult(status=status, exit_code=rc, stdout=out, stderr=err, error=error, isolation=isolation,
                          truncated=truncated, details=details)

    async def _kill_through_cancels(self, cid: str, token: str, run: asyncio.Future) -> bool:
        """Kill an exec and return once the kill ended, whatever cancels come meanwhile (each one sends
        SIGKILL at once); its own errors are logged. True if cancelled meanwhile."""
        kill = asyncio.ensure_future(self._kill_inside(cid, token, run))
        again = lambda: self._ctl(self._signal, cid, token, "KILL").add_done_callback(quiet)  # noqa: E731
        cancelled = await wait_through_cancels(kill, again)
        quiet(kill)
        return cancelled

    def _run_exec(self, cid: str, argv: list[str], envd: dict[str, str],
                  stdin: bytes | None = None) -> tuple[str, str, int | None, str, bool]:
        import docker

        api = self.client.api
        try:
            ex = api.exec_create(cid, argv, environment=envd, workdir="/work", stdout=True, stderr=True,
                                 stdin=stdin is not None)
        except docker.errors.APIError as e:
            if e.status_code != 409 or "not running" not in str(e):
                raise
            self._revive(cid)  # stopped, and nothing of the action ran yet: start it again, then run
            ex = api.exec_create(cid, argv, environment=envd, workdir="/work", stdout=True, stderr=True,
                                 stdin=stdin is not None)
        lim = self.max_output_bytes
        out, err, truncated = bytearray(), bytearray(), False
        sock = None
        if stdin is None:
            frames = api.exec_start(ex["Id"], stream=True, demux=True)
        else:  # the hijacked connection: stdin written by a thread (the command may print before reading), then EOF
            from docker.utils.socket import demux_adaptor, frames_iter

            sock = api.exec_start(ex["Id"], socket=True)
            threading.Thread(target=send_and_close, args=(getattr(sock, "_sock", sock), stdin), daemon=True,
                             name="tangram-docker-stdin").start()
            frames = (demux_adaptor(*f) for f in frames_iter(sock, tty=False))
        try:
            # streamed: memory stays bounded by the cap whatever the command prints; the rest is drained
            for o, e in frames:
                for chunk, buf in ((o, out), (e, err)):
                    if chunk:
                        room = lim - len(buf)
                        if len(chunk) > room:
                            truncated = True
                        if room > 0:
                            buf += chunk[:room]
        finally:
            if sock is not None:
                sock.close()
        rc = api.exec_inspect(ex["Id"]).get("ExitCode")
        return out.decode(errors="replace"), err.decode(errors="replace"), rc, ex["Id"], truncated

    def _signal(self, cid: str, token: str, sig: str) -> None:
        self._run_inside(cid, ["bash", "-c", KILLER, "killer", token, sig])

    async def _kill_inside(self, cid: str, token: str, run: asyncio.Future) -> None:
        """Kill the action's processes inside the container; return once its exec has ended.

        SIGTERM, then SIGKILL after the grace, repeated until the exec ends
        (it may have started only after the first kill, when the timeout was
        shorter than the exec's start-up).
        """
        try:
            await self._ctl(self._signal, cid, token, "TERM")
            await asyncio.wait_for(asyncio.shield(run), self.kill_grace_s)
            return
        except asyncio.TimeoutError:
            pass
        except Exception:  # the exec itself failed: nothing left to kill
            if run.done():
                return
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            await self._ctl(self._signal, cid, token, "KILL")
            try:
                await asyncio.wait_for(asyncio.shield(run), 1.0)
                return
            except asyncio.TimeoutError:
                continue
            except Exception:
                return
        log.error("docker executor: exec in %s did not end after SIGKILL", cid[:12])
