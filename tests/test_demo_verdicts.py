"""The demo's numbers are honest about noise: verdicts need a spread, failures are shown for every
policy, a run with no value is said, a Ray action's timeout is a failed action, not a dead demo."""
from __future__ import annotations

import asyncio
import io
import time
from types import SimpleNamespace

import pytest

from tangram.demo.results import compare, percentile, policy_entry, verdict

pytestmark = pytest.mark.timeout(120)


def _run(mean, p99, step, failed=0, **extra):
    return {"actions": 4, "mean_act_s": mean, "p50_act_s": mean, "p99_act_s": p99, "step_time_s": step,
            "failed": failed, **extra}


def _console():
    from rich.console import Console

    buf = io.StringIO()
    return Console(file=buf, width=250, force_terminal=False, color_system=None), buf


def test_one_run_gives_no_verdict():
    r = compare({"tangram": policy_entry([_run(1.0, 2.0, 10.0)]), "b": policy_entry([_run(3.0, 9.0, 30.0)])},
                "tangram")["b"]
    assert set(r["verdict"].values()) == {"one run"} and r["runs"] == [1, 1]
    text = verdict("b", r)
    assert "better" not in text and "worse" not in text and "one run, no spread" in text


def test_better_or_worse_only_when_the_spreads_do_not_overlap():
    ref = policy_entry([_run(1.0, 4.0, 10.0), _run(1.2, 4.4, 11.0)])
    r = compare({"tangram": ref, "a": policy_entry([_run(1.1, 4.2, 10.5), _run(1.5, 4.8, 12.0)]),
                 "b": policy_entry([_run(3.0, 9.0, 20.0), _run(3.3, 9.9, 22.0)]),
                 "c": policy_entry([_run(0.5, 1.0, 5.0), _run(0.6, 1.1, 6.0)])}, "tangram")
    assert r["a"]["verdict"]["mean_act"] == "within noise" and "within noise" in verdict("a", r["a"])
    assert set(r["b"]["verdict"].values()) == {"better"} and "tangram better" in verdict("b", r["b"])
    assert set(r["c"]["verdict"].values()) == {"worse"} and "tangram worse" in verdict("c", r["c"])


def test_equal_is_equal_and_a_ratio_rounding_to_1_keeps_its_side():
    same = [_run(1.0, 4.0, 10.0), _run(1.2, 4.4, 11.0)]
    r = compare({"tangram": policy_entry(same), "twin": policy_entry(same)}, "tangram")["twin"]
    assert set(r["verdict"].values()) == {"equal"} and "worse" not in verdict("twin", r)
    # baseline a hair slower in every run: its ratio rounds to 1.0, yet tangram is the lower one
    ref = policy_entry([_run(1.0000, 4.0, 10.0), _run(1.0001, 4.0001, 10.0001)])
    hair = policy_entry([_run(1.0003, 4.0003, 10.0003), _run(1.0004, 4.0004, 10.0004)])
    r = compare({"tangram": ref, "hair": hair}, "tangram")["hair"]
    assert r["mean_act"] == 1.0 and r["verdict"]["mean_act"] == "better"
    assert "tangram worse" not in verdict("hair", r)


def test_a_field_missing_in_some_runs_is_the_median_of_the_others():
    k = "smollm2_mean_value"
    for runs in ([_run(1, 2, 3, **{k: -1.5}), _run(1, 2, 3, **{k: None})],
                 [_run(1, 2, 3, **{k: None}), _run(1, 2, 3, **{k: -1.5})]):
        e = policy_entry(runs)
        assert e[k] == -1.5 and e["runs_without"] == {k: 1}
    e = policy_entry([_run(1, 2, 3, **{k: None})])
    assert e[k] is None and e["runs_without"] == {k: 1}
    assert "runs_without" not in policy_entry([_run(1, 2, 3, **{k: -1.0})])


def test_percentile_is_the_runtimes_nearest_rank():
    from tangram.runtime.stats import percentile as runtime_percentile

    xs = [6.0, 1.0, 5.0, 2.0, 4.0, 3.0]
    assert percentile(xs, 50) == 3.0 == runtime_percentile(sorted(xs), 50)  # round-half-even gave 4.0
    assert percentile(xs, 99) == 6.0 and percentile([], 50) == 0.0


