#!/usr/bin/env bash
# The tests of the core under another Python than the default one, and the same decisions there.
#
#     bash scripts/check_python.sh VERSION      e.g. 3.10 (the oldest pyproject.toml promises), 3.12
#
#   1. a venv of its own (.venv-pyXY/, git-ignored) with the dependencies pyproject.toml lists
#      (core + the dev extra); the optional ones (torch, docker, ...) are deliberately not there:
#      the full suite covers them, and here a test that needs one skips even under CI=true;
#   2. the model, engine, policy, managers, runtime, service, client and simulator tests;
#   3. scripts/decision_digest.py under that Python and under python3: every scheduling decision
#      of a few seeded simulations must be the same, bit for bit (arithmetic that differs between
#      versions, such as sum(), which compensates rounding from 3.12 on, would change a plan).
#
# The interpreter: $TANGRAM_PYXY, else pythonX.Y on PATH, else pyenv's X.Y.*.
# Without one the check fails under CI=true and is skipped (saying so) elsewhere.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1

version="${1:?usage: check_python.sh VERSION (e.g. 3.10)}"
[[ "$version" =~ ^3\.[0-9]+$ ]] || { echo "check_python.sh: VERSION must look like 3.10, got $version" >&2; exit 2; }
tag="py${version/./}"
override="TANGRAM_${tag^^}"
me="check_python.sh $version"

py=""
for cand in "${!override:-}" "python$version" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python3; do
    # a pyenv shim answers to the name without being that version: ask each candidate
    if [ -n "$cand" ] && "$cand" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$version'" 2>/dev/null; then
        py="$cand"
        break
    fi
done
if [ -z "$py" ]; then
    if [ "${CI:-}" = "true" ]; then
        echo "$me: FAILED: no Python $version interpreter (set $override)" >&2
        exit 1
    fi
    echo "$me: skipped: no Python $version interpreter (set $override)" >&2
    exit 0
fi

venv=".venv-$tag"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
mapfile -t deps < <(python3 - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["dev"]))
PY
)
"$venv/bin/python" -m pip install -q "${deps[@]}"
# from the source tree: the compiled policy of the default Python (the estimate's walk, the modules of
# a round) is not this one's, so the plain sources run here (the compiled modules' own tests, which
# need the build, are in the full suite); the decisions below are compared with the compiled ones
PYTHONPATH="$PWD" env -u CI "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_layers.py tests/test_model.py tests/test_engine.py tests/test_engine_queue.py \
    tests/test_policy_arrange.py tests/test_policy_greedy.py tests/test_policy_schedule.py \
    tests/test_policy_fastpaths.py tests/test_buddy.py tests/test_cpu_manager.py tests/test_gpu_manager.py \
    tests/test_basic_manager.py tests/test_service_cache.py tests/test_runtime.py tests/test_service_api.py \
    tests/test_gpu_host_stopping.py \
    tests/test_service_kinds.py tests/test_service_edge.py tests/test_client.py tests/test_simulator.py

here="$(PYTHONPATH="$PWD" "$venv/bin/python" scripts/decision_digest.py --json)"
default="$(python3 scripts/decision_digest.py --json)"
if [ "$here" != "$default" ]; then
    echo "$me: FAILED: the decisions differ from python3's ($(python3 -V)):" >&2
    diff <(echo "$default") <(echo "$here") >&2 || true
    exit 1
fi
echo "$me: the same decisions as python3 ($(python3 -V)) in $(echo "$here" | grep -c '/') seeded simulations" >&2
