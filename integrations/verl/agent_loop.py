"""The ``tangram_agent`` loop: verl's multi-turn ``ToolAgentLoop`` plus the
lifecycle of the trajectory's sandbox and a final reward on the scheduler.

Per trajectory:

1. a unique key is attached to verl's ``AgentData`` (``tangram_trajectory``);
   the tools (:mod:`integrations.verl.tools`) use it to find the trajectory's
   environment, which the service creates on the first action (and runs the
   sample's ``setup_command`` in);
2. generation and tool calls run exactly as in ``ToolAgentLoop`` (no cores
   are held while the LLM generates: the service allocates per action);
3. at the end, if the sample has a tangram reward spec (``extra_info.tangram``
   with a ``test_command``, or a reward-model spec), the reward runs as one
   action in the same environment (elastic DoP: ``cpu: {min, max}``,
   ``${parallel_num}`` in the command) and fills ``reward_score``; verl then
   skips its own reward computation for this sample;
4. the environment is deleted (also on error or cancellation), and the
   trajectory's action timings go into ``extra_fields`` (``tangram_*`` keys,
   one column each in the batch) and ``metrics.compute_score``.

Select it per sample with the dataset column ``agent_name=tangram_agent``
(registered by the ``verl.plugins`` entry point, or by
``rollout.agent.agent_loop_config_path=integrations/verl/examples/agent_loop.yaml``).
"""
from __future__ import annotations

import logging
import time
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from integrations.verl.config import set_active, settings_from_config
from integrations.verl.reward import _plain, reward_spec, run_reward
from integrations.verl.session import REGISTRY, EnvSpec, summarize

log = logging.getLogger("integrations.verl")

_ENV_KEYS = ("image", "memory_mb", "setup_command", "labels")
_warned_disabled = False


def _env_spec(info: Any, tools_kwargs: Any) -> EnvSpec:
    spec = EnvSpec()
    if isinstance(info, dict) and isinstance(_plain(info.get("tangram")), dict):
        spec = EnvSpec.from_mapping({k: v for k, v in _plain(info["tangram"]).items() if k in _ENV_KEYS}, spec)
    # a tool's per-sample create_kwargs may describe the environment too
    for tk in (_plain(tools_kwargs) or {}).values() if isinstance(_plain(tools_kwargs), dict) else ():
        ck = tk.get("create_kwargs") if isinstance(tk, dict) else None
        if isinstance(ck, dict) and any(k in ck for k in _ENV_KEYS):
            spec = EnvSpec.from_mapping({k: v for k, v in ck.items() if k in _ENV_KEYS}, spec)
    return spec


@register("tangram_agent")
class TangramAgentLoop(ToolAgentLoop):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tangram = settings_from_config(self.config)
        if self.tangram.enabled:
            set_active(self.tangram)
        else:
            global _warned_disabled
            if not _warned_disabled:
                _warned_disabled = True
                log.warning("tangram_agent: the integration is disabled (set "
                            "+actor_rollout_ref.rollout.custom.tangram.enabled=true or TANGRAM_ENABLED=1); "
                            "running as tool_agent, rewards are left to verl")
        self._tangram_key: str | None = None
        self._agent_data: Any = None

    async def _handle_pending_state(self, agent_data, sampling_params):
        agent_data.tangram_trajectory = self._tangram_key
        self._agent_data = agent_data
        return await super()._handle_pending_state(agent_data, sampling_params)

    def _final_assistant_text(self) -> str:
        msgs = getattr(self._agent_data, "messages", None) or []
        for m in reversed(msgs):
            if m.get("role") == "assistant":
                c = m.get("content")
                return c if isinstance(c, str) else ""
        return ""

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> AgentLoopOutput:
        key = self._tangram_key = f"traj-{uuid4().hex}"
        info = _plain(kwargs.get("extra_info")) or {}
        spec = reward_spec(info, kwargs.get("reward_model"))
        REGISTRY.declare(key, self.tangram, _env_spec(info, kwargs.get("tools_kwargs")))
        try:
            output = await super().run(sampling_params, priority=priority, **kwargs)
            if spec is not None and self.tangram.enabled and output.reward_score is None:
                await self._reward(output, key, spec, info, kwargs)
            records = REGISTRY.records(key)
            output.extra_fields.update(summarize(records))
            output.extra_fields["tangram_trace"] = records
            return output
        finally:
            await REGISTRY.release(key)

    async def _reward(self, output: AgentLoopOutput, key: str, spec: dict, info: Any, kwargs: dict) -> None:
        t0 = time.perf_counter()
        env_id = await REGISTRY.ensure(key)
        rm = _plain(kwargs.get("reward_model")) or {}
        result = await run_reward(spec, settings=self.tangram, environment=env_id,
                                  solution=self._final_assistant_text(),
                                  ground_truth=rm.get("ground_truth") if isinstance(rm, dict) else None)
        rec = {"kind": "model" if spec.get("model") and not spec.get("test_command") else "exec",
               "name": "reward", "status": result.get("tangram_status"),
               "queued_s": result.get("tangram_queued_s", 0.0), "exec_s": result.get("tangram_exec_s", 0.0),
               "overhead_s": result.get("tangram_overhead_s", 0.0), "dop": result.get("tangram_dop")}
        REGISTRY.add_record(key, rec)
        output.reward_score = float(result["score"])
        # the same keys as the `tangram` reward manager's, so a batch mixing both stays consistent
        output.extra_fields["reward_extra_info"] = dict(result)
        output.metrics.compute_score = time.perf_counter() - t0