def test_workload_table_shows_spread_failures_and_what_each_column_is():
    from tangram.demo.results import document
    from tangram.demo.workload_cli import _table, failures

    pols = {"tangram": policy_entry([_run(1.0, 2.0, 10.0, searches=4), _run(1.1, 2.2, 11.0, searches=4)],
                                    summed=("searches",)),
            "naive": policy_entry([_run(0.5, 1.0, 8.0, failed=1, searches=4, gave_up=1),
                                   _run(0.6, 1.1, 9.0, failed=2, searches=4, gave_up=1)],
                                  summed=("searches", "gave_up"))}
    doc = document("deepsearch", pols, reference="tangram")
    con, buf = _console()
    _table(con, "T", doc, [("gave up (sum)", "gave_up", "{}")], "searches")
    out = buf.getvalue()
    assert "medians of 2 runs [min..max]" in out and "1.050 [1.000..1.100]" in out
    assert "failed (sum)" in out and "3 of 8" in out and "0 of 8" in out
    assert "failed action's ACT" in out and "(sum): summed over the runs" in out
    lines, error = failures(doc)
    assert lines == ["naive: 3 actions failed (2 gave up on a 429 after its retries); their ACTs are in its means"]
    assert error  # the third failure is not a give-up
    pols["naive"]["gave_up"] = 3
    assert failures(doc)[1] is False  # a naive caller giving up is what it is built to do: warned, not an error
    pols["tangram"]["failed"] = pols["tangram"]["gave_up"] = 1
    assert failures(doc)[1] is True and failures(doc)[0][0].startswith("tangram: 1 actions failed;")


def test_coding_table_has_a_failed_column():
    from tangram.demo.report import print_table

    base = {"mean_queue_s": 0.1, "core_utilisation": 0.5}
    pols = {"tangram": policy_entry([{**_run(1.0, 2.0, 10.0), **base}]),
            "trajectory": policy_entry([{**_run(1.0, 2.0, 12.0, failed=2), **base}])}
    con, buf = _console()
    print_table(con, pols, compare(pols, "tangram"))
    out = buf.getvalue()
    assert "failed (sum)" in out and "2 of 4" in out and "one run per policy" in out
    assert "tangram better" not in out


def test_deepsearch_and_mopd_default_to_three_runs(monkeypatch):
    import tangram.demo.workload_cli as wc
    from tangram.cli import build_parser

    seen = []
    monkeypatch.setattr(wc, "run_workload", lambda args: seen.append(args.repeats) or 0)
    for workload in ("deepsearch", "mopd"):
        args = build_parser().parse_args(["demo", "--workload", workload])
        assert args.func(args) == 0
    assert seen == [3, 3]


def test_a_ray_action_past_its_limit_fails_instead_of_raising(tmp_path):
    from tangram.demo.ray_tasks import _make_task

    run_action = _make_task(SimpleNamespace(remote=lambda f: f))
    t = time.perf_counter()
    rc, _, err = run_action(str(tmp_path), "sleep 30", 1, 0.3)
    assert rc == 124 and "timed out" in err and time.perf_counter() - t < 10


def test_a_failed_ray_task_is_a_failed_action(tmp_path):
    from tangram.demo.ray_tasks import RayTasks
    from tangram.demo.rollout import RolloutSpec, copy_command

    class Task:
        def options(self, **_):
            return self

        async def _ok(self):
            return 0, 0.0, ""

        def remote(self, cwd, cmd, dop, *rest):
            if cmd == copy_command():
                return self._ok()
            raise RuntimeError("worker died")  # as a Ray task error surfaces

    ray = object.__new__(RayTasks)
    ray.task, ray.reward_dop = Task(), 1
    r = asyncio.run(ray.run(RolloutSpec(trajectories=1, turns=1, gap_s=0.0, cores=1, pod_cores=1),
                            tmp_path / "w", lambda: None))
    assert [s.ok for s in r.samples] == [False, False] and r.rewards == [0.0]
