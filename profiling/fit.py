"""Fit duration-versus-DoP models per action class (DESIGN.md §3).

Input: measured samples ``(dop, seconds, repeat)`` of one class. Output: the
single-unit duration ``T1`` and the parallel efficiency ``E(m)`` for every
feasible DoP ``m`` (``duration(m) = T1 / (E(m) * m)``, ``0 < E(m) <= 1``), or
the reason the class is *unfit* (too few or too noisy samples).

Two models compete, chosen by cross-validated relative error:

* **Amdahl**: ``T(m) = T1 * (s + (1 - s) / m)`` = ``a + b / m`` with
  ``a = T1 s >= 0`` and ``b = T1 (1 - s) >= 0``: a non-negative least-squares
  fit on the features ``[1, 1/m]`` (sklearn ``LinearRegression(positive=True)``),
  so ``s = a / (a + b)`` lies in [0, 1] by construction.
* **Isotonic**: a monotone non-increasing step/linear fit of ``T`` against
  ``m`` (sklearn ``IsotonicRegression(increasing=False)``), for suites whose
  speedup is not Amdahl-shaped (chunky test files, a plateau, a knee).

Cross-validation: with at least two samples at every DoP, leave one *repeat*
out (every fold keeps every DoP); otherwise, with at least three DoPs, leave one
*DoP* out. Error = mean of ``|predicted - measured| / measured`` over held-out
samples. Amdahl (fewer degrees of freedom) wins ties: isotonic must beat it by
``ISOTONIC_MARGIN`` (10 %); under leave-one-repeat-out a third candidate, the
per-DoP mean table, must beat the incumbent by the same margin (it is the only
one that can show a DoP slower than a smaller one). Without a DoP-1 sample only
Amdahl may be chosen: T1 is the model's value at m = 1, and only Amdahl's form
reaches there (isotonic and table would repeat the smallest measured DoP's
duration). When no cross-validation can run (two DoPs, one sample each), E
comes straight from the measured means ("table" model):
``E(m) = T(1) / (m T(m))``, clipped to (0, 1].
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

E_MIN = 1e-6  # efficiencies are clipped to [E_MIN, 1]
ISOTONIC_MARGIN = 0.9  # isotonic is chosen only if its CV error < margin * Amdahl's
DEFAULT_MAX_CV_ERROR = 1.0  # "truly unusable": predictions off by 100 % on average
MIN_DOPS = 2


@dataclass(frozen=True, slots=True)
class Sample:
    dop: int
    seconds: float
    repeat: int = 0


@dataclass(slots=True)
class FitResult:
    """A fitted class, in the profile store's vocabulary."""

    t1_s: float
    efficiency: dict[int, float]
    samples: int
    model: str  # "amdahl" | "isotonic" | "table"
    cv_error: float
    cv_method: str  # "leave-one-repeat-out" | "leave-one-dop-out" | "none (in-sample)"
    dops: list[int]
    serial_fraction: float | None = None
    candidates: dict[str, float] = field(default_factory=dict)  # model -> CV error

    def duration(self, m: int) -> float:
        return self.t1_s / (self.efficiency[m] * m)


@dataclass(frozen=True, slots=True)
class Unfit:
    reason: str
    samples: int
    dops: list[int]
    cv_error: float | None = None


# --------------------------------------------------------------------------- #
# the two models: fit on (m, T) arrays, predict T at any m


class _Amdahl:
    name = "amdahl"

    def fit(self, m: np.ndarray, t: np.ndarray) -> "_Amdahl":
        from sklearn.linear_model import LinearRegression

        x = np.column_stack([np.ones_like(m, dtype=float), 1.0 / m])
        reg = LinearRegression(positive=True, fit_intercept=False).fit(x, t)
        a, b = (float(v) for v in reg.coef_)
        if a + b <= 0:  # degenerate (all-zero durations cannot happen, but stay total)
            a, b = float(np.mean(t)), 0.0
        self.t1 = a + b
        self.s = min(max(a / self.t1, 0.0), 1.0) if self.t1 > 0 else 1.0
        return self

    def predict(self, m: np.ndarray) -> np.ndarray:
        m = np.asarray(m, dtype=float)
        return self.t1 * (self.s + (1.0 - self.s) / m)


