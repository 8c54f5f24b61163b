"""Torch executor for GPU model actions (evict-on-execution, DESIGN.md §5).

Dumb hands for :class:`tangram.managers.gpu.GpuManager`. The driver gives it
the manager's :class:`CacheDecision` (chunk, service, hit or miss, what to
evict) and the action's payload; it

1. drops the device copies of the evicted instances (nothing is written back:
   the CPU master copy is immutable),
2. on a miss, restores the service onto every device of the chunk from the
   model's CPU master copy (pinned when CUDA is present: host-to-device copies
   from pinned memory run at full bus speed and asynchronously),
3. runs the batched inference, data-parallel over the chunk's devices
   (a DoP-k service is k replicas; each takes a contiguous shard of the inputs),
4. reports ``ExecResult.restored``/``ExecResult.restore_s``: the driver then
   calls ``GpuManager.restored`` so the books count the instance as resident.
   ``restored`` is true only on success: when a run that restored fails, times
   out or is cancelled, the executor drops what it restored itself, matching
   the books, which forget unconfirmed restores (device memory the books do
   not count would be an OOM waiting to happen).

Payload of a ``model`` action::

    {"model": name, "op": "score" | "logprobs" | "embed", "inputs": [...], "tokens"?: [[...], ...]}

* ``embed``: one vector per input (masked mean over tokens for sequence
  outputs, L2-normalised if the model says so).
* ``score``: one float per input: a scalar head's output, or, for an
  embedding model given ``[a, b]`` pairs, the cosine similarity of the pair.
* ``logprobs``: for a causal LM, the log-probability of each of ``tokens[i]``
  following ``inputs[i]`` (or of each input token after the first when
  ``tokens`` is absent); token-id lists, or text when the model has a
  tokenizer (a trajectory's prompt and response).

Devices: ``cuda:i`` when CUDA is present, else N virtual devices on the CPU
(every one is ``torch.device("cpu")``, but replicas are kept per index, so
restore/evict/exclusivity behave as on a real node). ``torch`` is imported
lazily: importing this module is cheap and the core never needs it.
"""
from __future__ import annotations

import asyncio
import copy
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from tangram.core.grants import CacheDecision, parse_service
from tangram.executors.base import CANCELLED, FAILED, SUCCEEDED, TIMEOUT, ExecResult, wait_through_cancels
from tangram.executors.torch_models import (  # noqa: F401 - re-exported: the models this executor serves
    OPS,
    ActionCancelled,
    check_token_ids,
    ServedModel,
    _host_memory_bytes,
    _is_int_seq,
    _torch,
    device_facts,
    hf_factory,
    register_model,
    registered_models,
    resolve_model,
    unregister_model,
)

# --------------------------------------------------------------------------- #
# the executor


@dataclass(slots=True)
class _Master:
    served: ServedModel  # .module: the immutable CPU copy (pinned on CUDA)
    skeleton: Any  # the same module on the meta device: structure without storage
    state_bytes: int


