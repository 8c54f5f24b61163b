"""Basic manager (API pools): concurrency slots, sliding and fixed quota
windows, next_wakeup, books and errors, on a virtual clock; plus the small
asyncio driver loop the executor tests share (submit, run Started, complete,
respect next_wakeup)."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import pytest

from tangram.core.engine import Engine, Started
from tangram.core.model import Action
from tangram.managers.base import AllocationError
from tangram.managers.basic import ADAPTIVE_MARGIN_S, ApiLimit, BasicManager


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


async def drive(engine: Engine, actions: list[Action],
                run: Callable[[Started], Awaitable[str]], *, deadline_s: float = 60.0) -> dict[str, str]:
    """Submit every action, run what starts, complete it, repeat; sleep until
    ``engine.next_wakeup()`` when nothing runs. Returns id -> final status."""
    tasks: dict[asyncio.Task, Started] = {}
    statuses: dict[str, str] = {}

    def launch(started: list[Started]) -> None:
        for s in started:
            tasks[asyncio.ensure_future(run(s))] = s

    for a in actions:
        launch(engine.submit(a))
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while engine.waiting or engine.running:
        assert loop.time() < end, "driver deadline"
        wake = engine.next_wakeup()
        timeout = None if wake is None else max(wake - engine.clock(), 0.0) + 1e-3
        if tasks:
            done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        else:
            assert timeout is not None, f"stuck: {len(engine.waiting)} waiting, nothing runs, no wakeup"
            await asyncio.sleep(timeout)
            done = set()
        for t in done:
            s = tasks.pop(t)
            status = t.result()
            statuses[s.action.id] = status
            launch(engine.complete(s.action.id, status))
        if not done:
            launch(engine.tick())
    return statuses


def api_action(i: int, name: str = "svc", units: int = 1, **payload) -> Action:
    return Action.build(f"a{i}", {f"api:{name}": units}, payload=payload)


# ---------------------------------------------------------------------- #
# configuration errors name the field and the reason

@pytest.mark.parametrize("limits, field", [
    ({"svc": {}}, "limits['svc']: needs a concurrency limit"),          # no limit at all
    ({"svc": {"concurrency": 0}}, "limits['svc'].concurrency"),          # non-positive
    ({"svc": {"quota": 5}}, "limits['svc'].period_s"),                   # quota without period
    ({"svc": {"quota": 5, "period_s": 0}}, "limits['svc'].period_s"),    # zero period
    ({"svc": {"concurrency": 2, "period_s": 1.0}}, "limits['svc'].period_s"),  # period without quota
    ({"svc": {"quota": 5, "period_s": 1, "window": "tumbling"}}, "limits['svc'].window"),
    ({"svc": {"conc": 2}}, "limits['svc']: unknown keys ['conc']"),
    ({"svc": 3}, "limits['svc']: expected an ApiLimit"),
    ({"svc": {"quota": 5, "period_s": 1, "arrival_margin_s": -1}}, "limits['svc'].arrival_margin_s"),
    ({"svc": {"quota": 5, "period_s": 1, "arrival_margin_s": float("inf")}}, "limits['svc'].arrival_margin_s"),
    ({"svc": {"quota": 5, "period_s": 1, "books": "optimistic"}}, "limits['svc'].books"),
    ({"svc": {"concurrency": 5, "books": "conservative"}}, "limits['svc'].books"),  # no quota to keep books of
    ({"svc": {"quota": 5, "period_s": 1, "arrival_margin_s": 0.1, "books": "conservative"}}, "limits['svc'].books"),
])
def test_bad_config_names_field(limits, field):
    with pytest.raises(ValueError) as e:
        BasicManager(limits)
    assert field in str(e.value)


def test_pool_names_accept_prefix_and_reject_duplicates():
    m = BasicManager({"a": ApiLimit(concurrency=1), "api:b": {"concurrency": 2}})
    assert sorted(p.name for p in m.pool_states()) == ["api:a", "api:b"]
    with pytest.raises(ValueError, match="configured twice"):
        BasicManager({"a": {"concurrency": 1}, "api:a": {"concurrency": 1}})


# ---------------------------------------------------------------------- #
# concurrency

def test_concurrency_slots_and_idempotent_release():
    clock = Clock()
    m = BasicManager({"svc": {"concurrency": 3}}, clock=clock)
    (p,) = m.pool_states()
    assert (p.capacity, p.free, p.node) == (3, 3, None)
    assert m.allocate("api:svc", 2, "x") == 2
    assert next(iter(m.pool_states())).free == 1
    with pytest.raises(AllocationError, match="2 units requested, 1 free"):
        m.allocate("api:svc", 2, "y")
    with pytest.raises(AllocationError, match="already holds"):
        m.allocate("api:svc", 1, "x")
    with pytest.raises(AllocationError, match="unknown pool"):
        m.allocate("api:nope", 1, "z")
    assert m.held() == {"api:svc": {"x": 2}}
    assert m.release("api:svc", "x") is True
    assert m.release("api:svc", "x") is False  # idempotent
    assert m.release("api:nope", "x") is False
    assert next(iter(m.pool_states())).free == 3
    assert m.next_wakeup(clock()) is None  # concurrency alone never refills on its own
    m.check_invariants()


# ---------------------------------------------------------------------- #
# quotas

def test_sliding_quota_refills_per_grant():
    clock = Clock(10.0)
    m = BasicManager({"svc": {"quota": 3, "period_s": 1.0}}, clock=clock)
    for i, t in enumerate((10.0, 10.2, 10.5)):
        clock.t = t
        m.allocate("api:svc", 1, f"h{i}")
        m.release("api:svc", f"h{i}")  # release does not give quota back
    assert next(iter(m.pool_states())).free == 0
    assert m.next_wakeup(clock()) == pytest.approx(11.0)  # the first grant leaves its window
    clock.t = 10.999
    assert next(iter(m.pool_states())).free == 0
    clock.t = 11.0
    assert next(iter(m.pool_states())).free == 1
    assert m.next_wakeup(clock()) == pytest.approx(11.2)
    clock.t = 11.6
    assert next(iter(m.pool_states())).free == 3
    assert m.next_wakeup(clock()) is None
    m.check_invariants()


def test_fixed_window_refills_whole_quota_at_boundary():
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 2, "period_s": 1.0, "window": "fixed"}}, clock=clock)
    clock.t = 0.9
    m.allocate("api:svc", 2, "a")
    clock.t = 0.95
    m.release("api:svc", "a")  # answered: it surely arrived in this window
    assert next(iter(m.pool_states())).free == 0
    assert m.next_wakeup(clock()) == pytest.approx(1.0)
    clock.t = 1.0  # new window: everything back though the grant was only 0.1 s ago
    assert next(iter(m.pool_states())).free == 2
    clock.t = 3.5
    m.allocate("api:svc", 1, "b")
    assert m.next_wakeup(clock()) == pytest.approx(4.0)  # windows stay aligned to the origin
    m.check_invariants()


def test_sliding_unit_counts_until_a_period_after_the_answer():
    # the upstream may receive the call as late as its answer: the window runs from there
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 1, "period_s": 1.0, "books": "conservative"}}, clock=clock)
    m.allocate("api:svc", 1, "a")
    clock.t = 3.0  # a slow call: still in flight three periods later
    assert next(iter(m.pool_states())).free == 0
    assert m.next_wakeup(clock()) is None  # only the answer can start the countdown
    clock.t = 3.5
    m.release("api:svc", "a")
    assert m.next_wakeup(clock()) == pytest.approx(4.5)
    clock.t = 4.49
    assert next(iter(m.pool_states())).free == 0
    clock.t = 4.5
    assert next(iter(m.pool_states())).free == 1
    m.check_invariants()


def test_adaptive_books_guess_a_margin_until_the_first_429():
    # by default a call counts until dispatch + ADAPTIVE_MARGIN_S + period (or its answer + period,
    # if sooner) ...
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 2, "period_s": 1.0}}, clock=clock)
    m.allocate("api:svc", 1, "a")
    m.allocate("api:svc", 1, "b")
    assert m.next_wakeup(clock()) == pytest.approx(ADAPTIVE_MARGIN_S + 1.0)
    clock.t = 0.1
    m.release("api:svc", "b")  # answered before the margin: b leaves at 1.1
    assert m.next_wakeup(clock()) == pytest.approx(1.1)
    clock.t = 1.1
    assert next(iter(m.pool_states())).free == 1
    m.allocate("api:svc", 1, "c")  # dispatched at 1.1, still in flight
    clock.t = ADAPTIVE_MARGIN_S + 1.0
    assert next(iter(m.pool_states())).free == 1  # a (in flight since 0) left the books at 1.5
    m.allocate("api:svc", 1, "d")
    # ... and the upstream's first 429 withdraws the guess: a call counts until its answer + period
    clock.t = 1.6
    assert m.observe_response("api:svc", 429, {"Retry-After": "0"}) == 0.0
    assert m.next_wakeup(clock()) is None  # c's and d's superseded expiries wake nothing
    clock.t = 10.0  # c and d, in flight for minutes, still count: only their answers start the countdown
    assert next(iter(m.pool_states())).free == 0 and m.next_wakeup(clock()) is None
    m.release("api:svc", "c")
    assert m.next_wakeup(clock()) == pytest.approx(11.0)
    clock.t = 11.0
    assert next(iter(m.pool_states())).free == 1
    m.release("api:svc", "a")  # a late answer of a call that already left the books gives nothing twice
    assert next(iter(m.pool_states())).free == 1
    m.allocate("api:svc", 1, "e")
    clock.t = 12.0
    assert next(iter(m.pool_states())).free == 0  # e: no margin any more, in flight
    m.check_invariants()


def test_adaptive_guess_is_for_the_call_itself_not_an_exec_holding_the_pool():
    # an exec's command calls the API after its set-up, and its 429s never reach the manager:
    # its grant counts until its end, whatever the books; an http action's, as guessed
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 3, "period_s": 1.0}}, clock=clock)
    shell = Action.build("sh", {"api:svc": 1}, payload={"kind": "exec", "command": "curl ..."})
    kindless = Action.build("k", {"api:svc": 1})  # the runtime runs an action with no kind as an exec
    call = Action.build("call", {"api:svc": 1}, payload={"kind": "http", "url": "http://x"})
    m.allocate("api:svc", 1, "sh", shell)
    m.allocate("api:svc", 1, "k", kindless)
    m.allocate("api:svc", 1, "call", call)
    assert m.next_wakeup(clock()) == pytest.approx(ADAPTIVE_MARGIN_S + 1.0)  # the call's unit only
    clock.t = 3.0
    assert next(iter(m.pool_states())).free == 1  # the two execs, still running, hold their units
    m.release("api:svc", "sh")
    assert m.next_wakeup(clock()) == pytest.approx(4.0)
    m.check_invariants()
    # a stated margin is for the call itself too
    m = BasicManager({"svc": {"quota": 1, "period_s": 1.0, "arrival_margin_s": 0.2}}, clock=clock)
    m.allocate("api:svc", 1, "sh", shell)
    assert m.next_wakeup(clock()) is None


@pytest.mark.parametrize("books", ["adaptive", "conservative"])
def test_a_spent_pool_pauses_from_the_calls_latest_arrival_under_the_guess(books):
    # the upstream says "0 left, reset in 2 s" in a slow call's answer: a gateway states its books
    # as the call arrives, within the guess (by dispatch + 0.5 s), not as the answer leaves
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 1, "period_s": 2.0, "books": books}}, clock=clock)
    m.allocate("api:svc", 1, "a")
    clock.t = 1.2  # answered 1.2 s after dispatch
    m.observe_response("api:svc", 200, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "2"}, "a")
    m.release("api:svc", "a")
    assert m.next_wakeup(clock()) == pytest.approx(2.5 if books == "adaptive" else 3.2)


@pytest.mark.parametrize("reset", ["1e12", "1700000000000"], ids=["a bogus delta", "epoch milliseconds"])
def test_a_spent_pools_pause_from_its_reset_header_is_bounded(reset):
    """``Remaining: 0`` with a reset far off (epoch milliseconds read as seconds since the epoch, or a
    bogus delta) pauses the pool no longer than a 429's longest pause: it once parked it for ever."""
    from tangram.managers.basic import MAX_429_PAUSE_S

    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 1, "period_s": 2.0}}, clock=clock)
    m.allocate("api:svc", 1, "a")
    m.observe_response("api:svc", 200, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset}, "a")
    m.release("api:svc", "a")
    assert 2.0 <= m.next_wakeup(clock()) <= MAX_429_PAUSE_S
    clock.t = MAX_429_PAUSE_S + 1
    assert next(iter(m.pool_states())).free == 1


