"""The compiled estimate (tangram/policy/walk.py built by setup.py with Cython) is in use, gives
exactly what the plain-Python source gives, and is left for the source when it is stale."""
from __future__ import annotations

import math
import os
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import tangram.policy.estimate as estimate
from tangram.policy import compiled
from tangram.policy.estimate import Arrivals


@pytest.fixture(scope="module")
def pair():
    """(the module the estimate runs, the plain-Python source loaded apart)."""
    return compiled.walk_module(), compiled.source_module("walk")


def test_the_install_compiled_the_estimate(pair):
    """`pip install -e .` builds it (setup.py); without a C compiler the install only warns, so this
    says so here unless the plain module was asked for (TANGRAM_PURE_PYTHON=1)."""
    hot, _ = pair
    if os.environ.get(compiled.PURE_ENV) == "1":
        assert not hot.COMPILED
    else:
        assert hot.COMPILED, f"{hot.__file__}: the estimate was not compiled (see the install's WARNING)"
        assert estimate._hot is hot


def _ends(rng: random.Random, n: int) -> list:
    ends = [(rng.choice([0.0, round(rng.uniform(0, 30), rng.choice([0, 2])), rng.uniform(0, 30)]),
             rng.randint(1, 9)) for _ in range(n)]
    if rng.random() < 0.1:
        ends.append((math.inf, rng.randint(1, 4)))  # a running action without a finite estimate
    return sorted(ends)


def _waiter(rng: random.Random) -> tuple:
    umin = rng.randint(1, 6)
    dmin = rng.choice([rng.uniform(0.01, 40), float(rng.randint(1, 5))])
    if rng.random() < 0.4:
        return umin, dmin, None
    counts = sorted(rng.sample(range(umin, umin + 24), rng.randint(1, 6)))
    options = tuple((u, dmin * umin / u * rng.uniform(1.0, 1.6)) for u in counts)
    return umin, dmin, options


def _walk_inputs(rng: random.Random) -> tuple:
    """Random ``(ends, waiters, free, k, now)`` for a walk: free below zero or as large as a memory
    pool's units, a start anywhere in the completions."""
    ends = _ends(rng, rng.choice([0, rng.randint(1, 6), rng.randint(1, 40)]))
    waiters = [_waiter(rng) for _ in range(rng.choice([0, 1, 2, rng.randint(3, 35)]))]
    free = rng.choice([rng.randint(-2, 12), 1 << 40])
    k = rng.randint(0, len(ends))
    now = rng.choice([0.0, rng.uniform(0, 5)])
    return ends, waiters, free, k, now


@pytest.mark.parametrize("seed", range(8))
def test_compiled_walk_equals_the_source_walk(pair, seed):
    """Same floats to the last bit, on random completions, waiters and search depths (units as
    large as a memory pool's, free below zero, completions at +inf included)."""
    hot, src = pair
    rng = random.Random(9000 + seed)
    for _ in range(300):
        ends, waiters, free, k, now = _walk_inputs(rng)
        for explore in range(4):
            a, b = list(ends), list(ends)
            got = hot.walk(a, k, free, now, waiters, 0, explore)
            want = src.walk(b, k, free, now, waiters, 0, explore)
            assert got == want or (math.isnan(got) and math.isnan(want))
            assert a == b  # the completions it leaves behind too
        if waiters:
            extra = (rng.uniform(0, 30), rng.randint(1, 9))
            assert hot.last_end(ends, k, free, now, waiters[-1], extra) == \
                src.last_end(ends, k, free, now, waiters[-1], extra)
        units = rng.randint(1, 30)
        assert hot.start_time(ends, k, free, now, units) == src.start_time(ends, k, free, now, units)


def test_the_install_built_the_walk_on_c_arrays(pair):
    """setup.py builds walk_arrays.pyx beside the compiled walk, and the estimate walks with it."""
    hot, _ = pair
    if os.environ.get(compiled.PURE_ENV) == "1":
        assert estimate._walk is hot.walk
    else:
        from tangram.policy import walk_arrays

        assert estimate._walk is walk_arrays.walk, "walk_arrays was not built (see the install's WARNING)"


@pytest.mark.parametrize("seed", range(8))
def test_the_walk_on_c_arrays_equals_the_source_walk(pair, seed):
    """Same floats to the last bit as walk.py's walk, from any completion k and waiter i, at every
    search depth; the caller's completions are left as they were."""
    from tangram.policy import walk_arrays  # built by the install (the test above), used or not

    _, src = pair
    rng = random.Random(9300 + seed)
    for _ in range(300):
        ends, waiters, free, k, now = _walk_inputs(rng)
        i = rng.choice([0, rng.randint(0, len(waiters))])
        for explore in range(4):
            a = list(ends)
            got = walk_arrays.walk(a, k, free, now, waiters, i, explore)
            want = src.walk(list(ends), k, free, now, waiters, i, explore)
            assert got == want or (math.isnan(got) and math.isnan(want))
            assert a == ends
    with pytest.raises(IndexError):
        walk_arrays.walk([(1.0, 1)], 2, 0, 0.0, [], 0, 1)


