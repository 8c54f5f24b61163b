"""An offline kit to run verl's real agent-loop machinery without a model or GPU.

* :func:`make_model_dir` writes a byte-level tokenizer (built with
  ``tokenizers``, wrapped as a HF ``PreTrainedTokenizerFast`` with a ChatML
  template that renders tool calls Hermes-style) and a tiny ``config.json``:
  enough for verl's ``HFModelConfig`` (no weights are ever loaded).
* :class:`ScriptedLLM` stands in for verl's LLM server client: its
  ``generate`` decodes the prompt and answers with what a script returns.
* :func:`verl_config` composes verl's real ``ppo_trainer`` config with
  overrides.
* :func:`serve` starts a real ``tangram serve`` subprocess on 127.0.0.1.

Used by tests/test_verl_*.py; handy to try a dataset's tangram specs locally.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% if m.get('tool_calls') %}{% for tc in m['tool_calls'] %}"
    "<tool_call>{\"name\": {{ tc['function']['name'] | tojson }}, \"arguments\": "
    "{% if tc['function']['arguments'] is string %}{{ tc['function']['arguments'] }}"
    "{% else %}{{ tc['function']['arguments'] | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS = "<|im_end|>"


def make_tokenizer():
    """A byte-level BPE tokenizer with no merges (every byte is a token) + ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", EOS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model_dir(path: str | os.PathLike) -> Path:
    """Write tokenizer files and a tiny Qwen2-shaped config.json into ``path``."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    fast = make_tokenizer()
    fast.save_pretrained(p)
    cfg = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": len(fast),
           "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "max_position_embeddings": 8192, "eos_token_id": fast.eos_token_id,
           "pad_token_id": fast.pad_token_id, "torch_dtype": "float32"}
    (p / "config.json").write_text(json.dumps(cfg))
    return p


CALC_FILES = {
    "pytest.ini": "[pytest]\naddopts = -p no:cacheprovider\n",
    "test_calc.py": ("from calc import add\n\n"
                     "def test_small():\n    assert add(1, 2) == 3\n\n"
                     "def test_zero():\n    assert add(0, 0) == 0\n\n"
                     "def test_negative():\n    assert add(-1, -1) == -2\n"),
}


def calc_project(path: str | os.PathLike) -> Path:
    """A tiny real pytest project whose three tests need a ``calc.py`` with ``add``."""
    p = Path(path)
    for name, text in CALC_FILES.items():
        (p / name).write_text(text)
    return p


def calc_setup_command() -> str:
    """A ``setup_command`` that writes :data:`CALC_FILES` into the environment (a sandboxed
    environment sees none of the host's files, as a ``git clone`` would not need them)."""
    import shlex

    return " && ".join(f"printf %s {shlex.quote(text)} > {shlex.quote(name)}" for name, text in CALC_FILES.items())


def tool_call(name: str, **arguments: Any) -> str:
    """The Hermes-format text of one tool call (what verl's ``hermes`` parser extracts)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class ScriptedLLM:
    """verl's LLM server client, scripted: ``script(prompt_text, turn) -> response text``.

    ``turn`` counts the assistant turns already in the prompt (0 for the
    first). Every call is recorded in ``calls`` as (request_id, prompt_text).
    """

    def __init__(self, tokenizer, script: Callable[[str, int], str]):
        self.tokenizer = tokenizer
        self.script = script
        self.calls: list[tuple[str, str]] = []

    async def generate(self, *, request_id: str, prompt_ids: Sequence[int], sampling_params: dict, **kw: Any):
        from verl.workers.rollout.replica import TokenOutput

        text = self.tokenizer.decode(list(prompt_ids))
        self.calls.append((request_id, text))
        turn = len(re.findall(r"<\|im_start\|>assistant\n(?!$)", text))
        reply = self.script(text, turn)
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.convert_tokens_to_ids(EOS)]
        return TokenOutput(token_ids=ids, log_probs=[0.0] * len(ids), stop_reason="completed", num_preempted=0)


def verl_config(model_dir: str | os.PathLike, overrides: Sequence[str] = ()) -> Any:
    """verl's real ``ppo_trainer`` config with a CPU-friendly rollout section and ``overrides``."""
    import verl
    from hydra import compose, initialize_config_dir

    conf_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    base = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.prompt_length=2048",
        "actor_rollout_ref.rollout.response_length=2048",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
    ]
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=base + list(overrides))


@contextlib.contextmanager
def serve(*, token: str | None = None, tmp: str | os.PathLike | None = None, config: str | None = None,
          timeout_s: float = 60.0, port: int = 0) -> Iterator[str]:
    """Run ``tangram serve --host 127.0.0.1 --port PORT`` (any free port unless given; no config unless
    given) and yield its base URL.

    Its state lives in a temporary directory of its own, removed afterwards: a throwaway service
    never shares (nor is refused) the default state directory of the nodes it serves."""
    from tangram.service.launch import start_serve

    args = ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    if config:
        args += ["--config", str(config)]
    if token:
        tf = Path(tmp or ".") / "tangram-token"
        tf.write_text(token)
        args += ["--token-file", str(tf)]
    else:
        args += ["--no-auth"]
    with start_serve(args, wait_s=timeout_s, throwaway_state=True) as srv:
        yield srv.url


def toy_reward_model():
    """A served "reward model" for CPU tests (a ``factory`` of a ``gpu_nodes`` service):
    the score of a text is how many ``!`` it contains (byte-level tokenizer above)."""
    import torch

    from tangram.executors.torch_gpu import ServedModel

    tok = make_tokenizer()
    bang = tok.convert_tokens_to_ids("!")

    class CountBangs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, input_ids):
            return (input_ids == bang).sum(dim=1).to(torch.float32) * self.scale

    return ServedModel(CountBangs(), tokenizer=tok)


class LocalActor:
    """An in-process stand-in for a Ray actor handle: ``handle.method.remote(...)`` returns the
    method's awaitable, so verl's workers can call verl's real ``RewardLoopWorker`` without Ray."""

    def __init__(self, obj: Any):
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._obj, name)
        return type(name, (), {"remote": staticmethod(lambda *a, **kw: method(*a, **kw))})


def reward_loop_workers(config: Any, n: int = 1) -> list[LocalActor]:
    """verl's own ``RewardLoopWorker`` (the reward manager the config names), as actor handles."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    return [LocalActor(RewardLoopWorker(config)) for _ in range(n)]


def rollout_rows(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Dataset columns (numpy object arrays) for ``rows`` of ``{prompt, agent_name, data_source,
    ground_truth, tangram}``, the way verl's RLHFDataset hands them to the rollout."""
    import numpy as np

    def col(values):
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
        return arr

    return {
        "raw_prompt": col([[{"role": "user", "content": r["prompt"]}] for r in rows]),
        "agent_name": col([r.get("agent_name", "tangram_agent") for r in rows]),
        "data_source": col([r.get("data_source", "tangram/test") for r in rows]),
        "reward_model": col([{"style": "rule", "ground_truth": r.get("ground_truth", "")} for r in rows]),
        "extra_info": col([{"index": i, **({"tangram": r["tangram"]} if r.get("tangram") else {})}
                           for i, r in enumerate(rows)]),
        "tools_kwargs": col([{} for _ in rows]),
        "index": np.arange(len(rows)),
    }