def test_adaptive_guess_withdrawn_counts_answered_calls_to_their_answer():
    # a call answered after the margin had already left the books at dispatch + margin + period;
    # after the 429 it counts again until answer + period (the 429's pause covers the gap)
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 1, "period_s": 1.0}}, clock=clock)
    m.allocate("api:svc", 1, "a")
    clock.t = 1.0
    m.release("api:svc", "a")  # answered at 1.0: under the guess, it leaves at 1.5
    m.observe_response("api:svc", 429, {"Retry-After": "0"})
    clock.t = 1.6
    assert next(iter(m.pool_states())).free == 0
    assert m.next_wakeup(clock()) == pytest.approx(2.0)
    clock.t = 2.0
    assert next(iter(m.pool_states())).free == 1
    m.check_invariants()


@pytest.mark.parametrize("raw", [{"arrival_margin_s": 0.2}, {"books": "conservative"}])
def test_a_stated_margin_or_conservative_books_do_not_change_on_a_429(raw):
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 1, "period_s": 1.0, **raw}}, clock=clock)
    m.observe_response("api:svc", 429, {"Retry-After": "0"})
    m.allocate("api:svc", 1, "a")
    expected = 1.2 if "arrival_margin_s" in raw else None
    assert m.next_wakeup(clock()) == (None if expected is None else pytest.approx(expected))


