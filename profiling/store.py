"""The versioned profile store: calibrated classes as one JSON file.

Format (version 1; the keys ``t1_s``, ``efficiency`` and ``samples`` are the
contract with the service's loader, ``tangram/profiles.py``)::

    {
      "version": 1,
      "created": "2026-11-30T05:40:00+00:00",
      "classes": {
        "NAME": {
          "t1_s": 12.3,                                # single-unit duration, seconds
          "efficiency": {"1": 1.0, "2": 0.93, ...},     # E(m) in (0, 1], every feasible m
          "samples": 12,                               # measured samples behind the fit
          "model": "amdahl" | "isotonic" | "table",
          "serial_fraction": 0.07,                     # Amdahl only
          "cv_error": 0.02, "cv_method": "leave-one-repeat-out",
          "dops": [1, 2],                              # measured DoPs
          "measured": {"1": [12.1, 12.5], "2": [...]}, # raw seconds per DoP (for the report)
          "command": "...", "updated": iso             # provenance (optional)
        }
      },
      "unfit": {"NAME": {"reason": "...", "samples": 2, "dops": [1]}}
    }

A class is in ``classes`` or in ``unfit``, never both. Readers ignore keys they
do not know; a file with a newer ``version`` is refused rather than misread.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping

from tangram.core.atomic_file import replace_atomically
from tangram.profiles import ProfileStoreError, parse_entry

STORE_VERSION = 1


class StoreError(ValueError):
    """A profile store that cannot be read: bad JSON, bad version, bad entry."""


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


@dataclass(slots=True)
class ProfileStore:
    classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    unfit: dict[str, dict[str, Any]] = field(default_factory=dict)
    created: str = field(default_factory=now_iso)
    version: int = STORE_VERSION

    # -- (de)serialisation ------------------------------------------------- #

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "created": self.created,
                "classes": dict(sorted(self.classes.items())), "unfit": dict(sorted(self.unfit.items()))}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "profile store") -> "ProfileStore":
        if not isinstance(data, Mapping):
            raise StoreError(f"{source}: expected a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise StoreError(f"{source}: 'version' must be an integer, got {version!r}")
        if version > STORE_VERSION or version < 1:
            raise StoreError(f"{source}: unsupported version {version} (this reader knows 1..{STORE_VERSION})")
        classes = data.get("classes", {})
        unfit = data.get("unfit", {}) or {}
        if not isinstance(classes, Mapping) or not isinstance(unfit, Mapping):
            raise StoreError(f"{source}: 'classes' and 'unfit' must be objects")
        for name, entry in classes.items():
            validate_entry(entry, where=f"{source}: classes[{name!r}]")
        for name, info in unfit.items():
            if not isinstance(info, Mapping):
                raise StoreError(f"{source}: unfit[{name!r}]: must be an object, got {type(info).__name__}")
        return cls(classes={k: dict(v) for k, v in classes.items()}, unfit={k: dict(v) for k, v in unfit.items()},
                   created=str(data.get("created") or now_iso()), version=STORE_VERSION)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ProfileStore":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as exc:
            raise StoreError(f"{path}: not valid JSON: {exc}") from None
        except UnicodeDecodeError as exc:
            raise StoreError(f"{path}: not UTF-8 text: {exc}") from None
        return cls.from_dict(data, source=str(path))

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (``tangram.core.atomic_file``): a reader never sees half a store.

        The file keeps its permissions (a private 0600 would hide a shared store from the service
        reading it); a new one gets 0644 less the umask.
        """
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"
        replace_atomically(path, lambda fh: fh.write(text.encode("utf-8")), new_mode=0o644)

    # -- edits --------------------------------------------------------------- #

    def put(self, name: str, entry: Mapping[str, Any]) -> None:
        validate_entry(entry, where=f"classes[{name!r}]")
        self.classes[name] = dict(entry)
        self.unfit.pop(name, None)

    def put_unfit(self, name: str, reason: str, **info: Any) -> None:
        self.unfit[name] = {"reason": reason, **info}
        self.classes.pop(name, None)

    def merge(self, other: "ProfileStore") -> "ProfileStore":
        """``other`` wins class by class (a newer sweep replaces an older one).

        A class that ``other`` reports unfit does *not* erase a fitted entry
        here: a failed re-calibration keeps the last good profile, and the
        reason is kept under ``unfit`` only if the class had no fit at all.
        """
        out = ProfileStore(classes=dict(self.classes), unfit=dict(self.unfit), created=self.created)
        for name, entry in other.classes.items():
            out.put(name, entry)
        for name, info in other.unfit.items():
            if name not in out.classes:
                out.unfit[name] = dict(info)
        return out

    def profile(self, name: str):
        return profile_from_entry(self.classes[name])


