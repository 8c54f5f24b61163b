"""verl tools whose every call is one Tangram action.

* :class:`TangramSandboxTool` runs a shell command (``exec``) in the
  trajectory's environment: created on the trajectory's first call, kept
  across turns (files persist), released at trajectory end by the
  ``tangram_agent`` loop (or by the TTL sweep). Cores are held only while a
  command runs.
* :class:`TangramApiTool` makes one HTTP call (``http``) through an API pool
  of the service (``resources.api``), which does the rate limiting.

Both are declared in a verl tool YAML (see ``examples/tool_config.yaml``);
their ``config`` block may set ``url`` / ``token`` of the service (default:
the trainer's ``custom.tangram`` block, else ``TANGRAM_URL`` /
``TANGRAM_TOKEN``).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from integrations.verl import guard
from integrations.verl.config import TangramSettings, active_settings
from integrations.verl.session import REGISTRY, EnvSpec, TangramServiceError, get_client, new_key, retrying

log = logging.getLogger("integrations.verl")

_SETTING_KEYS = ("url", "token", "token_file", "image", "memory_mb", "env_ttl_s", "tool_timeout_s",
                 "request_timeout_s", "retry_s", "admission_wait_s", "job")


def trajectory_key(agent_data: Any) -> str | None:
    """The registry key of the trajectory a tool call belongs to (None outside an agent loop)."""
    if agent_data is None:
        return None
    return getattr(agent_data, "tangram_trajectory", None) or getattr(agent_data, "request_id", None)


class _TangramTool(BaseTool):
    default_schema: dict[str, Any] = {}

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        if tool_schema is None:
            tool_schema = OpenAIFunctionToolSchema.model_validate(self.default_schema)
        super().__init__(config or {}, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    def settings(self) -> TangramSettings:
        """The effective service settings: this tool's YAML over the process's."""
        return active_settings().merged({k: self.config.get(k) for k in _SETTING_KEYS if self.config.get(k)})

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = dict(kwargs.get("create_kwargs") or {})
        return instance_id, ToolResponse()

    async def release(self, instance_id: str, **kwargs) -> None:
        # the trajectory's environment outlives the call; only a call made
        # outside any trajectory owns (and drops) its own environment
        self._instances.pop(instance_id, None)
        await REGISTRY.release(f"instance:{instance_id}")

    @staticmethod
    def _response(text: str, status: str, rec: dict[str, Any], key: str,
                  agent_data: Any = None) -> tuple[ToolResponse, float, dict]:
        if agent_data is not None and isinstance(getattr(agent_data, "extra_fields", None), dict):
            # every action of the trajectory so far (its setup included), for the reward step's metrics
            agent_data.extra_fields["tangram_trace"] = REGISTRY.records(key) or [rec]
        return ToolResponse(text=text), 0.0, {**rec, "status": status}

    def _failed(self, exc: Exception, key: str, agent_data: Any) -> tuple[ToolResponse, float, dict]:
        """The service failed (after retries): the model is told, and the trajectory is marked so
        that its reward raises instead of scoring a trajectory the infrastructure broke."""
        log.warning("tangram tool %s: %s", self.name, exc)
        fields = getattr(agent_data, "extra_fields", None)
        if isinstance(fields, dict):
            fields.setdefault("tangram_error", f"tool {self.name}: {exc}")
            fields["tangram_trace"] = REGISTRY.records(key)
        return ToolResponse(text=f"Error: the sandbox service failed: {exc}"), 0.0, {"status": "error"}


class TangramSandboxTool(_TangramTool):
    """``{"command": "..."}`` -> stdout / stderr / exit code of that command in the trajectory's sandbox.

    config keys (all optional): ``cpu`` (int or ``{min, max}``; default 1),
    ``profile`` (the service's profile class), ``timeout_s``, ``image``,
    ``memory_mb``, ``setup_command`` (run once in a new environment),
    ``max_output_chars``; plus ``url`` / ``token``.
    Per sample, ``tools_kwargs.<name>.create_kwargs`` may set ``image``,
    ``memory_mb`` and ``setup_command`` too.
    """

    default_schema = {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in your sandbox (its files persist across calls).",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "the bash command to run"}},
                "required": ["command"],
            },
        },
    }

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        command = parameters.get("command") if isinstance(parameters, dict) else None
        if not isinstance(command, str) or not command.strip():
            return ToolResponse(text="Error: 'command' must be a non-empty string."), 0.0, {"status": "invalid"}
        settings = self.settings()
        key = trajectory_key(kwargs.get("agent_data")) or f"instance:{instance_id}"
        spec = EnvSpec.from_mapping(self._instances.get(instance_id),
                                    EnvSpec.from_mapping({k: self.config.get(k) for k in
                                                          ("image", "memory_mb", "setup_command")
                                                          if self.config.get(k) is not None}))
        agent_data = kwargs.get("agent_data")
        try:
            env_id = await REGISTRY.ensure(key, settings, spec)
            # the environment's service, also when this tool's YAML names another one
            settings = REGISTRY.settings_of(key) or settings
            # handed to verl's reward step, which scores in it and deletes it
            if agent_data is not None and isinstance(getattr(agent_data, "extra_fields", None), dict):
                agent_data.extra_fields["tangram_environment"] = env_id
                agent_data.extra_fields["tangram_url"] = settings.url
            idem = new_key()  # a retry after a lost answer waits for this command, never runs it twice
            r = await retrying(lambda: get_client(settings).exec(
                env_id, command, cpu=self.config.get("cpu", 1), profile=self.config.get("profile"),
                timeout_s=float(self.config.get("timeout_s") or settings.tool_timeout_s), idempotency_key=idem),
                settings, f"tool {self.name}")
        except Exception as exc:  # noqa: BLE001 - whatever broke the call breaks the trajectory, loudly
            return self._failed(exc, key, agent_data)
        rec = REGISTRY.record(key, "exec", self.name, r)
        if why := guard.did_not_run(r, "exec"):
            # the command never ran to an exit code: the service failed or cancelled it (an executor crash,
            # not started, its node down, its environment deleted, a timeout no executor ended), not the
            # model: no result to show, a broken trajectory, and a failure of the service in a row
            exc = TangramServiceError(f"the command did not run to an exit code ({why})")
            await guard.no_result(settings, str(exc), f"tool {self.name}")
            return self._failed(exc, key, agent_data)
        guard.verdict(settings)  # it ran: the service does the run's work
        limit = int(self.config.get("max_output_chars") or 8000)
        parts = []
        if r.status == "timeout":
            parts.append("[timed out]")
        out = (r.stdout or "")[-limit:]
        err = (r.stderr or "")[-limit:]
        if out:
            parts.append(out.rstrip("\n"))
        if err:
            parts.append("[stderr]\n" + err.rstrip("\n"))
        parts.append(f"[exit code: {r.exit_code}]")
        return self._response("\n".join(parts), r.status, rec, key, agent_data)


class TangramApiTool(_TangramTool):
    """One HTTP call through a rate-limited API pool of the service.

    config keys: ``endpoint`` (the target URL; ``{param}`` placeholders are
    filled from the call's arguments), ``method`` (default POST: the
    arguments are the JSON body; GET: they are left to the URL template),
    ``api`` (the service's API pool name, required), ``headers``,
    ``timeout_s``, ``max_output_chars``; plus ``url`` / ``token`` of the
    service itself.
    """

    default_schema = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Query the search API.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to search for"}},
                "required": ["query"],
            },
        },
    }

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        settings = self.settings()
        endpoint = self.config.get("endpoint")
        api = self.config.get("api")
        if not endpoint or not api:
            return ToolResponse(text="Error: tool misconfigured (endpoint and api are required)."), 0.0, {
                "status": "invalid"}
        params = parameters if isinstance(parameters, dict) else {}
        try:
            target = endpoint.format(**{k: str(v) for k, v in params.items()})
        except (KeyError, IndexError) as exc:
            return ToolResponse(text=f"Error: missing argument {exc}"), 0.0, {"status": "invalid"}
        method = str(self.config.get("method") or "POST").upper()
        body: dict[str, Any] = {"kind": "http", "url": target, "method": method, "resources": {"api": api},
                                "timeout_s": float(self.config.get("timeout_s") or settings.tool_timeout_s)}
        if self.config.get("headers"):
            body["headers"] = {str(k): str(v) for k, v in dict(self.config["headers"]).items()}
        if method not in ("GET", "HEAD", "DELETE"):
            body["json"] = params
        key = trajectory_key(kwargs.get("agent_data")) or f"instance:{instance_id}"
        if REGISTRY.environment_of(key) is None and key not in REGISTRY.keys():
            REGISTRY.declare(key, settings)  # timings of API-only trajectories are collected too
        body["trajectory"] = key[:256]  # the order credits its generation (the service maps it to its environment)
        try:
            idem = new_key()
            r = await retrying(lambda: get_client(settings).run_action(body, idempotency_key=idem), settings,
                               f"tool {self.name}")
        except Exception as exc:  # noqa: BLE001 - see TangramSandboxTool.execute
            return self._failed(exc, key, kwargs.get("agent_data"))
        rec = REGISTRY.record(key, "http", self.name, r)
        why = guard.did_not_run(r, "http")
        if why:  # cancelled by someone else (this call still waits), or never made (an executor error, not
            # started): no answer to show the model; a failure of the service in a row
            exc = TangramServiceError(f"the service did not make the call ({why})")
            await guard.no_result(settings, str(exc), f"tool {self.name}")
            return self._failed(exc, key, kwargs.get("agent_data"))
        guard.verdict(settings)  # the call was made, whatever the upstream answered
        out = r.output if isinstance(r.output, dict) else {}
        payload = out.get("body")
        text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        limit = int(self.config.get("max_output_chars") or 8000)
        if r.status != "succeeded":
            text = f"[{r.status}: HTTP {out.get('status')}] {r.error or ''} {text or ''}".strip()
        return self._response((text or "")[:limit], r.status, rec, key, kwargs.get("agent_data"))