def test_adaptive_fixed_window_counts_to_the_answer_after_a_429():
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 1, "period_s": 1.0, "window": "fixed"}}, clock=clock)
    clock.t = 0.2
    m.allocate("api:svc", 1, "a")  # dispatched at 0.2: under the guess it arrives by 0.7, in window [0, 1)
    clock.t = 1.0
    assert next(iter(m.pool_states())).free == 1
    m.observe_response("api:svc", 429, {"Retry-After": "0"})
    m.allocate("api:svc", 1, "b")  # dispatched at 1.0, may now arrive in any later window
    clock.t = 2.0
    assert next(iter(m.pool_states())).free == 0
    m.release("api:svc", "b")
    clock.t = 3.0
    assert next(iter(m.pool_states())).free == 1
    m.check_invariants()


def test_arrival_margin_bounds_the_count():
    # with a known margin the unit leaves at dispatch + margin + period, even while still in flight
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 1, "period_s": 1.0, "arrival_margin_s": 0.2}}, clock=clock)
    m.allocate("api:svc", 1, "a")
    assert m.next_wakeup(clock()) == pytest.approx(1.2)
    clock.t = 1.2
    assert next(iter(m.pool_states())).free == 1
    m.allocate("api:svc", 1, "b")
    m.release("api:svc", "a")  # a's late answer gives nothing back twice
    clock.t = 1.3
    m.release("api:svc", "b")  # answered before its margin: the answer bounds the arrival
    assert m.next_wakeup(clock()) == pytest.approx(2.3)
    m.check_invariants()


