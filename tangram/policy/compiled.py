"""Which implementation of the estimate's hot loops (``tangram/policy/walk.py``) a process runs.

``setup.py`` compiles ``walk.py`` (with the C types of ``walk.pxd``) with Cython when it can; the
shared library then sits beside the source and Python's import prefers it, and beside it
``<library>.sha256`` holds the digest of the two files it was translated from (and, for the
modules below, of the directives: :func:`source_digest`). Two cases must
not run it: sources that no longer have that digest (edited or checked out after the build: the
library would silently run the old code; a library without the file counts as that), and
``TANGRAM_PURE_PYTHON=1`` (profiling, or comparing the two). Both load the source instead; the
first also warns, naming the rebuild command. A digest, not file times: an install writes the
library and the source in an order of its own, and a copy may keep an older time.

``walk_arrays.pyx`` (the walk on C arrays, the same floats) is built beside it and judged the same
way; the estimate walks with it only when the compiled walk runs (:func:`arrays_walk`).

The modules of a round (:data:`NATIVE`) are compiled whole, from their plain source (Cython reads
a ``.pxd`` beside one where there is one: ``schedule.pxd``, ``greedy.pxd``). They are imported by
name all over the package, so they are judged on import: :class:`NativeFinder`, ahead of Python's
own finders (``tangram/policy/__init__.py`` puts it there before any of them is imported), sends a
stale library, one without its record, and every one under ``TANGRAM_PURE_PYTHON=1``, to its
source.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

WALK = "tangram.policy.walk"
PURE_ENV = "TANGRAM_PURE_PYTHON"


def _load_source(name: str, source: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# the Cython directives setup.py translates the NATIVE modules with (their annotations are
# documentation: a `list` one must not refuse the tuple a caller passes, as Cython's typing of
# annotations would). Part of those libraries' digests: a library built under other directives
# is stale, as one built from another source is
NATIVE_DIRECTIVES = {"annotation_typing": False}


def build_directives(source: Path) -> dict:
    """The Cython directives setup.py translates ``source`` with: :data:`NATIVE_DIRECTIVES` for
    the ``.py`` of a :data:`NATIVE` module, none for the walk's sources."""
    return dict(NATIVE_DIRECTIVES) if source.suffix == ".py" and source.stem in NATIVE else {}


def source_digest(source: Path, directives: dict | None = None) -> str:
    """sha256 of ``source``, its ``.pxd`` (when there is one) and the directives it is translated
    with (``None``: :func:`build_directives`; none adds nothing), as setup.py records it. Not the
    Cython version: the build takes any 3.x (pyproject.toml), and two of them translating one
    source under one set of directives are taken to behave alike."""
    h = hashlib.sha256(source.read_bytes())
    pxd = source.with_suffix(".pxd")
    if pxd.exists():
        h.update(pxd.read_bytes())
    directives = build_directives(source) if directives is None else directives
    if directives:
        h.update(repr(sorted(directives.items())).encode())
    return h.hexdigest()


def _built_from(library: Path, source: Path) -> bool:
    """Whether ``library`` records the digest its sources have now."""
    try:
        recorded = Path(str(library) + ".sha256").read_text().strip()
    except OSError:
        return False
    return recorded == source_digest(source)


def walk_module(name: str = WALK) -> ModuleType:
    """The compiled module ``name`` when it is built from the current source, else the source itself."""
    loaded = sys.modules.get(name)
    if loaded is not None and loaded.__file__.endswith(".py"):
        return loaded  # the source: nothing to judge (a library is judged on every call: one digest)
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ImportError(f"{name}: neither its source nor a compiled module is installed")
    origin = Path(spec.origin)
    source = origin.with_name(name.rsplit(".", 1)[-1] + ".py")
    if origin.suffix != ".py":
        if os.environ.get(PURE_ENV) == "1":
            return _load_source(name, source)
        if source.exists() and not _built_from(origin, source):
            warnings.warn(f"{origin.name} was not built from {source} as it is now: running the source "
                          "(slower); rebuild with `pip install -e .`", RuntimeWarning, stacklevel=2)
            return _load_source(name, source)
    return loaded if loaded is not None else importlib.import_module(name)


