"""The ``tangram`` reward manager of verl's reward loop.

``reward.reward_manager.name=tangram`` (or, with no registration needed,
``reward.reward_manager.source=importlib`` +
``reward.reward_manager.module.path=<repo>/integrations/verl/reward_manager.py``
+ ``reward.reward_manager.name=TangramRewardManager``) scores every sample
with one reward action on the scheduler (a test suite with elastic DoP on
CPU, or a reward model on GPU; see :mod:`integrations.verl.reward`).

What is scored is the last generated turn, decoded from the response tokens
verl hands the manager: the span the ``tangram_agent`` loop recorded
(``tangram_last_turn``), else the last run of ``response_mask`` when the
batch has one, else the whole response of a single-turn sample. A multi-turn
sample with neither is refused (its tool outputs would be scored).

Samples without a tangram spec, and every sample when the trainer configures
its own ``custom_reward_function``, are scored exactly as verl's ``naive``
manager scores them (the whole valid response, the same ``extra_info``, the
scorer verl hands the manager: the default one, or its SandboxFusion
``partial``), with verl's result keys kept and the ``tangram_*`` keys of
:data:`~integrations.verl.reward.REWARD_KEYS` beside them. The reward loop runs
``run_single`` for many samples at once, so the service sees the whole batch.

``reward.reward_model.enable=true`` with no ``custom_reward_function`` is refused
(ValueError) when the manager is built: verl's reward loop would then score every
sample with its own reward model and never call this manager.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping

from verl import DataProto
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
from verl.utils.reward_score import default_compute_score

from integrations.verl.config import set_active, settings_from_config
from integrations.verl.reward import _plain, last_turn_span, naive_keys, reward_spec, score_sample, settle_unscored

log = logging.getLogger("integrations.verl")


def _fields(nt: Mapping[str, Any]) -> dict[str, Any]:
    """The rollout's extra_fields: ``tool_extra_fields`` on the streaming path, columns on the batch path."""
    f = _plain(nt.get("tool_extra_fields"))
    out = dict(f) if isinstance(f, Mapping) else {}
    for k, v in nt.items():
        if isinstance(k, str) and k.startswith("tangram_") and k not in out:
            out[k] = _plain(v)
    return out


def response_span(item: Any, fields: Mapping[str, Any]) -> tuple[int, int]:
    """``[start, end)`` of the last generated turn within this sample's ``responses``."""
    responses = item.batch["responses"]
    n = responses.shape[-1]
    valid = int(item.batch["attention_mask"][-n:].sum())
    span = fields.get("tangram_last_turn")
    if span is not None and len(span) == 2:
        start, end = int(span[0]), int(span[1])
        return max(0, start), min(end, valid)
    if "response_mask" in item.batch.keys():
        return last_turn_span(item.batch["response_mask"][:valid])
    turns = _plain(item.non_tensor_batch.get("__num_turns__"))
    if turns is not None and int(turns) > 2:
        raise ValueError(f"a {int(turns)}-turn sample carries no span of its last generated turn (no "
                         "tangram_last_turn, no response_mask): run it with agent_name=tangram_agent")
    return 0, valid


def custom_reward_configured(config: Any) -> bool:
    """Whether the trainer names its own reward function (``reward.custom_reward_function.path``): verl
    then hands the manager that function; otherwise the default scorer, or a ``partial`` of it
    (``reward.sandbox_fusion.url``), which is not a custom function."""
    try:
        reward = config.get("reward") if config is not None else None
        fn = reward.get("custom_reward_function") if reward is not None else None
        return bool(fn.get("path")) if fn is not None else False
    except AttributeError:
        return False


def reward_model_bypasses_manager(config: Any) -> bool:
    """Whether verl's reward loop scores every sample with its own reward model and never calls the
    manager: ``reward.reward_model.enable`` with no ``reward.custom_reward_function.path``
    (``RewardLoopWorker.compute_score`` then calls ``compute_score_disrm``)."""
    try:
        reward = config.get("reward") if config is not None else None
        rm = reward.get("reward_model") if reward is not None else None
        fn = reward.get("custom_reward_function") if reward is not None else None
        return bool(rm is not None and rm.get("enable")) and (fn is None or fn.get("path") is None)
    except AttributeError:
        return False