def test_fixed_window_counts_a_call_in_flight_at_the_boundary_in_both_windows():
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 2, "period_s": 1.0, "window": "fixed"}}, clock=clock)
    clock.t = 0.9
    m.allocate("api:svc", 1, "a")  # may arrive after 1.0: counts in window [1, 2) too
    m.allocate("api:svc", 1, "b")
    m.release("api:svc", "b")  # answered at 0.9: arrived in [0, 1)
    clock.t = 1.0
    assert next(iter(m.pool_states())).free == 1
    clock.t = 1.5
    m.release("api:svc", "a")
    clock.t = 2.0  # answered in [1, 2): never arrives in [2, 3)
    assert next(iter(m.pool_states())).free == 2
    m.check_invariants()


def test_upstream_429_pauses_the_pool_for_retry_after():
    clock = Clock(10.0)
    m = BasicManager({"svc": {"concurrency": 3, "quota": 6, "period_s": 2.0}}, clock=clock)
    m.allocate("api:svc", 1, "a")
    m.release("api:svc", "a")
    assert m.observe_response("api:svc", 200, {"Content-Type": "text/plain"}) is None
    assert m.observe_response("api:svc", 429, {"Retry-After": "1.5"}) == pytest.approx(1.5)
    assert next(iter(m.pool_states())).free == 0
    assert m.next_wakeup(clock()) == pytest.approx(11.5)
    with pytest.raises(AllocationError, match="upstream pause until 11.5"):
        m.allocate("api:svc", 1, "b")
    clock.t = 11.5
    assert next(iter(m.pool_states())).free == 3
    assert m.upstream_429s() == {"api:svc": 1}
    # no Retry-After: the reset header, else one quota period
    assert m.observe_response("api:svc", 429, {"X-RateLimit-Reset": "0.25"}) == pytest.approx(0.25)
    assert m.observe_response("api:svc", 429, {}) == pytest.approx(2.0)
    assert m.observe_response("api:svc", 429, {"Retry-After": "soon"}) == pytest.approx(2.0)
    assert m.observe_response("api:nope", 429, {"Retry-After": "1"}) is None
    m.check_invariants()


