"""The modules of a round compiled whole (setup.py, ``compiled.NATIVE``): in use after the install,
the same decisions as their plain source, and left for the source when stale or when asked."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tangram.policy import compiled

ROOT = Path(__file__).resolve().parent.parent
_READ = """
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import tangram.core.engine  # imports the whole policy, as the service and the simulator do
    from tangram.policy import compiled
    import tangram.policy.rows as rows
print(json.dumps({"native": compiled.native_modules(), "mark": getattr(rows, "MARK", None),
                  "stale": [str(w.message) for w in caught if "was not built from" in str(w.message)]}))
"""


def _read(root: Path, **env) -> dict:
    done = subprocess.run([sys.executable, "-c", _READ], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root), **env}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _built() -> None:
    if os.environ.get(compiled.PURE_ENV) == "1":
        pytest.fail("TANGRAM_PURE_PYTHON=1: nothing compiled to check")
    missing = [n for n in compiled.NATIVE if compiled.native_library(n) is None]
    assert not missing, f"`pip install -e .` built no library of {missing} (see the install's WARNING)"


def test_the_install_compiled_every_module_of_a_round():
    """`pip install -e .` builds them (without a C compiler it only warns: this says so); each
    library records the digest of its source as checked out, and the package runs it."""
    _built()
    here = Path(compiled.__file__).parent
    for name in compiled.NATIVE:
        library = compiled.native_library(name)
        recorded = Path(str(library) + ".sha256").read_text().strip()
        assert recorded == compiled.source_digest(here / f"{name}.py"), name
    seen = _read(ROOT)
    assert seen["native"] == {name: True for name in compiled.NATIVE} and not seen["stale"]


@pytest.fixture
def copy_of_the_package(tmp_path) -> Path:
    """The installed package (its libraries and their records included) copied apart, to edit."""
    shutil.copytree(ROOT / "tangram", tmp_path / "tangram", ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    return tmp_path


def test_a_module_edited_after_the_build_runs_its_source(copy_of_the_package):
    """Python's import prefers a library to its source: an edited source (or one checked out after
    the build) must run as it is now, with a warning naming the rebuild, and the others compiled."""
    _built()
    rows = copy_of_the_package / "tangram" / "policy" / "rows.py"
    rows.write_text(rows.read_text() + "\nMARK = 1\n")
    seen = _read(copy_of_the_package)
    assert seen["mark"] == 1
    assert seen["native"] == {name: name != "rows" for name in compiled.NATIVE}
    assert len(seen["stale"]) == 1 and "rows" in seen["stale"][0] and "pip install -e ." in seen["stale"][0]


def test_a_library_of_a_module_no_longer_compiled_is_judged_too(copy_of_the_package):
    """A module taken off ``compiled.NATIVE`` may leave its library behind (an install does not
    delete it): edited since, it runs as its source all the same."""
    _built()
    policy = copy_of_the_package / "tangram" / "policy"
    compiled_py = policy / "compiled.py"
    compiled_py.write_text(compiled_py.read_text().replace('"node_rank", ', ""))
    node_rank = policy / "node_rank.py"
    node_rank.write_text(node_rank.read_text() + "\n# edited\n")
    done = subprocess.run([sys.executable, "-W", "always", "-c",
                           "import tangram.core.engine, tangram.policy.node_rank as m; print(m.__file__)"],
                          cwd=copy_of_the_package, capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, "PYTHONPATH": str(copy_of_the_package)})
    assert done.stdout.strip().endswith("node_rank.py") and "was not built from" in done.stderr


def test_a_library_built_under_other_directives_is_not_run(copy_of_the_package):
    """The directives are part of a library's digest: changed in compiled.py (which setup.py
    compiles with), every library of a round is stale until the rebuild, and the sources run."""
    _built()
    compiled_py = copy_of_the_package / "tangram" / "policy" / "compiled.py"
    text = compiled_py.read_text()
    assert 'NATIVE_DIRECTIVES = {"annotation_typing": False}' in text
    compiled_py.write_text(text.replace('NATIVE_DIRECTIVES = {"annotation_typing": False}',
                                        'NATIVE_DIRECTIVES = {"annotation_typing": False, "cdivision": True}'))
    seen = _read(copy_of_the_package)
    assert seen["native"] == {name: False for name in compiled.NATIVE}
    assert len(seen["stale"]) == len(compiled.NATIVE)


def test_the_digest_covers_a_native_modules_directives(tmp_path, monkeypatch):
    here = Path(compiled.__file__).parent
    rows, walk = here / "rows.py", here / "walk.py"
    assert compiled.source_digest(rows) == compiled.source_digest(rows, compiled.NATIVE_DIRECTIVES)
    assert compiled.source_digest(rows) != compiled.source_digest(rows, {})
    assert compiled.source_digest(walk) == compiled.source_digest(walk, {})  # the walk: Cython's defaults
    before = compiled.source_digest(rows)
    monkeypatch.setattr(compiled, "NATIVE_DIRECTIVES", {"annotation_typing": False, "cdivision": True})
    assert compiled.source_digest(rows) != before
    copy = tmp_path / "rows.py"  # another module of that name is judged alike: the name says native
    shutil.copy(rows, copy)
    assert compiled.source_digest(copy) == compiled.source_digest(rows)


def test_a_library_without_its_record_is_not_run(copy_of_the_package):
    """No digest beside the library (a build that did not record it, a copy without it): the source."""
    _built()
    library = compiled.native_library("schedule", copy_of_the_package / "tangram" / "policy")
    Path(str(library) + ".sha256").unlink()
    seen = _read(copy_of_the_package)
    assert seen["native"] == {name: name != "schedule" for name in compiled.NATIVE}


def test_pure_python_runs_every_module_as_its_source():
    seen = _read(ROOT, **{compiled.PURE_ENV: "1"})
    assert seen["native"] == {name: False for name in compiled.NATIVE} and not seen["stale"]


def test_the_finder_judges_the_libraries_of_this_package_alone():
    assert compiled.NativeFinder in sys.meta_path
    assert compiled.NativeFinder.find_spec("tangram.policy.memo") is None  # no library
    assert compiled.NativeFinder.find_spec("tangram.policy.walk") is None  # judged by walk_module
    assert compiled.NativeFinder.find_spec("tangram.policy.walk_arrays") is None  # a .pyx: arrays_walk
    assert compiled.NativeFinder.find_spec("other.schedule") is None
    assert compiled.NativeFinder.find_spec("tangram.policy.schedule") is None or \
        os.environ.get(compiled.PURE_ENV) == "1"  # a fresh library: Python's own finders import it


def test_compiled_and_source_modules_decide_alike():
    """Eight seeded simulations of the built-in workloads (scripts/decision_digest.py: every
    action's submit, start, end, units and restore): the libraries and the sources give the same records."""
    def digests(**env):
        done = subprocess.run([sys.executable, "scripts/decision_digest.py", "--json"], cwd=ROOT, check=True,
                              capture_output=True, text=True, timeout=600, env={**os.environ, **env})
        return json.loads(done.stdout)

    compiled_run = digests()
    assert len(compiled_run) >= 8
    assert compiled_run == digests(**{compiled.PURE_ENV: "1"})


@pytest.mark.parametrize("as_source,pure", [((), False), (("rows", "schedule"), False), (("rows", "schedule"), True)])
async def test_the_service_names_the_modules_that_run_as_source(monkeypatch, caplog, as_source, pure):
    """pip hides a failed build's warning: `tangram serve` names them at start instead (and does
    not advise a rebuild when the sources were asked for)."""
    import tangram.service.build as build
    from tangram.service.config import parse_config

    monkeypatch.setattr(build, "native_modules", lambda: {n: n not in as_source for n in compiled.NATIVE})
    walk = compiled.walk_module()  # as imported: under the variable below it would load its source for good
    monkeypatch.setattr(build, "walk_module", lambda: walk)
    if pure:
        monkeypatch.setenv(compiled.PURE_ENV, "1")
    else:
        monkeypatch.delenv(compiled.PURE_ENV, raising=False)
    cfg = parse_config({"cpu_nodes": [], "gpu_nodes": [], "api_pools": {"search": {"concurrency": 1}}})
    with caplog.at_level("WARNING", logger="tangram.service"):
        async with await build.build_runtime(cfg):
            pass
    said = [r.getMessage() for r in caplog.records if "run as plain Python" in r.getMessage()]
    why = "TANGRAM_PURE_PYTHON=1 asks for it" if pure else "reinstall with a C compiler at hand (pip install -e .)"
    assert said == ([] if not as_source else
                    [f"the policy's modules rows, schedule run as plain Python: rounds are ~1.2x slower; {why}"])


def test_a_library_whose_source_is_gone_is_not_imported(copy_of_the_package):
    """A module deleted from the package may leave its library behind: importing it says so
    instead of running code nothing in the tree has any more."""
    _built()
    policy = copy_of_the_package / "tangram" / "policy"
    library = compiled.native_library("node_rank", policy)
    shutil.copy(library, policy / library.name.replace("node_rank", "ghost"))
    done = subprocess.run([sys.executable, "-c", "import tangram.policy.ghost"], cwd=copy_of_the_package,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(copy_of_the_package)})
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr and "no longer has" in done.stderr
