"""Builds the compiled modules of the policy with Cython: ``tangram/policy/walk.py`` (the ACT
estimate's hot loops) with the C types of ``walk.pxd``, ``walk_arrays.pyx``, the same walk on C
arrays, and the modules of a scheduling round whole from their plain source (``compiled.NATIVE``;
``schedule.pxd`` and ``greedy.pxd`` type a few of their parts). Everything else is in
``pyproject.toml``.

The compile is optional: when Cython cannot translate a module or no C compiler builds it, the
install goes on with a warning and the plain-Python module runs (the same results, ~3-4x slower
estimates, ~1.2x slower rounds; ``tangram/policy/compiled.py``). Cython itself is a build
requirement (pyproject.toml), so a normal install always has it; only ``--no-build-isolation``
without Cython skips it.

Beside the library goes ``<library>.sha256``, the digest of the sources it was translated from:
the package runs a library only while its sources (``walk.py`` and ``walk.pxd``; ``walk_arrays.pyx``;
a native module's ``.py`` and its ``.pxd``, if any, with the directives it was translated under,
``compiled.NATIVE_DIRECTIVES``) still have that digest.
The digest is taken once, just before the translation, which is forced (Cython would otherwise
reuse a C file by file times, and a source copied with an older time would be recorded under
its own digest while the old code was compiled).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

WALK = "tangram/policy/walk.py"
ARRAYS = "tangram/policy/walk_arrays.pyx"  # the same walk on C arrays (optional like it)
COMPILED = "tangram/policy/compiled.py"


def _compiled_module():
    """tangram/policy/compiled.py, loaded by its path (it imports the standard library only): the
    digest recorded here is the one it checks at import."""
    spec = importlib.util.spec_from_file_location("_tangram_compiled", Path(__file__).parent / COMPILED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_COMPILED = _compiled_module()
source_digest = _COMPILED.source_digest
# the round's modules, compiled whole under compiled.NATIVE_DIRECTIVES (part of their digest)
NATIVE = tuple(f"tangram/policy/{name}.py" for name in _COMPILED.NATIVE)


def _warn(e: BaseException, path: str = WALK) -> None:
    print(f"WARNING: arl-tangram: {path} was not compiled ({type(e).__name__}: {e}); "
          "its plain-Python source runs instead (same results, slower scheduling rounds)", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """Records, beside each library it builds, the digest of the sources it was translated from.

    The extensions are ``optional`` (setuptools' own flag): a compiler's failure is a warning and
    leaves no library, so no record. Each carries ``source_digest``, taken when it was translated."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = True  # one compiler per core: a dozen modules

    def run(self):
        self._built: set[str] = set()
        super().run()

    def build_extension(self, ext):
        super().build_extension(ext)  # a failure propagates to setuptools, which skips an optional one
        self._built.add(ext.name)
        _record(Path(self.get_ext_fullpath(ext.name)), ext)

    def copy_extensions_to_source(self):
        """An editable install builds elsewhere and copies the library into the package: the record too."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            if ext.name not in self._built:
                continue  # not built here: a library left from an earlier build must not be vouched for
            fullname = self.get_ext_fullname(ext.name)
            package_dir = build_py.get_package_dir(".".join(fullname.split(".")[:-1]))
            _record(Path(package_dir) / Path(self.get_ext_filename(fullname)).name, ext)


def _record(library: Path, ext) -> None:
    Path(str(library) + ".sha256").write_text(ext.source_digest + "\n")


def extensions(walk: str | None = WALK, arrays: str | None = ARRAYS, native=NATIVE) -> list:
    """The extensions of ``walk``, where the file is there ``arrays`` (the walk on C arrays), and
    the ``native`` modules, each translated now with ``source_digest`` (its sources' digest); none
    that cannot be. None: not that one (a benchmark builds only the modules its base has of its own)."""
    exts = []
    for path in (walk, arrays, *native):
        if path is None or (path != walk and not Path(path).exists()):
            continue  # an older tree (a benchmark's base): the modules it has
        try:
            from Cython.Build import cythonize

            directives = dict(_COMPILED.NATIVE_DIRECTIVES) if path in native else {}
            digest = source_digest(Path(path), directives)
            built = cythonize([path], language_level=3, quiet=True, force=True, compiler_directives=directives)
        except Exception as e:  # noqa: BLE001 - no Cython, or a module it cannot translate
            _warn(e, path)
            continue
        for ext in built:
            ext.optional = True  # no C compiler: setuptools warns and installs without it
            ext.source_digest = digest
        exts += built
    return exts


if __name__ == "__main__":  # setuptools' build backend runs this file as __main__; tests import it
    setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
