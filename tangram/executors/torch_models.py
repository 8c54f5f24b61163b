"""The models a GPU executor serves: the registry of factories, :class:`ServedModel`, and device facts.

A model is registered by name with a factory returning an ``nn.Module`` or a
:class:`ServedModel` (which says how to score, take log-probs or embed);
:func:`hf_factory` builds one from a Hugging Face directory, offline.
``torch`` and ``transformers`` are imported lazily.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, Mapping, Sequence

OPS = ("score", "logprobs", "embed")

_REGISTRY: dict[str, Callable[[], Any]] = {}
_REGISTRY_LOCK = threading.Lock()


def _torch():
    import torch  # lazy: only executors touch torch

    return torch


def register_model(name: str, factory: Callable[[], Any]) -> None:
    """Make ``name`` buildable: ``factory()`` returns an ``nn.Module`` or a :class:`ServedModel`."""
    if not name or "@" in name:
        raise ValueError(f"name: a non-empty model name without '@', got {name!r}")
    if not callable(factory):
        raise TypeError("factory: must be callable")
    with _REGISTRY_LOCK:
        _REGISTRY[name] = factory


def unregister_model(name: str) -> None:
    with _REGISTRY_LOCK:
        _REGISTRY.pop(name, None)


def registered_models() -> list[str]:
    with _REGISTRY_LOCK:
        return sorted(_REGISTRY)


def resolve_model(name: str) -> Callable[[], Any]:
    """The factory of a registered model (KeyError naming :func:`register_model` otherwise)."""
    with _REGISTRY_LOCK:
        factory = _REGISTRY.get(name)
    if factory is None:
        raise KeyError(f"model {name!r} is not registered (register_model)")
    return factory


class ActionCancelled(Exception):
    """Raised inside the worker between batches when the action was cancelled or timed out."""


# --------------------------------------------------------------------------- #
# a model and how to feed it


class ServedModel:
    """A module plus the glue from payload inputs to tensors and back.

    ``tokenizer`` (a Hugging Face tokenizer) turns text inputs into a batch;
    without one, inputs are numbers: lists of ints are token ids (right-padded
    with 0, with an attention mask), anything else a float tensor. ``pooling``
    applies to 3-D outputs in ``embed``; ``normalize`` L2-normalises embeddings.
    """

    def __init__(self, module, *, tokenizer=None, normalize: bool = False, max_length: int = 512,
                 pooling: str = "mean"):
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling: 'mean' or 'cls', got {pooling!r}")
        self.module = module
        self.tokenizer = tokenizer
        self.normalize = normalize
        self.max_length = max_length
        self.pooling = pooling

    # -- batches (CPU tensors; moved to the replica's device by the caller) -- #

    def make_batch(self, inputs: Sequence[Any]) -> dict:
        torch = _torch()
        if self.tokenizer is not None and inputs and isinstance(inputs[0], str):
            enc = self.tokenizer(list(inputs), padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt")
            return dict(enc)
        if inputs and all(_is_int_seq(x) for x in inputs):
            width = max(len(x) for x in inputs)
            ids = torch.zeros((len(inputs), width), dtype=torch.long)
            mask = torch.zeros((len(inputs), width), dtype=torch.long)
            for i, x in enumerate(inputs):
                ids[i, : len(x)] = torch.as_tensor(list(x), dtype=torch.long)
                mask[i, : len(x)] = 1
            return {"input_ids": ids, "attention_mask": mask}
        return {"x": torch.as_tensor(inputs, dtype=torch.float32)}

    def forward(self, module, batch: Mapping[str, Any]):
        if "x" in batch:
            return module(batch["x"])
        if hasattr(module, "config"):  # a transformers model takes keyword tensors
            return module(**batch)
        return module(batch["input_ids"])

    # -- ops ----------------------------------------------------------------- #

    def embed(self, module, batch) -> Any:
        torch = _torch()
        out = _main_tensor(self.forward(module, batch), prefer="last_hidden_state")
        if out.dim() == 3:
            if self.pooling == "cls":
                out = out[:, 0]
            else:
                mask = batch.get("attention_mask")
                if mask is None:
                    out = out.mean(dim=1)
                else:
                    m = mask.unsqueeze(-1).to(out.dtype)
                    out = (out * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
        if self.normalize:
            out = torch.nn.functional.normalize(out, p=2, dim=-1)
        return out

    def score(self, module, batch) -> Any:
        out = _main_tensor(self.forward(module, batch), prefer="logits")
        if out.dim() == 2 and out.shape[1] == 1:
            out = out[:, 0]
        if out.dim() != 1:
            raise ValueError(f"score needs a scalar head (got output shape {tuple(out.shape)}); "
                             "for an embedding model pass [a, b] pairs")
        return out

    def logprobs(self, module, batch, starts: Sequence[int], lengths: Sequence[int]) -> list:
        """Log-probs of positions ``starts[i] .. lengths[i]-1`` of each sequence, each given what precedes it."""
        torch = _torch()
        logits = _main_tensor(self.forward(module, batch), prefer="logits")
        if logits.dim() != 3:
            raise ValueError(f"logprobs needs [batch, seq, vocab] logits, got {tuple(logits.shape)}")
        logp = torch.log_softmax(logits.float(), dim=-1)
        ids = batch["input_ids"]
        out = []
        for i, (s, n) in enumerate(zip(starts, lengths)):
            pos = torch.arange(s, n, device=ids.device)
            out.append(logp[i, pos - 1, ids[i, pos]])  # logits at t-1 predict token t
        return out


_POSITION_TABLES = ("position_embeddings", "wpe", "embed_positions")  # BERT/RoBERTa, GPT-2, OPT/BART
_BOUNDS: "weakref.WeakKeyDictionary[Any, tuple[int | None, int | None]]" = weakref.WeakKeyDictionary()


def _id_bounds(module: Any) -> tuple[int | None, int | None]:
    """(vocabulary size, longest sequence) where the model states them: its input embeddings, and its
    table of learned positions found among its submodules (a head's model keeps it one level down),
    less RoBERTa's offset of ``padding_idx + 1`` or OPT's and BART's ``offset``; rotary positions have
    no table and no bound here."""
    try:
        return _BOUNDS[module]
    except (KeyError, TypeError):
        pass
    get = getattr(module, "get_input_embeddings", None)
    vocab = getattr(get() if callable(get) else None, "num_embeddings", None)
    longest = None
    for name, sub in (module.named_modules() if hasattr(module, "named_modules") else ()):
        n = getattr(sub, "num_embeddings", None)
        if name.rsplit(".", 1)[-1] in _POSITION_TABLES and isinstance(n, int):
            pad = getattr(sub, "padding_idx", None)
            longest = n - (pad + 1 if pad is not None else 0) - int(getattr(sub, "offset", 0) or 0)
            break
    bounds = (vocab if isinstance(vocab, int) else None, longest)
    try:
        _BOUNDS[module] = bounds
    except TypeError:
        pass
    return bounds


def check_token_ids(module: Any, seqs: Sequence[Sequence[int]]) -> None:
    """Raise ValueError for a token id outside the model's vocabulary or a sequence longer than its
    table of learned positions (:func:`_id_bounds`). On a GPU an out-of-range index is a device-side
    assert that spoils every later call on the device."""
    vocab, longest = _id_bounds(module)
    for s in seqs:
        if vocab is not None and (bad := next((t for t in s if not 0 <= t < vocab), None)) is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
        if longest is not None and len(s) > longest:
            raise ValueError(f"a sequence of {len(s)} tokens is longer than the model's {longest} positions")


def _is_int_seq(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


def _main_tensor(out, *, prefer: str):
    torch = _torch()
    if isinstance(out, torch.Tensor):
        return out
    for name in (prefer, "logits", "last_hidden_state"):
        v = getattr(out, name, None)
        if v is None and isinstance(out, Mapping):
            v = out.get(name)
        if isinstance(v, torch.Tensor):
            return v
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot find the output tensor in {type(out).__name__}")


def hf_factory(path: str, *, normalize: bool = True, pooling: str = "mean", max_length: int = 256,
               causal_lm: bool = False) -> Callable[[], ServedModel]:
    """A factory loading a Hugging Face model directory offline (e.g. a model shipped in a package)."""

    def build() -> ServedModel:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub at run time
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import transformers

        cls = transformers.AutoModelForCausalLM if causal_lm else transformers.AutoModel
        module = cls.from_pretrained(str(path), local_files_only=True)
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return ServedModel(module, tokenizer=tok, normalize=normalize, pooling=pooling, max_length=max_length)

    return build


# --------------------------------------------------------------------------- #
# device facts


def device_facts(devices: Sequence[Any] | None = None) -> list[dict]:
    """Name and memory of each device: ``pynvml`` if installed, else ``torch.cuda``; CPU: a share of RAM."""
    torch = _torch()
    if devices is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [f"cuda:{i}" for i in range(n)]
    devs = [torch.device(d) for d in devices]
    facts = []
    nvml = _nvml()
    cpu_count = sum(1 for d in devs if d.type == "cpu")
    for i, d in enumerate(devs):
        if d.type == "cuda":
            idx = d.index if d.index is not None else torch.cuda.current_device()
            fact = {"index": i, "device": str(d), "kind": "cuda"}
            if nvml is not None:
                h = nvml.nvmlDeviceGetHandleByIndex(idx)
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                name = nvml.nvmlDeviceGetName(h)
                fact.update(name=name.decode() if isinstance(name, bytes) else name, total_mb=mem.total // 2**20,
                            memory_mb=mem.total // 2**20,
                            free_mb=mem.free // 2**20, source="pynvml")
            else:
                free, total = torch.cuda.mem_get_info(idx)
                fact.update(name=torch.cuda.get_device_name(idx), total_mb=total // 2**20, memory_mb=total // 2**20,
                            free_mb=free // 2**20,
                            source="torch.cuda")
        else:
            total = _host_memory_bytes()
            share = total // max(cpu_count, 1) // 2**20 if total else None
            fact = {"index": i, "device": str(d), "kind": d.type, "name": f"virtual {d.type} device {i}",
                    "total_mb": share, "memory_mb": share, "free_mb": share, "source": "host memory share"}
        facts.append(fact)
    return facts


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    return pynvml


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
