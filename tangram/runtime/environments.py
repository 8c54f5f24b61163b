"""The registry of trajectories' environments (a working directory or a container per node).

An environment is registered at once and created lazily on the node of its
first action (at once when there is only one node); a *one-shot*
environment is made for an exec action without one and removed after it.
Creation runs detached from the caller, so a caller that goes away never
leaves a half-made environment behind: it is undone in the background.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Mapping

from tangram.core.errors import DemandError, UnschedulableError
from tangram.executors.base import EnvironmentExecutor
from tangram.runtime.actions import ExecutorFailedError, ExecutorMissingError, UnknownEnvironmentError

log = logging.getLogger("tangram.runtime")


@dataclass(slots=True)
class Environment:
    """A trajectory's environment: created lazily on the node of its first action."""

    id: str
    image: str | None = None
    memory_mb: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    created: dict[str, "asyncio.Task[None]"] = field(default_factory=dict)  # node -> creation
    active: set[str] = field(default_factory=set)  # unfinished action ids
    oneshot: bool = False
    network: bool = False  # asked for a network (granted only by an executor whose node allows it)


class Environments:
    """Environments by id, and the executors of the nodes they live on."""

    def __init__(self, executors: Mapping[str, EnvironmentExecutor]):
        self.executors = executors
        self._envs: dict[str, Environment] = {}
        self.cleanups: set[asyncio.Task] = set()  # detached removals still running
        # called once an environment exists on a node (before any action runs in it): the service records it
        self.on_created: Callable[[Environment, str], None] | None = None

    def __contains__(self, env_id: str) -> bool:
        return env_id in self._envs

    def refusal(self, image: str | None, network: bool) -> tuple[str, str] | None:
        """``(field, reason)`` when no node's executor (as built: ``executor: auto`` resolved) could make
        such an environment, else None. A Docker node takes only its allowed images, never a pulled
        name; a network only where a local node allows it (``allow_network``)."""
        built = [getattr(ex, "inner", ex) for ex in self.executors.values()]  # scale-out wraps each node's
        images = {i for ex in built for i in (getattr(ex, "allowed_images", None) or ())}
        if image is not None and any(getattr(ex, "allowed_images", None) is not None for ex in built) \
                and image not in images:
            return "image", f"{image!r} is not an allowed image (allowed: {sorted(images)})"
        if network and not any(getattr(ex, "name", None) == "local" and getattr(ex, "allow_network", False)
                               for ex in built):
            return "network", "no node allows environments a network (cpu_nodes[].allow_network)"
        return None

    def get(self, env_id: str) -> Environment:
        """A registered environment (one-shot ones included); UnknownEnvironmentError otherwise."""
        env = self._envs.get(env_id)
        if env is None:
            raise UnknownEnvironmentError(f"environment {env_id!r} is unknown")
        return env

    def visible(self, env_id: str) -> Environment:
        """Like :meth:`get`, but one-shot environments are nobody else's business."""
        env = self._envs.get(env_id)
        if env is None or env.oneshot:
            raise UnknownEnvironmentError(f"environment {env_id!r} is unknown")
        return env

    def listed(self) -> list[Environment]:
        return [e for e in self._envs.values() if not e.oneshot]

    def all(self) -> Iterable[Environment]:
        return list(self._envs.values())

    async def create(self, *, image: str | None, memory_mb: int, labels: Mapping[str, str] | None,
                     env_id: str | None, largest_node_mb: int | None, network: bool = False) -> str:
        """Validate and register an environment; on a single node it is made now."""
        if image is not None and (not isinstance(image, str) or not image):
            raise DemandError("image", f"must be a non-empty string, got {image!r}")
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 0:
            raise DemandError("memory_mb", f"must be a non-negative integer, got {memory_mb!r}")
        if labels is not None and (not isinstance(labels, Mapping)
                                   or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())):
            raise DemandError("labels", "must be an object of string values")
        if not self.executors:
            raise ExecutorMissingError("environment", "no CPU node with an environment executor is configured")
        if memory_mb and largest_node_mb is not None and memory_mb > largest_node_mb:
            raise UnschedulableError("memory_mb", f"needs {memory_mb} MiB, the largest node has {largest_node_mb}")
        env_id = env_id or f"env-{uuid.uuid4().hex[:16]}"
        if env_id in self._envs:
            raise DemandError("id", f"environment {env_id!r} exists")
        env = Environment(id=env_id, image=image, memory_mb=memory_mb, labels=dict(labels or {}), network=network)
        self._envs[env_id] = env
        nodes = list(self.executors)
        if len(nodes) == 1:  # one node: the environment can only live there, make it now
            try:
                await self.ensure_created(env, nodes[0])
            except Exception as exc:
                self._envs.pop(env_id, None)
                raise ExecutorFailedError(f"creating environment {env_id} on {nodes[0]!r} failed: "
                                          f"{type(exc).__name__}: {exc}") from exc
            except BaseException:  # the caller went away: the creation goes on, so undo it after
                self._envs.pop(env_id, None)
                self.background(self.destroy(env))
                raise
        return env_id

    def adopt(self, env_id: str, *, image: str | None, memory_mb: int, labels: Mapping[str, str],
              node: str | None, network: bool = False) -> Environment:
        """Register an environment a previous run of the service made: existing on ``node``, or, with
        ``node`` None, not made on any node yet (it had no action; it is made with its first one)."""
        env = Environment(id=env_id, image=image, memory_mb=memory_mb, labels=dict(labels), network=network)
        if node is not None:
            made = asyncio.get_running_loop().create_future()
            made.set_result(None)
            env.created[node] = made  # type: ignore[assignment] - a finished creation
        self._envs[env_id] = env
        return env

    def oneshot(self, env_id: str, memory_mb: int) -> Environment:
        """Register a one-shot environment (removed after its only action)."""
        env = Environment(id=env_id, memory_mb=memory_mb, oneshot=True)
        self._envs[env.id] = env
        return env

    def put_back(self, env: Environment) -> None:
        """Register ``env`` again after its removal failed (a later DELETE tries again)."""
        self._envs.setdefault(env.id, env)

    def remove(self, env_id: str) -> Environment:
        """Unregister a (visible) environment; the caller destroys it."""
        env = self.visible(env_id)
        del self._envs[env_id]
        return env

    async def ensure_created(self, env: Environment, node: str) -> None:
        """Create ``env`` on ``node`` once; concurrent callers share the one creation."""
        if node not in self.executors:
            raise RuntimeError(f"node {node!r} has no environment executor")
        task = env.created.get(node)
        if task is None:
            ex = self.executors[node]
            task = asyncio.get_running_loop().create_task(
                ex.create_environment(env.id, image=env.image, memory_mb=env.memory_mb, labels=env.labels,
                                      **({"network": True} if env.network else {})))
            env.created[node] = task
            if self.on_created is not None and not env.oneshot:
                # a callback, not code after the await: it runs even if every caller went away meanwhile
                task.add_done_callback(functools.partial(self._created, env, node))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except BaseException:
            if env.created.get(node) is task:
                del env.created[node]  # let the next action try again
            raise

    def _created(self, env: Environment, node: str, task: "asyncio.Task[None]") -> None:
        if not task.cancelled() and task.exception() is None and self._envs.get(env.id) is env:
            self.on_created(env, node)

    async def destroy(self, env: Environment) -> None:
        """Remove ``env`` from every node it was created on."""
        for node, task in list(env.created.items()):
            if not task.done():
                try:
                    await task
                except BaseException:  # noqa: BLE001 - a failed creation left nothing to destroy
                    continue
            elif task.cancelled() or task.exception() is not None:
                continue
            try:
                await self.executors[node].destroy_environment(env.id)
            except Exception as exc:  # the node's engine failed (a 502 to the caller, who may try again)
                raise ExecutorFailedError(f"removing environment {env.id} from {node!r} failed: "
                                          f"{type(exc).__name__}: {exc}") from exc
            del env.created[node]  # what a later try need not remove again
        env.created.clear()

    async def drop(self, env: Environment) -> None:
        """Unregister and destroy (a one-shot environment after its action)."""
        self._envs.pop(env.id, None)
        await self.destroy(env)

    def background(self, coro: Awaitable[None]) -> None:
        """Run cleanup detached from the (cancelled) caller, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self.cleanups.add(task)
        task.add_done_callback(self.cleanups.discard)

    async def close_keeping(self, close_trajectory) -> None:
        """Shut down leaving every (non one-shot) environment on its node; one-shot ones are removed."""
        if self.cleanups:
            await asyncio.gather(*list(self.cleanups), return_exceptions=True)
        for env in list(self._envs.values()):
            close_trajectory(env.id)
            if env.oneshot:
                try:
                    await self.destroy(env)
                except Exception:  # noqa: BLE001 - best effort on shutdown
                    log.exception("removing environment %s failed", env.id)
        self._envs.clear()

    async def close(self, close_trajectory) -> None:
        """Wait for detached cleanups, then remove every environment (``close_trajectory`` frees its node)."""
        if self.cleanups:
            await asyncio.gather(*list(self.cleanups), return_exceptions=True)
        for env in list(self._envs.values()):
            try:
                close_trajectory(env.id)
                await self.destroy(env)
            except Exception:  # noqa: BLE001 - best effort on shutdown
                log.exception("removing environment %s failed", env.id)
        self._envs.clear()


def network_node(executors: Mapping[str, EnvironmentExecutor], free_mb: Mapping[str, int],
                 memory_mb: int) -> str | None:
    """The node a networked environment goes to where not every node gives one: of the nodes whose
    executor allows a network, the one with the most free memory, if it has ``memory_mb``."""
    able = [n for n, ex in executors.items() if getattr(ex, "allow_network", False) and n in free_mb]
    node = max(able, key=lambda n: free_mb[n], default=None)
    return node if node is not None and free_mb[node] >= memory_mb else None


async def quietly(cleanup: Awaitable[None], what: str) -> None:
    """Await a cleanup to its end (shielded) on an error path: its own failure is logged, so the error
    being handled stays the caller's answer."""
    try:
        await asyncio.shield(cleanup)
    except Exception:  # noqa: BLE001
        log.exception("%s failed", what)
