"""Which implementation of the estimate's hot loops (``tangram/policy/walk.py``) a process runs.

``setup.py`` compiles ``walk.py`` with Cython when it can; the shared library
then sits beside the source and Python's import prefers it. Two cases must
not run it: a source edited (or checked out) after the build, whose compiled
module would silently run the old code, and ``TANGRAM_PURE_PYTHON=1``
(profiling, or comparing the two). Both load the source instead; the first
also warns, naming the rebuild command.
"""
from __future__ import annotations

import importlib
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


def walk_module(name: str = WALK) -> ModuleType:
    """The compiled module ``name`` when it is built from the current source, else the source itself."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec(name)
    origin = Path(spec.origin)
    source = origin.with_name(name.rsplit(".", 1)[-1] + ".py")
    if origin.suffix != ".py":
        if os.environ.get(PURE_ENV) == "1":
            return _load_source(name, source)
        if source.exists() and source.stat().st_mtime > origin.stat().st_mtime:
            warnings.warn(f"{source} is newer than its compiled module {origin.name}: running the source "
                          "(slower); rebuild with `pip install -e .`", RuntimeWarning, stacklevel=2)
            return _load_source(name, source)
    return importlib.import_module(name)


def source_module(name: str = "walk") -> ModuleType:
    """The plain-Python module of ``tangram/policy/<name>.py``, loaded apart from the one imported
    (tests compare the two)."""
    return _load_source(f"tangram.policy._source_{name}", Path(__file__).with_name(f"{name}.py"))