class TangramRewardManager(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None,
                 reward_model_tokenizer=None, **kwargs: Any):
        if reward_model_bypasses_manager(config):  # every tangram spec would be ignored without a word
            raise ValueError(
                "reward.reward_model.enable=true without reward.custom_reward_function: verl's reward loop then "
                "scores every sample with its own reward model (compute_score_disrm) and never calls the tangram "
                "reward manager. Serve the reward model through tangram instead (a `model` reward spec, "
                "extra_info.tangram.model, with reward.reward_model.enable=false), or set "
                "reward.custom_reward_function")
        super().__init__(config, tokenizer, compute_score)
        self.settings = settings_from_config(config)
        set_active(self.settings)
        # what verl's naive manager would score a sample without a tangram spec with
        self.naive_score = compute_score or default_compute_score
        # a function the trainer configured scores every sample, as under naive
        self.custom_score = compute_score if compute_score is not None and custom_reward_configured(config) else None
        self.router_kwargs = ({"reward_router_address": reward_router_address,
                               "reward_model_tokenizer": reward_model_tokenizer}
                              if reward_router_address is not None else {})

    async def run_single(self, data: DataProto) -> dict:
        item = data[-1:][0]
        nt = item.non_tensor_batch
        reward_model = _plain(nt.get("reward_model")) or {}
        extra_info = dict(_plain(nt.get("extra_info")) or {})
        spec = reward_spec(extra_info, reward_model)
        if spec is None or self.custom_score is not None:
            return await self.run_as_naive(item)
        fields = _fields(nt)
        start, end = response_span(item, fields)
        ids = item.batch["responses"][start:end]
        text = await self.loop.run_in_executor(None, lambda: self.tokenizer.decode(ids, skip_special_tokens=True))
        ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
        prompt = extra_info.get("prompt")
        if not prompt and "prompts" in item.batch.keys():  # the prompt as the policy saw it, padding dropped
            p = item.batch["prompts"]
            kept = p[item.batch["attention_mask"][: p.shape[-1]].bool()]
            prompt = await self.loop.run_in_executor(
                None, lambda: self.tokenizer.decode(kept, skip_special_tokens=True))
        out = await score_sample(spec, fields, settings=self.settings, text=text,
                                 prompt=str(prompt or ""), ground_truth=ground_truth,
                                 info=extra_info, tools_kwargs=nt.get("tools_kwargs"), reward_model=reward_model)
        return {"reward_score": out["score"], "reward_extra_info": out}

    async def run_as_naive(self, item: Any) -> dict:
        """Exactly what verl's naive manager returns for ``item`` (the whole valid response decoded, its
        ``extra_info`` with the rollout's extra fields, ``num_turns`` and ``rollout_reward_scores``, the
        scorer's own result keys), with the ``tangram_*`` keys beside them (status ``none``)."""
        responses = item.batch["responses"]
        valid = int(item.batch["attention_mask"][-responses.shape[-1]:].sum())
        text = await self.loop.run_in_executor(
            None, lambda: self.tokenizer.decode(responses[:valid], skip_special_tokens=True))
        nt = item.non_tensor_batch
        return await settle_unscored(_fields(nt), self.settings, self._naive_score(item, text))

    async def _naive_score(self, item: Any, text: str) -> dict:
        nt = item.non_tensor_batch
        extra_info = dict(nt.get("extra_info", {}) or {})
        tool_extra_fields = nt.get("tool_extra_fields", None)
        if tool_extra_fields is not None:
            extra_info.update(tool_extra_fields.items())
        extra_info["num_turns"] = nt.get("__num_turns__", None)
        extra_info["rollout_reward_scores"] = nt.get("reward_scores", {})
        fn = self.custom_score or self.naive_score
        kwargs = dict(data_source=nt["data_source"], solution_str=text,
                      ground_truth=nt["reward_model"]["ground_truth"], extra_info=extra_info, **self.router_kwargs)
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "func", None)):
            got = await fn(**kwargs)
        else:
            got = await self.loop.run_in_executor(None, lambda: fn(**kwargs))
        return {"reward_score": got["score"] if isinstance(got, Mapping) else got, "reward_extra_info": naive_keys(got)}


# Registered by hand, not with @register: this file may also be loaded by path
# (reward.reward_manager.source=importlib), which makes a second class object that
# verl's decorator would reject as a different "tangram".
REWARD_MANAGER.setdefault("tangram", TangramRewardManager)