def test_the_walk_inserts_a_completion_where_insort_puts_it(pair):
    """walk.insert compares the pair's parts in C where insort compares tuples: the same place,
    after equal pairs, on ties of the end (and of the units) and at +inf. The source's insert is
    compared here (the compiled one is a C function, not callable from Python); the compiled walks
    above leave the source's lists behind, which carries this to them."""
    from bisect import insort

    _, src = pair
    rng = random.Random(9200)
    for _ in range(3000):
        ends = _ends(rng, rng.randint(0, 12))
        pick = rng.choice(ends) if ends and rng.random() < 0.5 else (rng.choice([0.0, 1.0, rng.uniform(0, 30)]), 3)
        end, units = pick[0], rng.choice([pick[1], rng.randint(1, 9)])
        lo = rng.randint(0, len(ends))
        while lo > 0 and ends[lo - 1] > (end, units):
            lo -= 1  # as the walk calls it: never past where the pair belongs
        a, b = list(ends), list(ends)
        src.insert(a, end, units, lo)
        insort(b, (end, units), lo)
        assert a == b and [type(x) for x in a] == [type(x) for x in b]


@pytest.mark.parametrize("seed", range(4))
def test_compiled_arrivals_equal_the_source(pair, seed):
    hot, src = pair
    rng = random.Random(9100 + seed)
    for _ in range(500):
        ends = _ends(rng, rng.randint(0, 15))
        items = sorted(((rng.choice([0.0, rng.uniform(-1, 6)]), rng.randint(1, 4), rng.uniform(0.1, 4.0))
                        for _ in range(rng.randint(0, 10))), key=lambda x: x[0])
        arr = Arrivals(items)
        free = rng.randint(-1, 20)
        a, b = list(ends), list(ends)
        args = (arr.units_before, arr.total_before, arr.ends, arr.items)
        assert hot.arrive(a, free, *args) == src.arrive(b, free, *args)
        assert a == b


def test_the_estimate_refuses_units_that_are_not_integers():
    """The compiled walk would truncate 2.5 free units to 2 where the source counts 2.5: refused in both."""
    waiters = [(3, 1.0, None)]
    assert estimate.estimate_sorted([(1.0, 2)], 2, waiters, 0) == 2.0  # starts at 1 s, when 4 units are free
    with pytest.raises(TypeError):
        estimate.estimate_sorted([(1.0, 2)], 2.5, waiters, 0)
    with pytest.raises(TypeError):
        estimate._arrive([(1.0, 2)], 2.5, [(0.5, 1, 1.0)])
    import numpy as np
    assert estimate.estimate_sorted([(1.0, 2)], np.int64(2), waiters, 0) == 2.0  # numpy integers are integers


def _fake_package(tmp_path, record: str | None):
    """A package holding a copy of the compiled walk and of its source, with the source digest the
    build recorded: the source's own ("match"), another ("other") or none (None)."""
    hot = compiled.walk_module()
    if not hot.COMPILED:
        pytest.fail("needs the compiled module (see test_the_install_compiled_the_estimate)")
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    so = pkg / os.path.basename(hot.__file__)
    shutil.copy(hot.__file__, so)
    src = pkg / "walk.py"
    shutil.copy(os.path.join(os.path.dirname(compiled.__file__), "walk.py"), src)
    if record is not None:
        digest = compiled.source_digest(src) if record == "match" else "0" * 64
        (pkg / (so.name + ".sha256")).write_text(digest + "\n")
    return pkg