class _Isotonic:
    name = "isotonic"

    def fit(self, m: np.ndarray, t: np.ndarray) -> "_Isotonic":
        from sklearn.isotonic import IsotonicRegression

        self.reg = IsotonicRegression(increasing=False, out_of_bounds="clip").fit(m.astype(float), t)
        return self

    def predict(self, m: np.ndarray) -> np.ndarray:
        return self.reg.predict(np.asarray(m, dtype=float))


class _Table:
    """Per-DoP means, linear in between: the most flexible model (it can rise with m).

    A monotone model cannot show "DoP 2 is slower than DoP 1" (start-up costs,
    a busy machine); the table can, and is chosen only when it beats both by
    the margin, and only under leave-one-repeat-out (it cannot extrapolate).
    """

    name = "table"

    def fit(self, m: np.ndarray, t: np.ndarray) -> "_Table":
        self.d = np.unique(m)
        self.mean = np.array([t[m == d].mean() for d in self.d])
        return self

    def predict(self, m: np.ndarray) -> np.ndarray:
        return np.interp(np.asarray(m, dtype=float), self.d, self.mean)


_MODELS = (_Amdahl, _Isotonic, _Table)
_BY_NAME = {cls.name: cls for cls in _MODELS}


# --------------------------------------------------------------------------- #


def _rel_err(pred: np.ndarray, true: np.ndarray) -> np.ndarray:
    return np.abs(pred - true) / true


def _cv_folds(m: np.ndarray, rep: np.ndarray) -> tuple[str, list[np.ndarray]] | None:
    """Boolean test masks: leave-one-repeat-out, else leave-one-DoP-out, else None."""
    dops = np.unique(m)
    counts = {d: int(np.sum(m == d)) for d in dops}
    if min(counts.values()) >= 2:
        # group the samples of each DoP by their rank among that DoP's repeats, so
        # missing or renumbered repeats still give folds that keep every DoP
        rank = np.empty(len(m), dtype=int)
        for d in dops:
            idx = np.flatnonzero(m == d)
            order = idx[np.argsort(rep[idx], kind="stable")]
            rank[order] = np.arange(len(order))
        groups = np.unique(rank)
        folds = [rank == g for g in groups]
        # a fold that would empty a DoP from training (only with 1 sample there) is impossible here
        return "leave-one-repeat-out", folds
    if len(dops) >= 3:
        return "leave-one-dop-out", [m == d for d in dops]
    return None


def cross_validate(model_cls, m: np.ndarray, t: np.ndarray, folds: Sequence[np.ndarray]) -> float:
    errs = []
    for test in folds:
        train = ~test
        if len(np.unique(m[train])) < 2:
            continue
        model = model_cls().fit(m[train], t[train])
        errs.append(_rel_err(model.predict(m[test]), t[test]))
    if not errs:
        return math.inf
    return float(np.mean(np.concatenate(errs)))


def _efficiency_from(t1: float, predict, feasible: Iterable[int]) -> dict[int, float]:
    out: dict[int, float] = {}
    for mm in feasible:
        tm = float(predict(np.array([mm]))[0])
        e = t1 / (mm * tm) if tm > 0 else 1.0
        out[int(mm)] = float(min(max(e, E_MIN), 1.0))
    out[1] = 1.0
    return dict(sorted(out.items()))


