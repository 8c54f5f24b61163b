"""The patcher on SWE-bench's real evaluation specs (swebench 4.1.0's MAP_REPO_VERSION_TO_SPECS).

swebench is installed by scripts/install_test_extras.sh (``--no-deps``: its
own dependencies - modal, datasets, docker ... - are not needed for the
constants). Where it is missing this test installs it into a temporary
directory; only the constants package is imported, without swebench's
``__init__`` (which would import those dependencies).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import types

import pytest

from datasets_patch.rewrite import PARALLEL, patch_script
from datasets_patch.runners import resolve
from datasets_patch.shell import parse_script

SWEBENCH = "swebench==4.1.0"


def _swebench_root(tmp_dir: str) -> str:
    try:
        if importlib.metadata.version("swebench") == "4.1.0":
            spec = importlib.util.find_spec("swebench")
            return list(spec.submodule_search_locations)[0]
    except importlib.metadata.PackageNotFoundError:
        pass
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                           tmp_dir, SWEBENCH], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"cannot install {SWEBENCH} (run scripts/install_test_extras.sh): {proc.stderr[-2000:]}")
    return os.path.join(tmp_dir, "swebench")


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> dict:
    root = _swebench_root(str(tmp_path_factory.mktemp("swebench")))
    saved = {k: v for k, v in sys.modules.items() if k == "swebench" or k.startswith("swebench.")}
    try:
        for k in saved:
            del sys.modules[k]
        # empty parent packages pointing at the real files: swebench/__init__
        # imports docker, datasets, modal ... that the constants do not need
        for name, sub in (("swebench", root), ("swebench.harness", os.path.join(root, "harness"))):
            pkg = types.ModuleType(name)
            pkg.__path__ = [sub]
            sys.modules[name] = pkg
        constants = importlib.import_module("swebench.harness.constants")
        return constants.MAP_REPO_VERSION_TO_SPECS
    finally:
        for k in [k for k in sys.modules if k == "swebench" or k.startswith("swebench.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _test_cmds(specs: dict):
    for repo, versions in specs.items():
        for version, spec in versions.items():
            cmd = spec.get("test_cmd")
            for part in cmd if isinstance(cmd, list) else [cmd]:
                if part is not None:
                    yield repo, version, part


def _runs(text: str, kind: str):
    for cmd in parse_script(text).commands:
        if cmd.words:
            runner = resolve(cmd.words)
            if runner.kind == kind:
                yield cmd, runner


def _check_pytest_once(text: str) -> int:
    """Each pytest run has exactly one worker option, and it is ``-n ${parallel_num}``."""
    n = 0
    for cmd, runner in _runs(text, "pytest"):
        args = [w.value for w in cmd.words[runner.program + 1:]]
        worker_opts = [a for a in args if a == "-n" or a.startswith("-n") and len(a) > 2
                       or a.startswith("--numprocesses")]
        assert worker_opts == ["-n"], text
        assert args[args.index("-n") + 1] == PARALLEL, text
        n += 1
    return n


def test_every_swebench_test_cmd(specs):
    assert len(specs) > 50  # the loader found the real table
    outcomes: dict[str, set[str]] = {}
    seen = 0
    for repo, version, cmd in _test_cmds(specs):
        seen += 1
        res = patch_script(cmd)
        outcomes.setdefault(res.outcome, set()).add(repo)
        where = f"{repo} {version}: {cmd!r}"
        assert patch_script(res.text).text == res.text, where  # idempotent
        has_pytest = any(True for _ in _runs(cmd, "pytest"))
        has_django = any(True for _ in _runs(cmd, "django"))
        if has_pytest or has_django:
            assert res.outcome == "patched", where
            assert res.text.count(PARALLEL) >= 1
        else:
            assert res.text == cmd, where  # other runners untouched
            assert res.outcome in ("unsupported_runner", "no_test_command"), where
        if has_pytest:
            assert _check_pytest_once(res.text) >= 1, where
        if has_django:
            assert res.text.count(f"--parallel {PARALLEL}") == 1, where
            assert "--parallel 1" not in res.text, where
    assert seen > 200
    # the Python repositories of SWE-bench run pytest, Django its runner
    for repo in ("astropy/astropy", "django/django", "pallets/flask", "psf/requests",
                 "scikit-learn/scikit-learn", "pydata/xarray", "pytest-dev/pytest"):
        assert repo in outcomes["patched"], repo
    # sympy's bin/test, sphinx's tox, go/cargo/jest runners are reported, not rewritten
    for repo in ("sympy/sympy", "sphinx-doc/sphinx", "gin-gonic/gin", "tokio-rs/tokio", "babel/babel"):
        assert repo in outcomes["unsupported_runner"], repo


def _eval_script(spec: dict, test_cmd: str) -> str:
    """An evaluation script laid out as swebench's make_eval_script_list_py does."""
    delimiter = "EOF_114329324912"
    test_patch = ("diff --git a/tests/test_x.py b/tests/test_x.py\n"
                  "+    # the harness runs: pytest -n 4 -rA tests/\n"
                  "+    subprocess.run('pytest -rA', shell=True)\n")
    lines = ["source /opt/miniconda3/bin/activate", "conda activate testbed", "cd /testbed"]
    lines += spec.get("eval_commands", [])
    lines += ["git config --global --add safe.directory /testbed", "cd /testbed", "git status",
              "git show", "git -c core.fileMode=false diff abc123",
              "source /opt/miniconda3/bin/activate", "conda activate testbed"]
    if isinstance(spec.get("install"), str):
        lines.append(spec["install"])
    lines += ["git checkout abc123 tests/test_x.py",
              f"git apply -v - <<'{delimiter}'\n{test_patch}\n{delimiter}",
              ": '>>>>> Start Test Output'", test_cmd, ": '>>>>> End Test Output'",
              "git checkout abc123 tests/test_x.py"]
    return "#!/bin/bash\nset -uxo pipefail\n" + "\n".join(lines) + "\n"


def test_swebench_style_eval_scripts(specs):
    checked = 0
    for repo, versions in specs.items():
        for version, spec in versions.items():
            cmd = spec.get("test_cmd")
            if not isinstance(cmd, str):
                continue
            test_cmd = cmd + " tests/test_x.py"  # plus the instance's test directives
            script = _eval_script(spec, test_cmd)
            res = patch_script(script)
            expected_line = patch_script(test_cmd).text
            # only the test command line may change: setup, heredoc and markers stay
            assert res.text == script.replace("\n" + test_cmd + "\n", "\n" + expected_line + "\n"), \
                f"{repo} {version}"
            assert patch_script(res.text).text == res.text
            if expected_line != test_cmd:
                checked += 1
    assert checked > 20