def test_retry_after_as_http_date():
    import email.utils
    import time

    m = BasicManager({"svc": {"concurrency": 1}})
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 28 <= m.observe_response("api:svc", 429, {"retry-after": when}) <= 31


def test_fixed_window_moves_onto_the_upstream_boundary():
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 5, "period_s": 2.0, "window": "fixed"}}, clock=clock)
    clock.t = 0.5
    m.allocate("api:svc", 1, "a")
    m.release("api:svc", "a")
    # the upstream's window ends 0.3 s from now (ours at 2.0), and it counted 3 calls (someone shares the key)
    m.observe_response("api:svc", 200, {"X-RateLimit-Reset": "0.3", "X-RateLimit-Remaining": "2"})
    (p,) = m.pool_states()
    assert p.free == 2
    assert m.next_wakeup(clock()) == pytest.approx(0.8)
    clock.t = 0.8
    assert next(iter(m.pool_states())).free == 5
    clock.t = 2.8
    m.allocate("api:svc", 1, "b")
    assert m.next_wakeup(clock()) == pytest.approx(4.8)  # aligned from now on
    m.check_invariants()


def test_sliding_units_another_client_spent_come_back_a_period_later():
    clock = Clock(0.0)
    m = BasicManager({"svc": {"quota": 4, "period_s": 1.0}}, clock=clock)
    m.allocate("api:svc", 1, "a")
    m.release("api:svc", "a")
    # the upstream counted the whole quota: 3 calls are someone else's
    m.observe_response("api:svc", 200, {"X-RateLimit-Remaining": "0"})
    assert next(iter(m.pool_states())).free == 0
    m.check_invariants()
    assert m.next_wakeup(clock()) == pytest.approx(1.0)
    clock.t = 1.0
    assert next(iter(m.pool_states())).free == 4  # was 1, for good: their 3 units never came back
    clock.t = 1.0 + ADAPTIVE_MARGIN_S  # a's entry at dispatch + margin + period, superseded by its answer
    assert next(iter(m.pool_states())).free == 4
    (p,) = m._pools.values()
    assert (p.consumed, p.grants, p.expiry) == (0, {}, [])
    m.check_invariants()


def test_free_is_min_of_slots_and_quota():
    clock = Clock()
    m = BasicManager({"svc": {"concurrency": 2, "quota": 5, "period_s": 1.0}}, clock=clock)
    assert next(iter(m.pool_states())).capacity == 2
    m.allocate("api:svc", 2, "a")
    assert next(iter(m.pool_states())).free == 0  # slots bind
    m.release("api:svc", "a")
    m.allocate("api:svc", 2, "b")
    m.release("api:svc", "b")
    assert next(iter(m.pool_states())).free == 1  # quota binds: 4 of 5 consumed
    m.check_invariants()


# ---------------------------------------------------------------------- #
# through the engine: it waits for quota instead of starting calls that would fail

def test_engine_waits_for_quota_on_virtual_clock():
    clock = Clock(0.0)
    m = BasicManager({"svc": {"concurrency": 2, "quota": 3, "period_s": 1.0}}, clock=clock)
    eng = Engine([m], clock=clock)
    started = []
    for i in range(5):
        started += eng.submit(api_action(i))
    assert [s.action.id for s in started] == ["a0", "a1"]  # two slots
    assert dict(started[0].grants) == {"api:svc": 1}
    started = eng.complete("a0")
    assert [s.action.id for s in started] == ["a2"]  # third quota unit
    eng.complete("a1")
    eng.complete("a2")
    assert eng.running == {} and len(eng.waiting) == 2  # quota spent: nothing starts
    assert eng.next_wakeup() == pytest.approx(1.0)
    clock.t = 1.0
    started = eng.tick()
    assert [s.action.id for s in started] == ["a3", "a4"]
    for s in started:
        eng.complete(s.action.id)
    eng.check_invariants()
    assert next(iter(m.pool_states())).free == 1  # slots all back; 2 of 3 quota units consumed at t=1
    assert m.held() == {"api:svc": {}}


def test_engine_unschedulable_beyond_capacity():
    from tangram.core.errors import UnschedulableError

    eng = Engine([BasicManager({"svc": {"concurrency": 2}})])
    with pytest.raises(UnschedulableError, match="resources.api:svc"):
        eng.submit(api_action(0, units=3))
    with pytest.raises(UnschedulableError, match="no API pool named 'other'"):
        eng.submit(api_action(1, name="other"))


