#!/usr/bin/env bash
# Python 3.10 is the oldest version pyproject.toml promises (requires-python >= 3.10).
#
#   1. vermin: the product's code (tangram, integrations, profiling, datasets_patch)
#      uses nothing newer than 3.10;
#   2. scripts/check_python.sh 3.10: the core's tests under a 3.10 interpreter, and the same
#      scheduling decisions as the default python3 (the interpreter: $TANGRAM_PY310, else
#      python3.10 on PATH, else pyenv's 3.10.x; without one the check fails under CI=true).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1

command -v vermin >/dev/null || python3 -m pip install -q vermin  # also in the dev extra
vermin -q --no-tips --violations --eval-annotations -t=3.10- tangram integrations profiling datasets_patch
echo "check_py310.sh: vermin: the product's code runs on Python 3.10" >&2

exec bash scripts/check_python.sh 3.10
