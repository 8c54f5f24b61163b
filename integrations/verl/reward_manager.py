"""The ``tangram`` reward manager of verl's reward loop.

``reward.reward_manager.name=tangram`` scores every sample with one reward
action on the scheduler (a test suite with elastic DoP on CPU, or a reward
model on GPU; see :mod:`integrations.verl.reward`). Samples without a tangram
spec, or a configured ``custom_reward_function``, are scored the way verl's
``naive`` manager would. The reward loop runs ``run_single`` for many samples
at once, so the service sees the whole batch and arranges it.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any

from verl import DataProto
from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.utils.reward_score import default_compute_score

from integrations.verl.config import set_active, settings_from_config
from integrations.verl.reward import _plain, reward_spec, run_reward

log = logging.getLogger("integrations.verl")


class TangramRewardManager(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None,
                 reward_model_tokenizer=None, **kwargs: Any):
        super().__init__(config, tokenizer, compute_score)
        self.settings = settings_from_config(config)
        set_active(self.settings)
        # verl hands every manager its default scorer when no custom one is configured
        self.custom_score = compute_score if compute_score not in (None, default_compute_score) else None

    async def run_single(self, data: DataProto) -> dict:
        data = data[-1:]
        item = data[0]
        response_ids = item.batch["responses"]
        n = response_ids.shape[-1]
        valid = int(item.batch["attention_mask"][-n:].sum())
        response_str = await self.loop.run_in_executor(
            None, lambda: self.tokenizer.decode(response_ids[:valid], skip_special_tokens=True))
        nt = item.non_tensor_batch
        data_source = nt.get("data_source")
        reward_model = _plain(nt.get("reward_model")) or {}
        ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        extra_info = dict(_plain(nt.get("extra_info")) or {})
        spec = reward_spec(extra_info, reward_model)
        if spec is not None and self.custom_score is None:
            result = await run_reward(spec, settings=self.settings, solution=response_str,
                                      prompt=str(extra_info.get("prompt") or ""), ground_truth=ground_truth)
        else:
            fn = self.custom_score or default_compute_score
            kwargs = dict(data_source=data_source, solution_str=response_str, ground_truth=ground_truth,
                          extra_info=extra_info)
            if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "func", None)):
                result = await fn(**kwargs)
            else:
                result = await self.loop.run_in_executor(None, lambda: fn(**kwargs))
        if isinstance(result, dict):
            return {"reward_score": float(result["score"]), "reward_extra_info": dict(result)}
        return {"reward_score": float(result), "reward_extra_info": {"acc": float(result)}}


# Registered by hand, not with @register: this file may also be loaded by path
# (reward.reward_manager.source=importlib), which makes a second class object that
# verl's decorator would reject as a different "tangram".
REWARD_MANAGER.setdefault("tangram", TangramRewardManager)