def fit_class(
    samples: Iterable[Sample | tuple],
    *,
    feasible: Iterable[int] | None = None,
    max_cv_error: float = DEFAULT_MAX_CV_ERROR,
    min_samples_cv: int = 3,
) -> FitResult | Unfit:
    """Fit one class; ``feasible`` DoPs default to 1..max measured DoP."""
    ss = [s if isinstance(s, Sample) else Sample(*s) for s in samples]
    ss = [s for s in ss if s.seconds > 0 and s.dop >= 1 and math.isfinite(s.seconds)]
    n = len(ss)
    dops = sorted({s.dop for s in ss})
    if len(dops) < MIN_DOPS:
        return Unfit(f"needs samples at >= {MIN_DOPS} distinct DoPs, got {len(dops)} ({n} samples)", n, dops)
    m = np.array([s.dop for s in ss], dtype=float)
    t = np.array([s.seconds for s in ss], dtype=float)
    rep = np.array([s.repeat for s in ss], dtype=int)
    feas = sorted({int(x) for x in (feasible if feasible is not None else range(1, max(dops) + 1))} | {1})

    cv = _cv_folds(m, rep) if n >= min_samples_cv else None
    if cv is None:
        return _table_fit(m, t, dops, feas, n, max_cv_error)
    method, folds = cv
    models = _MODELS if method == "leave-one-repeat-out" else (_Amdahl, _Isotonic)
    if 1 not in dops:
        # T1 is read off the model at m = 1: isotonic and table would repeat the smallest measured
        # DoP's duration there (T1 = T(2), E(2) = 0.5); only Amdahl reaches m = 1 by its form
        models = (_Amdahl,)
    errors = {cls.name: cross_validate(cls, m, t, folds) for cls in models}
    best = "amdahl"  # simplest first; a more flexible model must beat the incumbent by the margin
    for name in ("isotonic", "table"):
        if name in errors and errors[name] + 1e-9 < ISOTONIC_MARGIN * errors[best]:
            best = name
    err = errors[best]
    if not math.isfinite(err):
        return _table_fit(m, t, dops, feas, n, max_cv_error)
    if err > max_cv_error:
        if 1 not in dops:
            return Unfit(f"no DoP-1 sample, and amdahl (the only model that extrapolates to DoP 1) does not fit: "
                         f"cross-validated relative error {err:.3f} > {max_cv_error}", n, dops, err)
        return Unfit(f"too noisy: {best} cross-validated relative error {err:.3f} > {max_cv_error}", n, dops, err)
    model = _BY_NAME[best]().fit(m, t)
    t1 = float(model.predict(np.array([1.0]))[0])
    if not t1 > 0:
        return Unfit(f"{best} fit gives a non-positive T1 ({t1})", n, dops, err)
    res = FitResult(
        t1_s=t1,
        efficiency=_efficiency_from(t1, model.predict, feas),
        samples=n,
        model=best,
        cv_error=err,
        cv_method=method,
        dops=dops,
        candidates={k: (v if math.isfinite(v) else None) for k, v in errors.items()},
    )
    if best == "amdahl":
        res.serial_fraction = float(model.s)
    return res


def _table_fit(m, t, dops, feas, n, max_cv_error) -> FitResult | Unfit:
    """Direct table from per-DoP means: E(m) = T(1) / (m T(m)), clipped to (0, 1]."""
    if 1 not in dops:
        return Unfit("too few samples to cross-validate a model, and no DoP-1 sample for a direct table", n, dops)
    means = {d: float(np.mean(t[m == d])) for d in dops}
    t1 = means[1]
    measured = {d: float(min(max(t1 / (d * means[d]), E_MIN), 1.0)) for d in dops}
    measured[1] = 1.0
    from tangram.core.model import Elasticity

    el = Elasticity.from_table(measured)  # speedup interpolated between measured DoPs
    eff = {d: float(min(max(el.efficiency(d), E_MIN), 1.0)) for d in feas}
    eff.update(measured)
    eff = dict(sorted(eff.items()))
    # in-sample spread around the means (0 with one sample per DoP)
    err = float(np.mean(_rel_err(np.array([means[int(x)] for x in m]), t)))
    if err > max_cv_error:
        return Unfit(f"too noisy: in-sample relative error {err:.3f} > {max_cv_error}", n, dops, err)
    return FitResult(t1_s=t1, efficiency=eff, samples=n, model="table", cv_error=err,
                     cv_method="none (in-sample)", dops=list(dops))


def summarize(samples: Iterable[Sample]) -> dict[int, dict[str, float]]:
    """Per-DoP mean, std, min, max and count (for the store and the report)."""
    by: dict[int, list[float]] = defaultdict(list)
    for s in samples:
        by[s.dop].append(s.seconds)
    out = {}
    for d in sorted(by):
        x = np.array(by[d])
        out[d] = {"mean": float(x.mean()), "std": float(x.std(ddof=1)) if len(x) > 1 else 0.0,
                  "min": float(x.min()), "max": float(x.max()), "n": int(len(x))}
    return out
