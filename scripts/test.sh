#!/usr/bin/env bash
# The project's single test command (README, .ci/run):
#
#     bash scripts/test.sh [pytest args...]      e.g.  bash scripts/test.sh -k docker
#
# Works on a fresh machine as root from the repo root.  It creates no venv: it
# uses `python3 -m pip` / `python3 -m pytest` of whatever python3 is first on
# PATH (run it inside your venv if you want one).
#   1. torch hook: scripts/test-requirements-torch.txt, if it exists, is
#      installed FIRST (see below)
#   2. pip install -e '.[dev,docker,datasets,profiling]' (+ -r scripts/test-requirements.txt)
#   3. bash scripts/docker_engine.sh: start a Docker Engine + build the sandbox
#      image; if that fails the docker tests skip (with the reason)
#   4. python3 -m pytest -q -p no:cacheprovider "$@"
# Exits with pytest's exit code; 5 (no tests collected) is a failure too.
# No pytest-xdist (-n): the timing and cgroup tests interfere when run in parallel.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
export DEBIAN_FRONTEND=noninteractive

# A Debian/Ubuntu system python3 refuses pip installs outside a venv (PEP 668).
# On CI (throwaway machine, no venv by design) allow it; elsewhere use a venv.
if [ "${CI:-}" = "true" ] && python3 - <<'EOF'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if (not in_venv and os.path.exists(marker)) else 1)
EOF
then
    export PIP_BREAK_SYSTEM_PACKAGES=1
fi

pip_install() { python3 -m pip install -q "$@"; }

# Optional: python3 -m pip install -q --upgrade pip

# --- torch hook --------------------------------------------------------------
# torch must be installed BEFORE anything that depends on it (the gpu extra,
# verl, ...): a plain `pip install torch` from PyPI pulls the multi-GB CUDA
# build plus nvidia-* wheels.  To use torch in the tests, create
# scripts/test-requirements-torch.txt pinning the CPU build, e.g.
#     torch==2.13.0
# (with an `--index-url` line for a CPU wheel index if one is reachable), and
# keep torch out of scripts/test-requirements.txt.
if [ -f scripts/test-requirements-torch.txt ]; then
    echo "test.sh: installing torch first (scripts/test-requirements-torch.txt)" >&2
    pip_install -r scripts/test-requirements-torch.txt
fi

# --- the project and its test extras ------------------------------------------
reqs=()
if [ -f scripts/test-requirements.txt ]; then
    reqs=(-r scripts/test-requirements.txt)
fi
echo "test.sh: pip install -e '.[dev,docker,datasets,profiling]' ${reqs[*]:-}" >&2
pip_install -e '.[dev,docker,datasets,profiling]' "${reqs[@]}"
# test-only extras that need --no-deps (the SWE-bench evaluation specs)
bash scripts/install_test_extras.sh

# --- Docker Engine (docker tests skip, with the reason, if none can start) ----
bash scripts/docker_engine.sh || echo "docker engine unavailable; docker tests will skip" >&2

# --- tests ---------------------------------------------------------------------
set +e
# a crash in native code (also at interpreter exit, after pytest's own handler is gone) prints
# every thread's Python stack instead of a bare "Segmentation fault"
PYTHONFAULTHANDLER=1 python3 -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "test.sh: FAILED: pytest collected no tests (exit 5)" >&2
fi
exit "$rc"