ARRAYS = "tangram.policy.walk_arrays"


def arrays_walk(hot: ModuleType, name: str = ARRAYS):
    """``walk`` of the compiled ``walk_arrays`` (walk.walk on C arrays, the same floats) when it is
    built from its ``.pyx`` as it is now and ``hot`` (the walk module in use) is compiled too;
    else ``hot.walk``. Only a compiled build has it: a plain-Python run (``TANGRAM_PURE_PYTHON=1``,
    or no compiler) runs the source throughout."""
    if not getattr(hot, "COMPILED", False) or os.environ.get(PURE_ENV) == "1":
        return hot.walk
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or spec.origin.endswith(".py"):
        return hot.walk
    origin = Path(spec.origin)
    source = origin.with_name(name.rsplit(".", 1)[-1] + ".pyx")
    if not _built_from(origin, source):
        if source.exists():
            warnings.warn(f"{origin.name} was not built from {source} as it is now: the walk runs "
                          "on Python lists (slower); rebuild with `pip install -e .`", RuntimeWarning, stacklevel=2)
        return hot.walk
    return importlib.import_module(name).walk


def source_module(name: str = "walk") -> ModuleType:
    """The plain-Python module of ``tangram/policy/<name>.py``, loaded apart from the one imported
    (tests compare the two)."""
    return _load_source(f"tangram.policy._source_{name}", Path(__file__).with_name(f"{name}.py"))


# the policy modules setup.py compiles whole (the round's hot path): the same source, ~0.8x the round
NATIVE = ("affinity", "arrange", "elastic", "estimate", "greedy", "needs", "node_rank", "rows", "schedule",
          "snapshot")
_PACKAGE = __name__.rpartition(".")[0]  # tangram.policy (a benchmark loads an older copy under another name)
_HERE = Path(__file__).parent


def native_library(short: str, here: Path = _HERE) -> Path | None:
    """The library setup.py built of ``here/<short>.py`` for this interpreter, if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        library = here / f"{short}{suffix}"
        if library.exists():
            return library
    return None


class NativeFinder:
    """A meta path finder for the modules of this package: says nothing (Python's own finders then
    import the library, which they prefer to the source) unless a library must not run, and then
    gives the source's spec. Imports nothing itself: it only judges. Every library beside a ``.py``
    is judged, not only :data:`NATIVE`'s (a module that leaves the list may leave its library
    behind), but the walk's, which :func:`walk_module` judges."""

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None):
        package, _, short = fullname.rpartition(".")
        if package != _PACKAGE or short == WALK.rpartition(".")[2]:
            return None
        library = native_library(short)
        if library is None:
            return None  # nothing built: the source is all there is
        source = _HERE / f"{short}.py"
        if not source.exists():
            if (_HERE / f"{short}.pyx").exists():
                return None  # built from another kind of source (walk_arrays.pyx: arrays_walk judges it)
            raise ModuleNotFoundError(f"{library}: left from a module this package no longer has (remove it)",
                                      name=fullname)
        if os.environ.get(PURE_ENV) != "1":
            if _built_from(library, source):
                return None
            warnings.warn(f"{library.name} was not built from {source} as it is now: running the source "
                          "(slower); rebuild with `pip install -e .`", RuntimeWarning, stacklevel=2)
        return importlib.util.spec_from_file_location(fullname, source)


def install_native_finder() -> None:
    """Put :class:`NativeFinder` first on ``sys.meta_path`` (once)."""
    if NativeFinder not in sys.meta_path:
        sys.meta_path.insert(0, NativeFinder)


def native_modules() -> dict[str, bool]:
    """Each imported :data:`NATIVE` module: whether it runs compiled (its library) or as its source."""
    out = {}
    for short in NATIVE:
        module = sys.modules.get(f"{_PACKAGE}.{short}")
        if module is not None:
            out[short] = not (module.__file__ or "").endswith(".py")
    return out
