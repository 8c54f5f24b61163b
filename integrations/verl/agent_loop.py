"""The ``tangram_agent`` loop: verl's multi-turn ``ToolAgentLoop`` plus the
lifecycle of the trajectory's sandbox, handed to verl's reward step.

Per trajectory:

1. a unique key is attached to verl's ``AgentData`` (``tangram_trajectory``);
   the tools (:mod:`integrations.verl.tools`) use it to find the trajectory's
   environment, which the service creates on the first action (and runs the
   sample's ``setup_command`` in; a failed setup fails the trajectory);
2. generation and tool calls run exactly as in ``ToolAgentLoop`` (no cores
   are held while the LLM generates: the service allocates per action);
3. at the end the loop does not score: it hands verl's reward step what the
   reward needs, in ``extra_fields`` (which verl passes to the reward manager
   as ``tool_extra_fields`` and to ``compute_score`` inside ``extra_info``):
   ``tangram_environment`` (kept alive; the reward deletes it after scoring),
   ``tangram_last_turn`` (the ``[start, end)`` token span of the last
   generated turn inside ``response_ids``, after verl's ``response_length``
   cut) and ``tangram_last_turn_text`` (those tokens decoded). So the reward
   is the same whichever loop produced the sample;
4. on an error or cancellation the environment is deleted at once.

Select it per sample with the dataset column ``agent_name=tangram_agent``
(registered by the ``verl.plugins`` entry point, or by
``rollout.agent.agent_loop_config_path=integrations/verl/examples/agent_loop.yaml``).
"""
from __future__ import annotations

import logging
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from integrations.verl.config import set_active, settings_from_config, token_in_config
from integrations.verl.reward import _plain, env_spec, last_turn_span
from integrations.verl.session import REGISTRY

log = logging.getLogger("integrations.verl")

_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


@register("tangram_agent")
class TangramAgentLoop(ToolAgentLoop):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tangram = settings_from_config(self.config)
        if self.tangram.enabled:
            set_active(self.tangram)
        else:
            _warn_once("disabled", "tangram_agent: the integration is disabled (set "
                       "+actor_rollout_ref.rollout.custom.tangram.enabled=true or TANGRAM_ENABLED=1); "
                       "running as tool_agent")
        if token_in_config(self.config):
            _warn_once("token", "tangram: the service token is in the trainer config, which verl prints at "
                       "start; set custom.tangram.token_file (or TANGRAM_TOKEN_FILE) instead")
        for tool in self.tools.values():
            limit = (getattr(tool, "config", None) or {}).get("max_output_chars")
            if limit and self.max_tool_response_length and int(limit) > self.max_tool_response_length:
                _warn_once(f"trunc:{tool.name}", "tangram_agent: tool %s keeps up to %s characters of output, but "
                           "verl cuts every tool response to multi_turn.max_tool_response_length=%s; raise it",
                           tool.name, limit, self.max_tool_response_length)
        self._tangram_key: str | None = None

    async def _handle_pending_state(self, agent_data, sampling_params):
        agent_data.tangram_trajectory = self._tangram_key
        return await super()._handle_pending_state(agent_data, sampling_params)

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> AgentLoopOutput:
        key = self._tangram_key = f"traj-{uuid4().hex}"
        info = _plain(kwargs.get("extra_info")) or {}
        REGISTRY.declare(key, self.tangram, env_spec(info, kwargs.get("tools_kwargs"), kwargs.get("reward_model")))
        try:
            output = await super().run(sampling_params, priority=priority, **kwargs)
        except BaseException:
            await REGISTRY.release(key)
            raise
        env_id = REGISTRY.hand_over(key)
        start, end = last_turn_span(output.response_mask)
        fields = output.extra_fields
        fields["tangram_last_turn"] = [start, end]
        fields["tangram_last_turn_text"] = self.tokenizer.decode(output.response_ids[start:end],
                                                                 skip_special_tokens=True)
        if env_id is not None:
            fields["tangram_environment"] = env_id
        fields["tangram_trajectory"] = key  # what its tool calls named (its reward model's too)
        return output
