"""datasets_patch: shell rewrite table, record handling, file formats, CLI, actions."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from datasets_patch.actions import reward_action_spec
from datasets_patch.records import INSTALL_FIELD, INSTALL_VALUE, patch_record
from datasets_patch.rewrite import INSTALL_LINE, patch_script
from tangram.cli import main as tangram_main

P = "${parallel_num}"

# (intent, input, expected output, outcome)
CASES = [
    # plain pytest: the option goes right after the program word
    ("plain", "pytest -rA tests/", f"pytest -n {P} -rA tests/", "patched"),
    # python -m pytest: after the module name
    ("module", "python -m pytest -rA tests/a.py::test_x",
     f"python -m pytest -n {P} -rA tests/a.py::test_x", "patched"),
    # interpreter options before -m are skipped
    ("python opts", "python3 -W ignore::DeprecationWarning -m pytest -x",
     f"python3 -W ignore::DeprecationWarning -m pytest -n {P} -x", "patched"),
    # -n0 (xdist installed, disabled) is replaced
    ("-n0", "pytest -n0 -rA", f"pytest -n {P} -rA", "patched"),
    # -n 4 is replaced in place
    ("-n 4", "pytest -rA -n 4 tests", f"pytest -rA -n {P} tests", "patched"),
    # -n auto is replaced
    ("-n auto", "pytest -n auto", f"pytest -n {P}", "patched"),
    # --numprocesses=N is replaced by the canonical form
    ("--numprocesses=", "pytest --numprocesses=3 -x", f"pytest -n {P} -x", "patched"),
    # --numprocesses N too
    ("--numprocesses N", "pytest --numprocesses 3 -x", f"pytest -n {P} -x", "patched"),
    # several counts: one is left, since argparse lets the last one win
    ("duplicates", "pytest -n 2 -x -n 3", f"pytest -n {P} -x", "patched"),
    # ours plus an explicit one: the explicit one goes
    ("ours+explicit", f"pytest -n {P} -x --numprocesses=4", f"pytest -n {P} -x", "patched"),
    # -p no:xdist is an explicit opt-out: untouched
    ("opt-out", "pytest -p no:xdist -rA", "pytest -p no:xdist -rA", "no_xdist_optout"),
    # the one-word spelling of the opt-out
    ("opt-out joined", "pytest -pno:xdist", "pytest -pno:xdist", "no_xdist_optout"),
    # quoting, -k/-m expressions and test ids survive byte for byte
    ("quoting", """pytest -k "not slow and -n" -m 'a or b' "tests/x.py::test[a b]" t.py::T::t[1-2]""",
     f"""pytest -n {P} -k "not slow and -n" -m 'a or b' "tests/x.py::test[a b]" t.py::T::t[1-2]""",
     "patched"),
    # a -k value that looks like -n is a value, not a worker count
    ("-k value", "pytest -k -n4 x", f"pytest -n {P} -k -n4 x", "patched"),
    # environment prefixes stay in front
    ("env prefix", "FOO=1 BAR='x y' pytest -rA", f"FOO=1 BAR='x y' pytest -n {P} -rA", "patched"),
    # plugin autoload off: xdist has to be named, or -n is an unknown option
    ("autoload off", "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 pytest -rA",
     f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 pytest -p xdist.plugin -n {P} -rA", "patched"),
    # timeout wrapper with its duration
    ("timeout", "timeout 300 pytest -rA", f"timeout 300 pytest -n {P} -rA", "patched"),
    # timeout with options, python -m pytest
    ("timeout opts", "timeout -s KILL 1800 python -m pytest tests",
     f"timeout -s KILL 1800 python -m pytest -n {P} tests", "patched"),
    # env wrapper
    ("env", "env PYTHONPATH=. pytest", f"env PYTHONPATH=. pytest -n {P}", "patched"),
    # && || ; lists: only the pytest command changes
    ("lists", "cd /testbed && pytest -rA || true; echo done",
     f"cd /testbed && pytest -n {P} -rA || true; echo done", "patched"),
    # pipelines
    ("pipe", "pytest -rA | tee out.log", f"pytest -n {P} -rA | tee out.log", "patched"),
    # redirections stay where they are
    ("redirect", "pytest -rA >log.txt 2>&1", f"pytest -n {P} -rA >log.txt 2>&1", "patched"),
    # a redirection between options is not swallowed when an option is removed
    ("redirect mid", "pytest -rA >log -n 4 x", f"pytest -rA >log -n {P} x", "patched"),
    # two pytest runs: both get it
    ("two runs", "pytest a.py; python -m pytest b.py",
     f"pytest -n {P} a.py; python -m pytest -n {P} b.py", "patched"),
    # coverage run -m pytest
    ("coverage", "coverage run -m pytest tests", f"coverage run -m pytest -n {P} tests", "patched"),
    # py.test spelling, path to the executable
    ("py.test", "/opt/venv/bin/py.test -x", f"/opt/venv/bin/py.test -n {P} -x", "patched"),
    # poetry run
    ("poetry", "poetry run pytest", f"poetry run pytest -n {P}", "patched"),
    # line continuation
    ("continuation", "pytest -rA \\\n  tests/a.py", f"pytest -n {P} -rA \\\n  tests/a.py", "patched"),
    # compound statements
    ("if", "if [ -d tests ]; then pytest -q; fi", f"if [ -d tests ]; then pytest -n {P} -q; fi", "patched"),
    # [[ ]] is beyond bashlex: the shlex fallback handles the line
    ("[[ fallback", "[[ -f setup.py ]] && pytest -x", f"[[ -f setup.py ]] && pytest -n {P} -x", "patched"),
    # a pytest mentioned in a string is not a command
    ("echo", 'echo "pytest -rA"', 'echo "pytest -rA"', "no_test_command"),
    # patching twice changes nothing
    ("already", f"pytest -n {P} -rA", f"pytest -n {P} -rA", "already_patched"),
    # Django: an explicit --parallel 1 is replaced
    ("django", "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 model_fields",
     f"./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel {P} model_fields", "patched"),
    # Django without --parallel: added after the script
    ("django add", "./tests/runtests.py --verbosity 2 admin_views",
     f"./tests/runtests.py --parallel {P} --verbosity 2 admin_views", "patched"),
    # Django --parallel=N via python
    ("django =", "python tests/runtests.py --parallel=4 x", f"python tests/runtests.py --parallel {P} x",
     "patched"),
    # Django bare --parallel (all cores) before a label
    ("django bare", "./tests/runtests.py --parallel basic", f"./tests/runtests.py --parallel {P} basic",
     "patched"),
    # Django already patched
    ("django again", f"./tests/runtests.py --parallel {P} x", f"./tests/runtests.py --parallel {P} x",
     "already_patched"),
    # tox: untouched, reported
    ("tox", "tox --current-env -epy39 -v --", "tox --current-env -epy39 -v --", "unsupported_runner"),
    # sympy's bin/test: untouched, reported
    ("bin/test", "PYTHONWARNINGS='ignore::UserWarning' bin/test -C --verbose",
     "PYTHONWARNINGS='ignore::UserWarning' bin/test -C --verbose", "unsupported_runner"),
    # go test: untouched, reported
    ("go", 'go test -v ./... -run "^TestX"', 'go test -v ./... -run "^TestX"', "unsupported_runner"),
    # python -m unittest: untouched, reported
    ("unittest", "python -m unittest discover", "python -m unittest discover", "unsupported_runner"),
    # bash -c '...': the nested script is patched inside its quotes
    ("bash -c", "bash -c 'cd /testbed && pytest -rA'", f"bash -c 'cd /testbed && pytest -n {P} -rA'",
     "patched"),
    # sudo -u user bash -lc "...": wrappers, then the nested script
    ("sudo bash -lc", 'sudo -u bob bash -lc "pytest -x"', f'sudo -u bob bash -lc "pytest -n {P} -x"',
     "patched"),
    # escaped quotes in a nested script: offsets do not map, so it is only reported
    ("nested escaped", 'bash -c "pytest -k \\"a b\\""', 'bash -c "pytest -k \\"a b\\""',
     "unsupported_runner"),
    # su user -c "karma ...": a runner inside a nested script, reported
    ("su -c karma", 'su chromeuser -c "./node_modules/.bin/karma start k.js"',
     'su chromeuser -c "./node_modules/.bin/karma start k.js"', "unsupported_runner"),
    # yarn jest / bundle exec cucumber: the runner is a word or two in
    ("yarn jest", "yarn jest babel-parser -t arrow", "yarn jest babel-parser -t arrow",
     "unsupported_runner"),
    # setup only: nothing to run
    ("setup only", "pip install -e . && git status", "pip install -e . && git status", "no_test_command"),
]


@pytest.mark.parametrize("intent,given,expected,outcome", CASES, ids=[c[0] for c in CASES])
def test_shell_cases(intent, given, expected, outcome):
    res = patch_script(given)
    assert res.text == expected
    assert res.outcome == outcome
    again = patch_script(res.text)
    assert again.text == res.text  # idempotent
    if outcome == "patched":
        assert again.outcome == "already_patched"


EVAL_SCRIPT = """#!/bin/bash
set -uxo pipefail
source /opt/miniconda3/bin/activate
conda activate testbed
cd /testbed
# run pytest -rA later, not here
git -c core.fileMode=false diff abc123
python -m pip install -e .
git checkout abc123 tests/test_a.py
git apply -v - <<'EOF_114329324912'
diff --git a/tests/test_a.py b/tests/test_a.py
+    subprocess.run("pytest -n 4 -rA", shell=True)
EOF_114329324912
: '>>>>> Start Test Output'
pytest -rA tests/test_a.py
: '>>>>> End Test Output'
git checkout abc123 tests/test_a.py
"""


def test_eval_script_heredoc_comments_untouched():
    # quoted heredoc delimiter: bashlex cannot parse it, the line fallback skips the body
    res = patch_script(EVAL_SCRIPT)
    assert res.outcome == "patched"
    assert res.text == EVAL_SCRIPT.replace("\npytest -rA tests/test_a.py",
                                           f"\npytest -n {P} -rA tests/test_a.py")
    assert patch_script(res.text).text == res.text
    # unquoted delimiter: bashlex parses the whole script
    plain = EVAL_SCRIPT.replace("'EOF_114329324912'", "EOF_114329324912")
    assert patch_script(plain).text == plain.replace("\npytest -rA", f"\npytest -n {P} -rA")


def test_install_step_goes_after_activation():
    res = patch_script(EVAL_SCRIPT, install_step=True)
    assert f"{INSTALL_LINE}\npytest -n {P} -rA tests/test_a.py" in res.text
    assert res.text.index("conda activate testbed") < res.text.index(INSTALL_LINE)
    assert not res.needs_xdist
    assert patch_script(res.text, install_step=True).text == res.text
    one = patch_script("cd x && pytest -rA", install_step=True)
    assert one.text == f"{INSTALL_LINE}; cd x && pytest -n {P} -rA"


def test_existing_xdist_install_means_no_install_needed():
    res = patch_script("pip install pytest-xdist\npytest -rA", install_step=True)
    assert res.text == f"pip install pytest-xdist\npytest -n {P} -rA"
    assert not res.needs_xdist


def test_keep_explicit():
    res = patch_script("pytest -n 4 -rA; ./tests/runtests.py --parallel 2 x", keep_explicit=True)
    assert res.text == "pytest -n 4 -rA; ./tests/runtests.py --parallel 2 x"
    assert res.outcome == "kept_explicit"
    # a command without a count is still patched
    assert patch_script("pytest -rA", keep_explicit=True).text == f"pytest -n {P} -rA"


def test_explicit_count_means_xdist_installed():
    assert not patch_script("pytest -n 4").needs_xdist
    assert patch_script("pytest -rA").needs_xdist


# ---------------------------------------------------------------- records

def test_record_fields_and_fallbacks():
    rec = {"repo": "psf/requests", "test_cmd": "pytest -rA", "eval_script": "tox -e py3"}
    res = patch_record(rec)
    assert res.outcome == "patched"
    assert rec["test_cmd"] == f"pytest -n {P} -rA"
    assert rec["test_cmd_unpatched"] == "pytest -rA"
    assert rec["eval_script"] == "tox -e py3" and "eval_script_unpatched" not in rec
    assert rec[INSTALL_FIELD] == INSTALL_VALUE
    snapshot = json.dumps(rec, sort_keys=True)
    again = patch_record(rec)
    assert json.dumps(rec, sort_keys=True) == snapshot  # idempotent on the record too
    assert again.outcome == "already_patched"


def test_record_added_fields_do_not_replace():
    rec = {"test_cmd": "pytest", "test_cmd_unpatched": "keep me", INSTALL_FIELD: "mine"}
    patch_record(rec)
    assert rec["test_cmd_unpatched"] == "keep me" and rec[INSTALL_FIELD] == "mine"


def test_record_nested_list_and_bad_values():
    rec = {"extra_info": {"repo": "a/b", "inner": {"test_cmd": ["cd tests", "pytest -x"]}},
           "reward_model": {"test_cmd": 42}}
    res = patch_record(rec)
    assert rec["extra_info"]["inner"]["test_cmd"] == ["cd tests", f"pytest -n {P} -x"]
    assert rec["extra_info"]["inner"]["test_cmd_unpatched"] == ["cd tests", "pytest -x"]
    bad = [f for f in res.fields if f.path == "reward_model.test_cmd"][0]
    assert bad.outcome == "no_test_command"
    assert "reward_model.test_cmd" in bad.notes[0] and "int" in bad.notes[0]
    assert rec["reward_model"]["test_cmd"] == 42


def test_record_install_step_once_per_list():
    rec = {"test_cmd": ["pytest a", "pytest b"]}
    patch_record(rec, install_step=True)
    assert sum(INSTALL_LINE in part for part in rec["test_cmd"]) == 1
    assert INSTALL_FIELD not in rec


# ---------------------------------------------------------------- actions

def test_reward_action_spec():
    rec = {"repo": "pallets/flask", "extra_info": {"test_cmd": "pytest -rA tests/x.py"}}
    spec = reward_action_spec(rec, max_cpu=8)
    assert spec == {"kind": "exec", "command": f"pytest -n {P} -rA tests/x.py",
                    "resources": {"cpu": {"min": 1, "max": 8}}, "profile": "pytest:pallets/flask"}
    json.dumps(spec)  # plain wire format
    tox = reward_action_spec({"repo": "r", "test_cmd": "tox -e py"}, field="test_cmd", max_cpu=8)
    assert tox["resources"]["cpu"] == {"min": 1, "max": 1}  # cannot use more cores
    dj = reward_action_spec({"repo": "django/django", "test_cmd": "./tests/runtests.py x"}, max_cpu=4)
    assert dj["profile"] == "django:django/django" and dj["resources"]["cpu"]["max"] == 4
    with pytest.raises(ValueError, match="max_cpu"):
        reward_action_spec(rec, min_cpu=4, max_cpu=2)
    with pytest.raises(ValueError, match="no test command field"):
        reward_action_spec({"repo": "x"})


# ---------------------------------------------------------------- files and CLI

RECORDS = [
    {"repo": "psf/requests", "instance_id": "r-1", "test_cmd": "pytest -rA tests/test_a.py"},
    {"repo": "django/django", "instance_id": "d-1",
     "test_cmd": "./tests/runtests.py --verbosity 2 --parallel 1 basic"},
    {"repo": "sphinx-doc/sphinx", "instance_id": "s-1", "test_cmd": "tox --current-env -epy39 -v --"},
    {"repo": "pytest-dev/pytest", "instance_id": "p-1", "test_cmd": "pytest -p no:xdist -rA"},
    {"repo": "psf/requests", "instance_id": "r-2", "test_cmd": f"pytest -n {P} -rA"},
    {"repo": "psf/requests", "instance_id": "r-3", "problem": "no command here"},
]
EXPECTED_CMDS = [f"pytest -n {P} -rA tests/test_a.py",
                 f"./tests/runtests.py --verbosity 2 --parallel {P} basic",
                 "tox --current-env -epy39 -v --", "pytest -p no:xdist -rA", f"pytest -n {P} -rA", None]


def _write(path, fmt, records):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif fmt == "json":
        path.write_text(json.dumps(records, indent=2))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(records), path)


def _read(path, fmt):
    if fmt == "jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    if fmt == "json":
        return json.loads(path.read_text())
    import pyarrow.parquet as pq
    return pq.read_table(path).to_pylist()


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_cli_formats(tmp_path, fmt, capsys):
    src, dst, rep = tmp_path / f"in.{fmt}", tmp_path / f"out.{fmt}", tmp_path / "report.json"
    _write(src, fmt, RECORDS)
    assert tangram_main(["patch-dataset", str(src), str(dst), "--field", "test_cmd",
                         "--report", str(rep)]) == 0
    out = _read(dst, fmt)
    assert [r["instance_id"] for r in out] == [r["instance_id"] for r in RECORDS]  # order kept
    assert [r.get("test_cmd") for r in out] == EXPECTED_CMDS
    assert out[0]["test_cmd_unpatched"] == "pytest -rA tests/test_a.py"
    assert out[0][INSTALL_FIELD] == INSTALL_VALUE
    report = json.loads(rep.read_text())
    assert report["outcomes"] == {"patched": 2, "already_patched": 1, "no_xdist_optout": 1,
                                  "unsupported_runner": 1, "no_test_command": 1}
    assert report["repos"]["psf/requests"] == {"patched": 1, "already_patched": 1, "no_test_command": 1}
    assert report["unsupported_runners"] == {"tox": 1}
    assert report["examples"]["unsupported_runner"][0]["repo"] == "sphinx-doc/sphinx"
    printed = capsys.readouterr().out
    assert "patched" in printed and "sphinx-doc/sphinx" in printed


def test_parquet_nested_extra_info(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [
        {"data_source": "swe", "prompt": [{"role": "user", "content": "fix it"}],
         "reward_model": {"style": "rule", "ground_truth": "x"},
         "extra_info": {"index": 0, "repo": "pallets/flask",
                        "tools_kwargs": {"eval": {"test_cmd": "pytest -rA tests/test_b.py"}}}},
        {"data_source": "swe", "prompt": [{"role": "user", "content": "and this"}],
         "reward_model": {"style": "rule", "ground_truth": "y"},
         "extra_info": {"index": 1, "repo": "sympy/sympy",
                        "tools_kwargs": {"eval": {"test_cmd": "bin/test -C"}}}},
    ]
    table = pa.Table.from_pylist(rows).replace_schema_metadata({b"owner": b"verl"})
    src, dst = tmp_path / "train.parquet", tmp_path / "patched.parquet"
    pq.write_table(table, src)
    assert tangram_main(["patch-dataset", str(src), str(dst), "--field", "test_cmd"]) == 0
    out_table = pq.read_table(dst)
    out = out_table.to_pylist()
    ev = out[0]["extra_info"]["tools_kwargs"]["eval"]
    assert ev["test_cmd"] == f"pytest -n {P} -rA tests/test_b.py"
    assert ev["test_cmd_unpatched"] == "pytest -rA tests/test_b.py"
    assert out[1]["extra_info"]["tools_kwargs"]["eval"]["test_cmd"] == "bin/test -C"
    assert out[1]["extra_info"]["tools_kwargs"]["eval"]["test_cmd_unpatched"] is None
    assert out[0]["prompt"] == rows[0]["prompt"] and out[0]["reward_model"] == rows[0]["reward_model"]
    assert out_table.schema.names[:4] == table.schema.names  # original columns first, same order
    assert out_table.schema.metadata[b"owner"] == b"verl"
    # dotted path names the exact field; a second run changes nothing
    dst2 = tmp_path / "again.parquet"
    assert tangram_main(["patch-dataset", str(dst), str(dst2),
                         "--field", "extra_info.tools_kwargs.eval.test_cmd"]) == 0
    assert pq.read_table(dst2).to_pylist() == out


def test_cli_dry_run_writes_nothing(tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, "jsonl", RECORDS)
    assert tangram_main(["patch-dataset", str(src), str(dst), "--dry-run"]) == 0
    assert not dst.exists()
    assert "patched" in capsys.readouterr().out


@pytest.mark.parametrize("name,content,reason", [
    ("missing.jsonl", None, "no such file"),
    ("broken.jsonl", '{"test_cmd": "pytest"}\n{not json\n', "line 2"),
    ("broken.json", '{"a": 1}', "expected a JSON list"),
    ("broken.parquet", "not parquet at all", "Parquet"),
    ("data.txt", "hello", "unknown extension"),
])
def test_cli_unreadable_input(tmp_path, name, content, reason):
    src = tmp_path / name
    if content is not None:
        src.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "tangram.cli", "patch-dataset", str(src),
                           str(tmp_path / "out.jsonl")], capture_output=True, text=True)
    assert proc.returncode != 0
    assert str(src) in proc.stderr and reason in proc.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_cli_subprocess_roundtrip(tmp_path):
    src, dst = tmp_path / "in.json", tmp_path / "out.json"
    _write(src, "json", RECORDS)
    proc = subprocess.run([sys.executable, "-m", "tangram.cli", "patch-dataset", str(src), str(dst),
                           "--install-step"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(dst.read_text())
    assert out[0]["test_cmd"] == f"{INSTALL_LINE}; pytest -n {P} -rA tests/test_a.py"
    assert INSTALL_FIELD not in out[0]


# ---------------------------------------------------------------- a real run

def test_patched_command_runs_with_xdist(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_tiny.py").write_text(textwrap.dedent("""
        import os

        def test_runs_in_a_worker():
            assert os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw")

        def test_one():
            assert 1 + 1 == 2

        def test_two():
            assert "a" * 2 == "aa"
    """))
    command = patch_script("pytest -rA tests/").text
    assert command == f"pytest -n {P} -rA tests/"
    env = dict(os.environ, parallel_num="2",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "created: 2/2 workers" in proc.stdout or "2 workers [3 items]" in proc.stdout
    assert "3 passed" in proc.stdout


def test_cli_keep_explicit_and_mislabelled_json(tmp_path):
    # one object per line although named .json: read as JSONL, written back the same way
    src, dst = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text('{"test_cmd": "pytest -n 4"}\n{"test_cmd": "pytest -rA"}\n')
    assert tangram_main(["patch-dataset", str(src), str(dst), "--keep-explicit"]) == 0
    lines = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["test_cmd"] for r in lines] == ["pytest -n 4", f"pytest -n {P} -rA"]
