"""Which straggling runs the engine restarts at a wider DoP, and the restart (the decision:
tangram.policy.restart).

Looked at after a successful completion, once its round has run: a node's CPU units that nothing
waiting can use and that its trajectories in generation are not expected to ask for (their last
actions' units, unless ``expect_arrivals`` is off) are idle, and a ``restartable`` elastic run on
that node may take them by starting again (not one in a one-shot environment, which ends with
it). At most one run per node is restarted per event, the one the free units speed up most.
The engine's own helper, like ``skips``: :func:`restart_stragglers` acts on its state.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Sequence

from tangram.core.estimator import DurationEstimator
from tangram.core.records import ActionRecord, Started
from tangram.managers.base import AllocationError
from tangram.policy.restart import restart_dop
from tangram.policy.snapshot import Dispatch, PoolState

log = logging.getLogger(__name__)


def restart_stragglers(eng: Any) -> list[Started]:
    """Stop the straggling runs that idle units would end sooner and start them again wider; the
    driver stops each one's run before its new one (``Started.restart``). ``eng``: the Engine (not
    imported here: it imports this module)."""
    params = eng.params
    if params.restart_gain <= 0 or params.fixed_dop is not None:  # the fixed-DoP baseline chooses no DoP
        return []
    pools = eng.pool_states()
    runs: dict[str, list[ActionRecord]] = {}  # pool -> its restartable runs, in start order
    for aid in eng.books.restartable:
        rec = eng.running[aid]
        runs.setdefault(rec.dispatch.pools["cpu"], []).append(rec)
    # most completions: no unit left; a node marked down has no pool (its runs are failed elsewhere)
    runs = {p: recs for p, recs in runs.items() if p in pools and pools[p].free > 0}
    if not runs:
        return []
    now = eng.clock()
    try:
        chosen = straggler_restarts(
            runs, pools, wanted_nodes(eng._lanes.items(), eng.nodes(pools)),
            eng._generating.expected_cpu() if params.expect_arrivals else {}, eng.estimator, params.restart_gain, now,
            params.dop_caps)
    except Exception:  # noqa: BLE001 - a restart is an optimisation: a bug in it must not lose the round's starts
        log.exception("choosing the runs to restart failed; none restarted")
        return []
    out = []
    for rec, dop in chosen:
        old = rec.dispatch
        pname = old.pools["cpu"]
        try:  # the run keeps what it holds and takes the free units beside it (its process dies on them)
            d = Dispatch(rec.action, old.node, {**old.units, "cpu": dop}, old.pools, estimated_s=rec.action.duration(dop))
            grant = eng._owner[pname].regrant(pname, dop, rec.id, old.units["cpu"], rec.action)
        except AllocationError as exc:  # the books are unchanged: the run goes on where it is
            log.warning("action %s: not restarted at %d units: %s", rec.id, dop, exc)
            continue
        except Exception:  # noqa: BLE001 - the same, for a bug: logged, the run left as the engine knows it
            log.exception("action %s: not restarted at %d units", rec.id, dop)
            continue
        rec.restarted_s += now - rec.started_at
        rec.grants[pname] = grant
        rec.dispatch, rec.started_at, rec.estimated_end = d, now, now + d.estimated_s
        eng.books.restarted(rec.id, pname, now, rec.estimated_end, dop)
        eng._last.release(pname)
        out.append(Started(rec, d, rec.grants, restart=True))
        eng.runs_restarted += 1
    if out:
        eng._last.forget()  # held groups read these as running for their old time left
    return out


def wanted_nodes(lanes: Iterable, nodes: Iterable[str]) -> set[str]:
    """The nodes some waiting CPU action could be placed on (a lane's home, or any it may go to)."""
    nodes = tuple(nodes)
    wanted: set[str] = set()
    for lane, entries in lanes:
        if not entries or not any(rtype == "cpu" for rtype, _ in lane[2]):
            continue
        home = lane[0]
        if home is not None:
            wanted.add(home)
        else:
            wanted.update(lane[4] if len(lane) > 4 else nodes)
        if len(wanted) == len(nodes):
            break
    return wanted


def straggler_restarts(runs: Mapping[str, Sequence[ActionRecord]], pools: Mapping[str, PoolState], wanted: set[str],
                       expected: Mapping[str, int], estimator: DurationEstimator, gain: float, now: float,
                       dop_caps: Mapping[str, int] | None = None) -> list[tuple[ActionRecord, int]]:
    """``(record, new DoP)`` for the runs to restart now, of the restartable CPU ``runs`` by pool: where
    units are free on nodes no waiting action wants, keeping ``expected[node]`` units for its expected
    arrivals, and within its class's DoP cap (``PolicyParams.dop_caps``, as a round keeps it)."""
    out: list[tuple[ActionRecord, int]] = []
    for pname, recs in runs.items():
        node = pools[pname].node
        spare = pools[pname].free - expected.get(node, 0)
        if spare <= 0 or node in wanted:
            continue
        best: tuple[float, ActionRecord, int] | None = None
        for rec in recs:  # the engine's restartable runs: elastic on CPU, in an environment, started
            a = rec.action
            if not a.scalable:
                continue
            cv = estimator.t1_cv(a.action_class)
            if cv is None:
                continue
            dop = rec.dispatch.units["cpu"]
            cap = (dop_caps or {}).get(a.action_class)
            wider = a.demands["cpu"].capped(dop + spare if cap is None else min(dop + spare, max(cap, dop)))
            options = [m for m in wider.options if m > dop] if wider is not None else []
            speed = a.elasticity.efficiency
            m = restart_dop(mean_t1=a.t1_s, cv=cv, speedup=lambda k: speed(k) * k, dop=dop,
                            elapsed_s=now - rec.started_at, options=options, gain=gain)
            if m is not None:
                ratio = speed(m) * m / (speed(dop) * dop)
                if best is None or ratio > best[0]:
                    best = (ratio, rec, m)
        if best is not None:
            out.append((best[1], best[2]))
    return out
