"""Builds the one compiled module, the ACT estimate's hot loops (``tangram/policy/walk.py`` with the
C types of ``walk.pxd``), with Cython. Everything else is in ``pyproject.toml``.

The build is optional: without Cython or a C compiler the install goes on with a warning and the
plain-Python module runs (the same results, ~3-4x slower estimates; ``tangram.policy.compiled``).
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

WALK = "tangram/policy/walk.py"


def _record(library: Path) -> None:
    """Beside a built module, the digest of the source it was built from: the package runs the
    compiled module only while the source still has that digest (tangram/policy/compiled.py)."""
    digest = hashlib.sha256(Path(WALK).read_bytes()).hexdigest()
    Path(str(library) + ".sha256").write_text(digest + "\n")


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, not a failed install: the pure-Python module is the fallback."""

    def run(self):
        self._built: set[str] = set()  # the extensions this run built (a failed one keeps no record)
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any compiler or toolchain failure
            self._warn(e)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            self._warn(e)
            return
        self._built.add(ext.name)
        _record(Path(self.get_ext_fullpath(ext.name)))

    def copy_extensions_to_source(self):
        """An editable install builds elsewhere and copies the library into the package: the record too."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            if ext.name not in getattr(self, "_built", ()):
                continue  # not built here: a library left from an earlier build must not be vouched for
            fullname = self.get_ext_fullname(ext.name)
            package_dir = build_py.get_package_dir(".".join(fullname.split(".")[:-1]))
            library = Path(package_dir) / Path(self.get_ext_filename(fullname)).name
            _record(library)

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