def _import_fake(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fakepkg", "fakepkg.walk"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = compiled.walk_module("fakepkg.walk")
    stale = [w for w in caught if issubclass(w.category, RuntimeWarning) and "was not built from" in str(w.message)]
    return mod, stale


@pytest.mark.parametrize("record", ["match", "other", None])
def test_a_compiled_module_runs_only_while_its_source_is_what_it_was_built_from(tmp_path, monkeypatch, record):
    """The source edited or checked out after the build (its digest differs from the recorded one,
    or none was recorded): the source runs, with a warning naming the rebuild."""
    _fake_package(tmp_path, record)
    monkeypatch.delenv(compiled.PURE_ENV, raising=False)
    mod, stale = _import_fake(tmp_path, monkeypatch)
    fresh = record == "match"
    assert mod.COMPILED is fresh and mod.__file__.endswith(".py") is (not fresh)
    assert len(stale) == (0 if fresh else 1)
    assert compiled.walk_module("fakepkg.walk") is mod  # loaded once


def test_pure_python_can_be_asked_for(tmp_path, monkeypatch):
    _fake_package(tmp_path, "match")
    monkeypatch.setenv(compiled.PURE_ENV, "1")
    mod, stale = _import_fake(tmp_path, monkeypatch)
    assert not mod.COMPILED and mod.__file__.endswith("walk.py") and not stale


def test_the_installed_module_recorded_the_digest_of_this_source(pair):
    """What `pip install -e .` left beside the library matches walk.py as checked out (else every
    process would run the source and warn)."""
    hot, _ = pair
    if os.environ.get(compiled.PURE_ENV) == "1":
        pytest.fail("TANGRAM_PURE_PYTHON=1: nothing compiled to check")
    source = os.path.join(os.path.dirname(compiled.__file__), "walk.py")
    with open(hot.__file__ + ".sha256") as f:
        assert f.read().strip() == compiled.source_digest(Path(source))


ROOT = Path(__file__).resolve().parent.parent
_BUILD = """
import importlib.util, sys
from setuptools import setup
spec = importlib.util.spec_from_file_location("tangram_setup", sys.argv[1])
S = importlib.util.module_from_spec(spec); spec.loader.exec_module(S)
setup(name="walk-build-check", packages=[], py_modules=[], ext_modules=S.extensions(),
      cmdclass={"build_ext": S.OptionalBuildExt}, script_args=["build_ext", "--inplace", "-q"])
"""
_READ = "import tangram.policy.walk as w; print(w.__file__, w.COMPILED, getattr(w, 'MARK', None))"


def _build(tmp: Path) -> str:
    done = subprocess.run([sys.executable, "-c", _BUILD, str(ROOT / "setup.py")], cwd=tmp, check=True,
                          capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


def _read(tmp: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _READ], cwd=tmp, check=True, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(tmp)})
    return out.stdout.split()


def test_setup_records_the_digest_of_the_sources_it_really_compiled(tmp_path):
    """setup.py's build (the in-place copy an editable install makes): the library and the digest
    beside it; then a changed walk.py copied in with an OLDER file time (as `cp -p` or a cache
    restore leaves it) is compiled anew, not taken from the old C file under the new digest."""
    pkg = tmp_path / "tangram" / "policy"
    pkg.mkdir(parents=True)
    for init in (tmp_path / "tangram" / "__init__.py", pkg / "__init__.py"):
        init.write_text("")
    for name in ("walk.py", "walk.pxd"):
        shutil.copy(ROOT / "tangram" / "policy" / name, pkg / name)
    log = _build(tmp_path)
    libs = [p for p in pkg.iterdir() if p.suffix in (".so", ".pyd")]
    assert len(libs) == 1, f"setup.py built no library (Cython is in the dev extra):\n{log[-3000:]}"
    assert (pkg / (libs[0].name + ".sha256")).read_text().strip() == compiled.source_digest(pkg / "walk.py")
    file, is_compiled, mark = _read(tmp_path)
    assert file == str(libs[0]) and is_compiled == "True" and mark == "None"

    walk = pkg / "walk.py"
    before = walk.stat().st_mtime
    walk.write_text(walk.read_text() + "\nMARK = 2\n")
    os.utime(walk, (before - 3600, before - 3600))  # older than the C file and the library
    _build(tmp_path)
    assert (pkg / (libs[0].name + ".sha256")).read_text().strip() == compiled.source_digest(walk)
    assert _read(tmp_path) == [str(libs[0]), "True", "2"]  # the new source, compiled


@pytest.mark.parametrize("compiled_here", [True, False])
async def test_the_service_says_when_the_estimate_runs_as_plain_python(monkeypatch, caplog, compiled_here):
    """pip hides a failed build's warning: `tangram serve` logs it at start instead."""
    from tangram.service.build import build_runtime
    from tangram.service.config import parse_config

    real = compiled.walk_module()

    class Loops:  # the installed module's spec (the library, built from these sources), either answer
        COMPILED = compiled_here
        __file__ = "walk.so" if compiled_here else "walk.py"
        __spec__ = real.__spec__

    monkeypatch.setitem(sys.modules, compiled.WALK, Loops)
    cfg = parse_config({"cpu_nodes": [], "gpu_nodes": [], "api_pools": {"search": {"concurrency": 1}}})
    with caplog.at_level("WARNING", logger="tangram.service"):
        async with await build_runtime(cfg):
            pass
    said = [r for r in caplog.records if "runs as plain Python" in r.getMessage()]
    assert len(said) == (0 if compiled_here else 1)
