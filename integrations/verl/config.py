"""Where the integration's settings come from (no verl import here).

One flag turns the integration on::

    +actor_rollout_ref.rollout.custom.tangram.enabled=true
    +actor_rollout_ref.rollout.custom.tangram.url=http://HOST:8471
    +actor_rollout_ref.rollout.custom.tangram.token_file=/shared/tangram-token   # optional

The token itself is best kept out of the config (verl prints its whole
config at start): ``token_file`` names a file holding it, and the
``TANGRAM_TOKEN`` / ``TANGRAM_TOKEN_FILE`` environment variables serve
processes whose environment has them. A ``token`` key is accepted too. The
settings' repr never shows the token.

``custom`` is verl's documented extension point under the rollout config (a
new key directly under ``rollout`` breaks verl's dataclass conversion). A
top-level ``+tangram.*`` block is read too, and the environment variables
``TANGRAM_ENABLED=1``, ``TANGRAM_URL``, ``TANGRAM_TOKEN`` and ``TANGRAM_TOKEN_FILE`` serve processes
that never see the trainer config (the ``verl.plugins`` entry point runs at
``import verl``, before any config exists).

Precedence, lowest first: built-in defaults < environment < top-level
``tangram`` < ``actor_rollout_ref.rollout.custom.tangram`` < what a tool's
YAML says explicitly.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

DEFAULT_URL = "http://127.0.0.1:8471"
_TRUE = frozenset({"1", "true", "yes", "on"})


def env_flag(name: str = "TANGRAM_ENABLED") -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


@dataclass(frozen=True, slots=True)
class TangramSettings:
    enabled: bool = False
    url: str = DEFAULT_URL
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None      # a file holding the token (kept out of verl's printed config)
    # environments (one per trajectory)
    image: str | None = None
    memory_mb: int | None = None
    env_ttl_s: float = 3600.0          # safety sweep: an environment idle this long is released
    # the final test-suite reward run by the tangram agent loop / reward function
    reward_cpu_max: int = 8
    reward_timeout_s: float = 600.0
    tool_timeout_s: float = 120.0
    # client side: no request to the service waits longer than this (its queueing there included; a
    # wait to be let in, admission_wait_s, comes on top), and
    # transient errors (unreachable, 502/503/504) are retried for at most retry_s after the first before failing
    request_timeout_s: float = 3600.0
    retry_s: float = 60.0
    # an action the service refused for now (429 / 503 with Retry-After: its queues are full, as when a
    # batch of thousands of trajectories arrives at once) waits and is sent again for up to this long,
    # as it would have waited in the service's queue, instead of failing its sample
    admission_wait_s: float = 3600.0
    # the job the service's admission caps and fair share count this run's actions under (X-Tangram-Job):
    # name it when several runs share one service; None: the service counts by the caller's address
    job: str | None = None
    # stop the training (integrations.verl.guard) once this many failures of the service in a row, in one worker
    # process, kept coming for retry_s (at least 30 s) more: calls that failed after their retries (not reached,
    # no answer in time, 5xx, 401/403, 429 past admission_wait_s) and actions it answered but did not run or
    # that gave no verdict; only a verdict resets the count. On verl's default path failed samples only drop
    # their groups, so a service that stays down would degrade or stall the run without stopping it. 32 and
    # the time: a few failures, or a burst of the calls in flight failing together (an outage past retry_s, a
    # restart of the service), do not stop a run; a service that stays down fails the calls that follow too.
    # 0 or None: never stop
    max_consecutive_failures: int | None = 32

    def merged(self, over: Mapping[str, Any] | None) -> "TangramSettings":
        if not over:
            return self
        known = {f.name for f in dataclasses.fields(self)}
        vals = {}
        for k, v in dict(over).items():
            if k == "max_consecutive_failures":  # null turns the guard off, as 0 does
                vals[k] = _count_setting(k, v)
                continue
            if k not in known or v is None:
                continue
            if k == "enabled":
                v = v if isinstance(v, bool) else str(v).strip().lower() in _TRUE
            elif k == "token_file" and "token" not in over:
                vals["token"] = None  # a file named here wins over a token from further down
            elif k == "token" and "token_file" not in over:
                vals["token_file"] = None
            vals[k] = v
        return dataclasses.replace(self, **vals)


def _count_setting(name: str, v: Any) -> int:
    """A count setting: a whole number >= 0 (None and false: 0)."""
    if v is None or v is False:
        return 0
    try:
        n = int(v) if isinstance(v, int) else int(str(v).strip())
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"tangram setting {name}: a whole number >= 0 (0 or null: off), got {v!r}")
    return n


def settings_from_env() -> TangramSettings:
    return TangramSettings(
        enabled=env_flag(),
        url=os.environ.get("TANGRAM_URL") or DEFAULT_URL,
        token=os.environ.get("TANGRAM_TOKEN") or None,
        token_file=os.environ.get("TANGRAM_TOKEN_FILE") or None,
        job=os.environ.get("TANGRAM_JOB") or None,
    )


def _section(cfg: Any, *path: str) -> Mapping[str, Any] | None:
    node = cfg
    for key in path:
        if node is None:
            return None
        try:
            node = node.get(key) if hasattr(node, "get") else getattr(node, key, None)
        except Exception:  # omegaconf missing-value errors and the like
            return None
    if node is None:
        return None
    try:  # DictConfig -> plain dict, resolving ${oc.env:...}
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    except ImportError:
        pass
    return node if isinstance(node, Mapping) else None


def settings_from_config(config: Any = None) -> TangramSettings:
    """The effective settings for a trainer config (a DictConfig, a dict, or None)."""
    s = settings_from_env()
    if config is None:
        return s
    s = s.merged(_section(config, "tangram"))
    custom = _section(config, "actor_rollout_ref", "rollout", "custom")
    if custom is None:  # a rollout config (not the whole trainer config) was passed
        custom = _section(config, "custom")
    if custom:
        s = s.merged(custom.get("tangram") if isinstance(custom, Mapping) else None)
    return s


def token_in_config(config: Any) -> bool:
    """Whether the trainer config holds the token itself (verl prints its config: use token_file)."""
    custom = _section(config, "actor_rollout_ref", "rollout", "custom") or _section(config, "custom") or {}
    blocks = (_section(config, "tangram"), custom.get("tangram") if isinstance(custom, Mapping) else None)
    return any(isinstance(b, Mapping) and bool(b.get("token")) for b in blocks)


# The process-level settings the trainer config set (the tangram agent loop
# publishes them when it is built); tools and the reward function fall back to
# them when their own YAML says nothing.
_active: TangramSettings | None = None


def set_active(settings: "TangramSettings | None") -> None:
    global _active
    _active = settings


def active_settings() -> TangramSettings:
    return _active if _active is not None else settings_from_env()
