#!/usr/bin/env bash
# Offline calibration on real test suites (issue 7):
#
#     bash scripts/calibrate_real_suites.sh [OUT_DIR]          (default: calibration/)
#
# Downloads the source distributions of well-known pure-Python packages
# (`pip download --no-binary :all: --no-deps`), and sweeps their own test
# suites with `tangram profile` (pytest-xdist, `-n ${parallel_num}`, cores
# pinned by the local executor's cgroups) at DoP 1 and 2 (override: DOPS=1,2,4),
# REPEATS (default 5) measured runs per DoP after one warm-up. Writes
#   OUT_DIR/profiles.json               the profile store (t1_s, efficiency, samples, model, ...)
#   OUT_DIR/profiles.json.samples.jsonl every measured sample (rerun to resume)
#   OUT_DIR/plots/*.png                 measured points + fitted curve per class
# Needs: pip install -e '.[dev,profiling]' (pytest-xdist, hypothesis for attrs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OUT_DIR=${1:-calibration}
SUITES=${TANGRAM_SUITES_DIR:-${HOME}/.cache/tangram/suites}
DOPS=${DOPS:-1,2}
REPEATS=${REPEATS:-5}
mkdir -p "$OUT_DIR" "$SUITES"

# package==version  test-directory  extra pytest args
fetch() {
    local spec=$1 dir=$2
    if [ ! -d "$SUITES/$dir" ]; then
        python3 -m pip download -q --no-binary :all: --no-deps -d "$SUITES" "$spec"
        tar -xzf "$SUITES/$dir.tar.gz" -C "$SUITES"
    fi
}
fetch networkx==3.4.2 networkx-3.4.2
fetch attrs==24.2.0 attrs-24.2.0
fetch toolz==1.0.0 toolz-1.0.0
# Not used: more-itertools 10.5.0 (its unittest subTest()s break pytest 9 + xdist 3.8:
# "can't serialize <class 'range'>" / SubtestReport), boltons 24.1.0 (conftest uses
# the py.path hook argument removed in pytest 9), python-dateutil 2.9.0 (collection errors).
python3 -m pip install -q hypothesis 2>/dev/null || true   # attrs' suite uses it

PYTEST='python3 -m pytest -q -p no:cacheprovider -p no:randomly -n ${parallel_num}'
cat > "$OUT_DIR/sweep.yaml" <<YAML
executor: local
defaults: {repeats: $REPEATS, warmups: 1, dops: [$DOPS], timeout_s: 900}
classes:
  networkx-flow:    # networkx 3.4.2, networkx/algorithms/flow: 81 max-flow/min-cut tests, ~8 s serial
    command: $PYTEST networkx/algorithms/flow
    workdir: $SUITES/networkx-3.4.2
  attrs:            # 1329 tests (hypothesis), ~11 s serial; one test fails with newer Python/typing: deselected
    command: $PYTEST tests --deselect tests/test_converters.py::TestPipe::test_wrapped_annotation
    workdir: $SUITES/attrs-24.2.0
    env: {PYTHONPATH: src}
  toolz:            # 180 tests, ~1 s serial: xdist start-up dominates
    command: $PYTEST toolz/tests
    workdir: $SUITES/toolz-1.0.0
  algo-suite:       # the small real suite shipped for the tests (profiling/fixtures/algo_suite)
    command: $PYTEST
    workdir: $PWD/profiling/fixtures/algo_suite
YAML

rc=0
python3 -m tangram.cli profile --config "$OUT_DIR/sweep.yaml" --out "$OUT_DIR/profiles.json" || rc=$?
python3 -m tangram.cli profile report --store "$OUT_DIR/profiles.json" --out "$OUT_DIR/plots"
exit $rc