def validate_entry(entry: Any, *, where: str = "entry") -> None:
    """An entry the service can load (:func:`tangram.profiles.parse_entry`) with what profiling adds."""
    try:
        parse_entry(entry, where)
    except ProfileStoreError as exc:
        raise StoreError(str(exc)) from None
    if not entry.get("efficiency"):
        raise StoreError(f"{where}.efficiency: must be a non-empty object mapping DoP to E(m)")
    n = entry.get("samples")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise StoreError(f"{where}.samples: must be a non-negative integer, got {n!r}")


def entry_from_fit(fit, *, measured: Mapping[int, list[float]] | None = None, **extra: Any) -> dict[str, Any]:
    """A store entry from a :class:`profiling.fit.FitResult`."""
    e: dict[str, Any] = {
        "t1_s": float(fit.t1_s),
        "efficiency": {str(m): float(v) for m, v in sorted(fit.efficiency.items())},
        "samples": int(fit.samples),
        "model": fit.model,
    }
    if fit.serial_fraction is not None:
        e["serial_fraction"] = float(fit.serial_fraction)
    e["cv_error"] = float(fit.cv_error)
    e["cv_method"] = fit.cv_method
    if fit.candidates:
        e["cv_candidates"] = dict(fit.candidates)
    e["dops"] = [int(d) for d in fit.dops]
    if measured is not None:
        e["measured"] = {str(d): [float(x) for x in xs] for d, xs in sorted(measured.items())}
    e["updated"] = now_iso()
    e.update(extra)
    return e


def profile_from_entry(entry: Mapping[str, Any], *, max_dop: int | None = None):
    """The :class:`tangram.core.model.Profile` of a store entry (E as a table); ``max_dop`` given
    overrides the entry's own (kept otherwise, as the service reads it)."""
    validate_entry(entry)
    prof = parse_entry(entry)
    return prof if max_dop is None else dataclasses.replace(prof, max_dop=max_dop)


def refine(store: ProfileStore, estimator, *, min_observations: int | None = None) -> dict[str, tuple[float, float]]:
    """Write the estimator's online-refined ``T1`` back into the store.

    ``estimator`` is a :class:`tangram.core.estimator.DurationEstimator` whose
    ``refined_t1(class)`` averages ``T(m) * E(m) * m`` over observed runs.
    Returns ``{class: (old_t1, new_t1)}`` for the classes that changed; each
    refined entry records where its T1 came from under ``t1_refined``. A class
    whose observed ``T1`` is within the estimator's margin of the stored one
    (``DurationEstimator.t1_differs``) is left as it is.
    """
    changed: dict[str, tuple[float, float]] = {}
    for name, entry in store.classes.items():
        t1 = estimator.refined_t1(name)
        if t1 is None or not (t1 > 0) or math.isinf(t1):
            continue
        obs = estimator.samples(name)
        # as many runs as the engine needs before it refines (its refine_after) unless told
        if obs < (min_observations if min_observations is not None else estimator.refine_after):
            continue
        old = float(entry["t1_s"])
        if not estimator.t1_differs(name, old):
            continue  # within the runs' own noise: the stored profile stands (as the engine keeps it)
        entry["t1_s"] = float(t1)
        entry["t1_refined"] = {"from_t1_s": old, "observations": int(obs), "at": now_iso()}
        changed[name] = (old, float(t1))
    return changed