async def test_driver_paces_by_quota_with_real_clock():
    """The driver sleeps until next_wakeup: 6 calls at 3 per 0.2 s take >= 0.2 s, never more than 3 per window."""
    m = BasicManager({"svc": {"quota": 3, "period_s": 0.2}})
    eng = Engine([m])
    starts: list[float] = []

    async def run(s: Started) -> str:
        starts.append(eng.clock())
        await asyncio.sleep(0.001)
        return "succeeded"

    statuses = await drive(eng, [api_action(i) for i in range(6)], run, deadline_s=10)
    assert set(statuses.values()) == {"succeeded"} and len(statuses) == 6
    assert starts[3] - starts[0] >= 0.2 - 1e-6
    for i in range(len(starts)):
        assert sum(1 for t in starts if starts[i] <= t < starts[i] + 0.2) <= 3
    eng.check_invariants()
    assert m.held() == {"api:svc": {}}


def test_engine_requeue_puts_the_action_first_with_its_grants_released():
    clock = Clock(0.0)
    m = BasicManager({"svc": {"concurrency": 1}}, clock=clock)
    eng = Engine([m], clock=clock)
    started = eng.submit(api_action(0))
    eng.submit(api_action(1))
    assert [s.action.id for s in started] == ["a0"] and list(eng.waiting) == ["a1"]
    m.observe_response("api:svc", 429, {"Retry-After": "1"})  # the upstream refused a0: pool paused 1 s
    assert eng.requeue("a0") == []  # nothing starts while paused
    assert list(eng.waiting) == ["a0", "a1"] and eng.running == {}
    assert m.held() == {"api:svc": {}} and eng.record("a0").started_at is None
    assert eng.next_wakeup() == pytest.approx(1.0)
    clock.t = 1.0
    assert [s.action.id for s in eng.tick()] == ["a0"]  # first in line again
    eng.check_invariants()
    from tangram.core.errors import UnknownActionError

    with pytest.raises(UnknownActionError):
        eng.requeue("a1")  # not running


def test_units_back_that_no_round_has_read_are_reported_until_one_reads_them():
    """A refill or the end of an upstream's pause whose time passed before the runtime asked for its next
    wake-up: next_wakeup has nothing left to give, refilled_unseen says a round is due (the runtime
    hung on it, the pool free and calls waiting). Units the engine took or gave back itself are known."""
    t = [0.0]
    m = BasicManager({"s": {"quota": 1, "period_s": 1.0, "books": "conservative"}, "c": {"concurrency": 2}},
                     clock=lambda: t[0])
    list(m.pool_states())
    assert not m.refilled_unseen(t[0])
    m.allocate("api:s", 1, "a")
    m.allocate("api:c", 1, "b")
    t[0] = 0.1
    m.release("api:s", "a")  # counted until 1.1
    m.release("api:c", "b")  # a slot back: the engine released it, its round sees it
    assert not m.refilled_unseen(t[0])
    t[0] = 2.0
    assert m.next_wakeup(t[0]) is None  # the refill's time has passed
    assert m.refilled_unseen(t[0])
    list(m.pool_states())  # a round read the pools
    assert not m.refilled_unseen(t[0])
    # an upstream's pause (429 + Retry-After) that ends unseen is the same
    m.allocate("api:s", 1, "d")
    m.observe_response("api:s", 429, {"Retry-After": "1"}, "d")
    m.release("api:s", "d")
    list(m.pool_states())
    t[0] = 3.5
    assert m.next_wakeup(t[0]) is None and m.refilled_unseen(t[0])


def test_the_engine_hears_of_units_back_unseen_through_the_node_gate():
    """The scale-out build wraps every manager in a NodeGate: the engine must still hear of a refill
    no round has read (the gate delegates it, as it does next_wakeup)."""
    from tangram.scaleout.gate import DownNodes, gate_all

    t = [0.0]
    m = BasicManager({"s": {"quota": 1, "period_s": 1.0, "books": "conservative"}}, clock=lambda: t[0])
    eng = Engine(gate_all([m], DownNodes()), clock=lambda: t[0])
    list(eng.pool_states())
    m.allocate("api:s", 1, "a")
    m.release("api:s", "a")  # counted until 1.0
    assert not eng.refilled_unseen()
    t[0] = 2.0
    assert eng.refilled_unseen()
