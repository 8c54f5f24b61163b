"""Duration and count distributions of a workload (parsed from YAML).

Accepted forms (``field`` names the YAML path in errors)::

    3.5                                        # fixed
    {dist: fixed, value: 3.5}
    {dist: lognormal, mean: 2.0, cv: 1.5}      # mean and coefficient of variation
    {dist: uniform, low: 1, high: 4}
    ... plus optional {min: x, max: y} clipping on any of them.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from tangram.core.fields import Fields
from tangram.simulator.errors import WorkloadError


@dataclass(frozen=True, slots=True)
class Dist:
    kind: str
    a: float  # fixed: value; lognormal: mu; uniform: low
    b: float = 0.0  # lognormal: sigma; uniform: high
    lo: float = 0.0
    hi: float = math.inf
    mean: float = 0.0

    def draw(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "lognormal":
            x = rng.lognormvariate(self.a, self.b) if self.b > 0 else math.exp(self.a)
        else:
            x = rng.uniform(self.a, self.b)
        return min(max(x, self.lo), self.hi)

    def draw_int(self, rng: random.Random) -> int:
        return max(int(round(self.draw(rng))), int(max(self.lo, 0)))


_FIELDS = Fields(WorkloadError)


def _num(raw: Any, field: str, *, positive: bool = False, allow_zero: bool = True) -> float:
    """A finite number; with ``positive``, ``>= 0`` (or ``> 0`` without ``allow_zero``)."""
    if not positive:
        return _FIELDS.number(raw, field)
    return _FIELDS.number(raw, field, lo=0.0) if allow_zero else _FIELDS.number(raw, field, above=0.0)


def parse_dist(raw: Any, field: str, *, allow_zero: bool = True) -> Dist:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        v = _num(raw, field, positive=True, allow_zero=allow_zero)
        return Dist("fixed", v, mean=v, lo=0.0)
    if not isinstance(raw, dict):
        raise WorkloadError(field, f"expected a number or a mapping with 'dist', got {type(raw).__name__}")
    kind = raw.get("dist", "fixed" if "value" in raw else None)
    known = {"dist", "value", "mean", "cv", "low", "high", "min", "max", "source"}
    unknown = set(raw) - known
    if unknown:
        raise WorkloadError(field, f"unknown keys {sorted(unknown)}")
    lo = _num(raw.get("min", 0.0), f"{field}.min", positive=True)
    hi = _num(raw["max"], f"{field}.max", positive=True) if "max" in raw else math.inf
    if hi < lo:
        raise WorkloadError(f"{field}.max", f"must be >= min ({lo}), got {hi}")
    if kind == "fixed":
        if "value" not in raw:
            raise WorkloadError(f"{field}.value", "is required for dist: fixed")
        v = _num(raw["value"], f"{field}.value", positive=True, allow_zero=allow_zero)
        return Dist("fixed", v, lo=lo, hi=hi, mean=v)
    if kind == "lognormal":
        for k in ("mean", "cv"):
            if k not in raw:
                raise WorkloadError(f"{field}.{k}", "is required for dist: lognormal")
        mean = _num(raw["mean"], f"{field}.mean", positive=True, allow_zero=False)
        cv = _num(raw["cv"], f"{field}.cv", positive=True)
        sigma2 = math.log(1.0 + cv * cv)
        return Dist("lognormal", math.log(mean) - sigma2 / 2, math.sqrt(sigma2), lo=lo, hi=hi, mean=mean)
    if kind == "uniform":
        for k in ("low", "high"):
            if k not in raw:
                raise WorkloadError(f"{field}.{k}", "is required for dist: uniform")
        a = _num(raw["low"], f"{field}.low", positive=True)
        b = _num(raw["high"], f"{field}.high", positive=True)
        if b < a:
            raise WorkloadError(f"{field}.high", f"must be >= low ({a}), got {b}")
        return Dist("uniform", a, b, lo=lo, hi=hi, mean=(a + b) / 2)
    raise WorkloadError(f"{field}.dist", f"unknown distribution {kind!r} (expected fixed, lognormal or uniform)")
