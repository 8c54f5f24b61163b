"""The JSON profile store written by the profiling pipeline.

Format (version 1)::

    {"version": 1,
     "classes": {"pytest-repo-x": {"t1_s": 12.5,
                                   "efficiency": {"1": 1.0, "2": 0.9, "4": 0.7},
                                   "samples": 20,
                                   "max_dop": 8}}}        # max_dop optional

``load_profiles`` turns it into ``{class name: Profile}``; every error names
the offending path inside the file (``classes.NAME.t1_s``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from tangram.core.errors import DemandError, FieldError
from tangram.core.model import Elasticity, Profile

SUPPORTED_VERSIONS = (1,)


class ProfileStoreError(FieldError):
    """A profile store file that cannot be used (``field`` is the path inside it)."""


def load_profiles(path: str | Path) -> dict[str, Profile]:
    """Read one profile store file."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as exc:
        raise ProfileStoreError(str(p), f"cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ProfileStoreError(str(p), f"not valid JSON: {exc}") from None
    return parse_profiles(doc)


def parse_profiles(doc: Any) -> dict[str, Profile]:
    if not isinstance(doc, Mapping):
        raise ProfileStoreError("<root>", "must be an object")
    version = doc.get("version")
    if version not in SUPPORTED_VERSIONS:
        raise ProfileStoreError("version", f"unsupported profile store version {version!r} (expected 1)")
    classes = doc.get("classes")
    if not isinstance(classes, Mapping):
        raise ProfileStoreError("classes", "must be an object mapping class names to profiles")
    return {str(name): parse_entry(entry, f"classes.{name}") for name, entry in classes.items()}


def parse_entry(entry: Any, where: str = "entry") -> Profile:
    """One class of a store as a :class:`Profile` (the one reader of an entry, for the service and profiling)."""
    if not isinstance(entry, Mapping):
        raise ProfileStoreError(where, "must be an object")
    t1 = entry.get("t1_s")
    if isinstance(t1, bool) or not isinstance(t1, (int, float)) or not (t1 > 0) or math.isinf(t1):
        raise ProfileStoreError(f"{where}.t1_s", f"must be a positive finite number, got {t1!r}")
    elasticity = None
    eff = entry.get("efficiency")
    if eff is not None:
        if not isinstance(eff, Mapping):
            raise ProfileStoreError(f"{where}.efficiency", "must be an object {dop: E(dop)}")
        try:
            elasticity = Elasticity.from_table(eff, field=f"{where}.efficiency")
        except DemandError as exc:
            raise ProfileStoreError(exc.field, exc.reason) from None
        except (TypeError, ValueError) as exc:
            raise ProfileStoreError(f"{where}.efficiency", str(exc)) from None
    max_dop = entry.get("max_dop")
    if max_dop is not None and (isinstance(max_dop, bool) or not isinstance(max_dop, int) or max_dop < 1):
        raise ProfileStoreError(f"{where}.max_dop", f"must be a positive integer, got {max_dop!r}")
    return Profile(t1_s=float(t1), elasticity=elasticity, max_dop=max_dop)