class TorchGpuExecutor:
    """Restores, evicts and runs model services on a node's devices."""

    name = "torch"

    def __init__(self, devices: Sequence[Any] | None = None, *, num_virtual_devices: int = 8,
                 batch_size: int = 32, pin_memory: bool | None = None):
        torch = _torch()
        if devices is None:
            if torch.cuda.is_available():
                devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
            else:
                devices = ["cpu"] * num_virtual_devices
        self.devices = [torch.device(d) for d in devices]
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._masters: dict[str, _Master] = {}
        self._replicas: dict[tuple[str, int], list[Any]] = {}  # (service, chunk start) -> module per device
        self._lock = threading.RLock()
        self._busy: dict[int, str] = {}  # device index -> holder: exclusivity, asserted

    # -- masters ------------------------------------------------------------ #

    def load(self, model: str) -> ServedModel:
        """Build ``model``'s immutable CPU master copy once (the state every restore copies)."""
        with self._lock:
            m = self._masters.get(model)
            if m is not None:
                return m.served
        factory = resolve_model(model)
        torch = _torch()
        built = factory()
        served = built if isinstance(built, ServedModel) else ServedModel(built)
        module = served.module.to("cpu").eval()
        module.requires_grad_(False)
        if self.pin_memory:
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    t.data = t.data.pin_memory()
        skeleton = copy.deepcopy(module).to("meta")
        nbytes = sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
        with self._lock:
            self._masters.setdefault(model, _Master(served, skeleton, nbytes))
            return self._masters[model].served

    def state_mb(self, model: str) -> int:
        """Size of the model's state, for :class:`tangram.managers.service_cache.ModelSpec`."""
        self.load(model)
        return math.ceil(self._masters[model].state_bytes / 2**20)

    # -- residency ---------------------------------------------------------- #

    def resident(self) -> list[tuple[str, int]]:
        with self._lock:
            return sorted(self._replicas)

    def restore(self, service: str, devices: Sequence[int]) -> float:
        """Copy ``service``'s master state onto ``devices``; seconds taken (synchronised)."""
        torch = _torch()
        model, dop = parse_service(service)
        if dop != len(devices):
            raise ValueError(f"{service} runs on {dop} devices, got {list(devices)}")
        self.load(model)
        master = self._masters[model]
        t0 = time.perf_counter()
        replicas = []
        try:
            for d in devices:
                replicas.append(_materialize(master, self.devices[d]))
            for dev in {self.devices[d] for d in devices}:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
        except BaseException:
            del replicas  # half a restore is garbage
            raise
        with self._lock:
            self._replicas[(service, devices[0])] = replicas
        return time.perf_counter() - t0

    def evict(self, service: str, start: int) -> bool:
        """Drop the device copies of the instance at ``start``; idempotent. Nothing is written back."""
        with self._lock:
            return self._replicas.pop((service, start), None) is not None

    def prepare(self, decision: CacheDecision) -> float:
        """Carry out the cache's decision: evictions, then the restore on a miss. Seconds restoring."""
        for inst in decision.evict:
            self.evict(inst.service, inst.chunk.start)
        if decision.service is None:
            return 0.0
        key = (decision.service, decision.chunk.start)
        with self._lock:
            present = key in self._replicas
        if decision.hit and present:
            return 0.0
        # a miss, or a hit the books remember but this process lost (restarted): restore
        return self.restore(decision.service, list(decision.devices))

    # -- running ------------------------------------------------------------ #

    def run(self, decision: CacheDecision, payload: Mapping[str, Any], *,
            cancel: threading.Event | None = None) -> ExecResult:
        """Evict, restore, infer; blocking. ``cancel`` is polled between batches."""
        res = self._run(decision, payload, cancel)
        if res.status != SUCCEEDED and res.restored:
            # unconfirmed restores are forgotten by the books: forget the device copy too
            self.evict(decision.service, decision.chunk.start)
            res.restored = False
            res.details["dropped_restore"] = True
        return res

    def _run(self, decision: CacheDecision, payload: Mapping[str, Any],
             cancel: threading.Event | None) -> ExecResult:
        details: dict[str, Any] = {"executor": self.name, "service": decision.service, "hit": decision.hit,
                                   "devices": list(decision.devices), "evicted": [i.service for i in decision.evict]}
        try:
            _check_payload(payload, decision)
        except ValueError as e:
            return ExecResult(FAILED, error=str(e), details=details)
        self._acquire(decision)
        try:
            try:
                restore_s = self.prepare(decision)
            except Exception as e:
                self.evict(decision.service, decision.chunk.start)
                return ExecResult(FAILED, error=f"restore failed: {e!r}", details=details)
            moved = {"restored": not decision.hit or restore_s > 0, "restore_s": restore_s}
            t0 = time.perf_counter()
            try:
                output = self.infer(decision, payload, cancel=cancel)
            except ActionCancelled:
                return ExecResult(CANCELLED, error="cancelled between batches", exec_s=time.perf_counter() - t0,
                                  details=details, **moved)
            except Exception as e:
                return ExecResult(FAILED, error=f"{type(e).__name__}: {e}", exec_s=time.perf_counter() - t0,
                                  details=details, **moved)
            return ExecResult(SUCCEEDED, output=output, exec_s=time.perf_counter() - t0, details=details, **moved)
        finally:
            self._release(decision)

    async def execute(self, decision: CacheDecision, payload: Mapping[str, Any], *,
                      timeout_s: float | None = None) -> ExecResult:
        """:meth:`run` in a worker thread. On timeout or cancel the worker is stopped at the next
        batch boundary and awaited before returning, so the devices are free when this returns;
        a restore this run made is dropped unless it succeeded (the books forget it too)."""
        cancel = threading.Event()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, lambda: self.run(decision, payload, cancel=cancel))
        try:
            res = await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError:
            cancel.set()
            # the worker holds the devices until it returns (a next action there failed 'one action per GPU')
            cancelled = await wait_through_cancels(fut)
            res = fut.result()  # run() already dropped an unconfirmable restore
            if cancelled:
                self._drop_unconfirmed(decision, res)
                raise asyncio.CancelledError from None
            if res.status == CANCELLED:
                res.status, res.error = TIMEOUT, f"timed out after {timeout_s}s"
            return res
        except asyncio.CancelledError:
            cancel.set()
            await wait_through_cancels(fut)
            res = None if fut.cancelled() or fut.exception() is not None else fut.result()
            self._drop_unconfirmed(decision, res)
            raise
        return res

    def _drop_unconfirmed(self, decision: CacheDecision, res: ExecResult | None) -> None:
        if res is not None and res.restored and decision.service is not None:
            self.evict(decision.service, decision.chunk.start)  # no result, no confirmation

    def infer(self, decision: CacheDecision, payload: Mapping[str, Any], *,
              cancel: threading.Event | None = None) -> list:
        torch = _torch()
        _check_payload(payload, decision)
        model = payload["model"]
        served = self.load(model)
        with self._lock:
            replicas = self._replicas.get((decision.service, decision.chunk.start))
        if replicas is None:
            raise RuntimeError(f"{decision.service} is not resident on {decision.chunk}")
        op = payload["op"]
        inputs = list(payload["inputs"])
        tokens = payload.get("tokens")
        bs = int(payload.get("batch_size") or self.batch_size)
        n = len(inputs)
        shard = math.ceil(n / len(replicas)) if n else 0
        shards = [(k, replicas[k], list(range(k * shard, min(n, (k + 1) * shard)))) for k in range(len(replicas))]
        shards = [s for s in shards if s[2]]

        def work(k: int, module, idx: list[int]) -> list:
            device = self.devices[decision.chunk.start + k]
            out = []
            with torch.inference_mode():
                for b in range(0, len(idx), bs):
                    if cancel is not None and cancel.is_set():
                        raise ActionCancelled()
                    part = idx[b: b + bs]
                    out.extend(self._op(served, module, device, op, [inputs[i] for i in part],
                                        None if tokens is None else [tokens[i] for i in part]))
            return out

        distinct = {self.devices[decision.chunk.start + k] for k, _, _ in shards}
        if len(distinct) > 1:  # real devices: overlap the replicas' kernels
            with ThreadPoolExecutor(max_workers=len(shards)) as pool:
                parts = list(pool.map(lambda s: work(*s), shards))
        else:
            parts = [work(*s) for s in shards]
        return [x for p in parts for x in p]

    def _op(self, served: ServedModel, module, device, op: str, inputs: list, tokens: list | None) -> list:
        # before the device sees them: token-id inputs, and either side of a pair to compare
        check_token_ids(module, [y for x in inputs for y in ((x,) if _is_int_seq(x) else x if isinstance(
            x, (list, tuple)) and len(x) == 2 else ()) if _is_int_seq(y)])
        if op == "embed":
            return served.embed(module, _to(served.make_batch(inputs), device)).float().cpu().tolist()
        if op == "score":
            if inputs and all(isinstance(x, (list, tuple)) and len(x) == 2 and not _is_int_seq(x) for x in inputs):
                left = served.embed(module, _to(served.make_batch([x[0] for x in inputs]), device))
                right = served.embed(module, _to(served.make_batch([x[1] for x in inputs]), device))
                torch = _torch()
                return torch.nn.functional.cosine_similarity(left.float(), right.float(), dim=-1).cpu().tolist()
            return served.score(module, _to(served.make_batch(inputs), device)).float().cpu().tolist()
        # logprobs
        if served.tokenizer is not None:  # text: prompt (input) and continuation (tokens) as token ids
            inputs = [_token_ids(served.tokenizer, x) for x in inputs]
            if tokens is not None:
                tokens = [_token_ids(served.tokenizer, t, special=False) for t in tokens]
        seqs, starts = [], []
        for i, x in enumerate(inputs):
            if not _is_int_seq(x):
                raise ValueError("logprobs: inputs must be token-id lists")
            cont = list(tokens[i]) if tokens is not None else []
            if tokens is not None and not _is_int_seq(cont):
                raise ValueError("logprobs: tokens must be token-id lists")
            if tokens is not None and not x:
                raise ValueError("logprobs: each input needs at least one token before its continuation")
            seqs.append(list(x) + cont)
            starts.append(len(x) if tokens is not None else 1)
        check_token_ids(module, seqs)
        batch = _to(served.make_batch(seqs), device)
        out = served.logprobs(module, batch, starts, [len(s) for s in seqs])
        return [t.float().cpu().tolist() for t in out]

    # -- exclusivity -------------------------------------------------------- #

    def _acquire(self, decision: CacheDecision) -> None:
        with self._lock:
            clash = {d: self._busy[d] for d in decision.devices if d in self._busy}
            if clash:  # an invariant: a real exception, not an assert that `python -O` drops
                raise AssertionError(f"one action per GPU: {decision.holder} on {decision.chunk} clashes with {clash}")
            if decision.chunk.end > len(self.devices):
                raise AssertionError(f"{decision.chunk} past {len(self.devices)} devices")
            for d in decision.devices:
                self._busy[d] = decision.holder

    def _release(self, decision: CacheDecision) -> None:
        with self._lock:
            for d in decision.devices:
                if self._busy.get(d) == decision.holder:
                    del self._busy[d]

    def close(self) -> None:
        """Drop every device copy (masters stay: they are the cache's backing store)."""
        with self._lock:
            self._replicas.clear()
        torch = _torch()
        if any(d.type == "cuda" for d in self.devices):
            torch.cuda.empty_cache()


