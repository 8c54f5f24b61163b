"""Builds the one compiled module, the ACT estimate's hot loops (``tangram/policy/walk.py`` with the
C types of ``walk.pxd``), with Cython. Everything else is in ``pyproject.toml``.

The build is optional: without Cython or a C compiler the install goes on with a warning and the
plain-Python module runs (the same results, ~3-4x slower estimates; ``tangram.policy.compiled``).
"""
from __future__ import annotations

import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

WALK = "tangram/policy/walk.py"


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, not a failed install: the pure-Python module is the fallback."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any compiler or toolchain failure
            self._warn(e)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            self._warn(e)

    @staticmethod
    def _warn(e: Exception) -> None:
        print(f"WARNING: arl-tangram: {WALK} was not compiled ({type(e).__name__}: {e}); "
              "the plain-Python module runs instead (same results, slower scheduling rounds)", file=sys.stderr)


def _extensions():
    try:
        from Cython.Build import cythonize
    except ImportError as e:
        OptionalBuildExt._warn(e)
        return []
    return cythonize([WALK], language_level=3, quiet=True)


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