def _materialize(master: _Master, device) -> Any:
    """A fresh replica on ``device``: the meta skeleton given storage, then the master's tensors copied in."""
    torch = _torch()
    replica = copy.deepcopy(master.skeleton).to_empty(device=device)
    src = master.served.module
    # to_empty gives each name its own storage: tie again what the master ties (an LM head
    # sharing the embedding), else the tied copy keeps uninitialised memory
    first_name: dict[int, str] = {}
    for name, p in src.named_parameters(remove_duplicate=False):
        first = first_name.setdefault(id(p), name)
        if first != name:
            owner, _, attr = name.rpartition(".")
            setattr(replica.get_submodule(owner), attr, replica.get_parameter(first))
    non_blocking = device.type == "cuda"
    with torch.no_grad():
        for (name, dst), (sname, s) in zip(replica.named_parameters(), src.named_parameters()):
            if name != sname:
                raise AssertionError(f"replica and master differ: {name!r} against {sname!r}")
            dst.copy_(s, non_blocking=non_blocking)
        # buffers too (not state_dict: non-persistent buffers such as position ids must come along)
        for (name, dst), (sname, s) in zip(replica.named_buffers(), src.named_buffers()):
            if name != sname:
                raise AssertionError(f"replica and master differ: {name!r} against {sname!r}")
            dst.copy_(s, non_blocking=non_blocking)
    return replica.eval()


def _token_ids(tokenizer, x: Any, *, special: bool = True) -> Any:
    """Text as the tokenizer's ids (its special tokens only at the start of a prompt); ids pass through."""
    if isinstance(x, str):
        return list(tokenizer(x, add_special_tokens=special)["input_ids"])
    return x


def _to(batch: Mapping[str, Any], device) -> dict:
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


def _check_payload(payload: Mapping[str, Any], decision: CacheDecision) -> None:
    op = payload.get("op")
    if op not in OPS:
        raise ValueError(f"payload.op: one of {OPS}, got {op!r}")
    if decision.service is None:
        raise ValueError("a model action needs a service (the action's `service` names the model)")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("payload.model: a registered model name is required")
    if decision.model is not None and decision.model != model:
        raise ValueError(f"payload.model {model!r} is not the service {decision.service!r} this chunk runs")
    inputs = payload.get("inputs")
    if not isinstance(inputs, (list, tuple)):
        raise ValueError("payload.inputs: a list is required")
    tokens = payload.get("tokens")
    if tokens is not None and (not isinstance(tokens, (list, tuple)) or len(tokens) != len(inputs)):
        raise ValueError("payload.tokens: one token list per input")
