"""A Tangram service that stays down stops verl's training (``max_consecutive_failures``).

verl's default path (``trainer.use_v1=true``) does not stop on a failed sample: the worker tags the
prompt's group ``failure`` and the replay buffer trains on what is left of the batch (sync) or evicts
and refills the group, without end (async, or sync with ``sync_refill_failed_groups``). Here verl's
own trainer (``PPOTrainerSync.fit``), its own replay buffers with the trainer's own refill function,
and verl's ``AgentLoopWorkerTQ`` with its ``RewardLoopWorker`` and the ``tangram`` reward manager
run against a real TransferQueue and a real ``tangram serve``; a service that is down is a port
nothing listens on, or the same port once that service stopped. Only the LLM is scripted (no GPU:
the trainer never reaches its model workers; a tripwire stands where it would). The guard's rules
are tested against a stub service that answers but runs nothing.
"""
from __future__ import annotations

import asyncio
import importlib
import socket

import pytest

pytest.importorskip("verl", reason="verl not installed: pip install -r scripts/test-requirements.txt")

from integrations.verl import config as tconfig  # noqa: E402
from integrations.verl import guard  # noqa: E402
from integrations.verl import metrics as tmetrics  # noqa: E402
from integrations.verl.config import TangramSettings, settings_from_config  # noqa: E402
from integrations.verl.session import TangramServiceError, close_clients, get_client, retrying  # noqa: E402
from integrations.verl.testing import (ScriptedLLM, make_model_dir, reward_loop_workers, rollout_rows,  # noqa: E402
                                       serve, verl_config)
from tangram.client import TangramHTTPError  # noqa: E402
from tests.helpers import transfer_queue_session  # noqa: E402
from tests.service_helpers import local_app  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.timeout(600)]

# one reward action each (no setup, no tool call): a sample is exactly one call to the service
SCORED = {"prompt": "task: scored.", "agent_name": "single_turn_agent",
          "tangram": {"test_command": "exit 0", "cpu_max": 1, "timeout_s": 60}}
# scored by verl's own gsm8k scorer: never calls the service
GSM8K = {"prompt": "task: gsm8k. What is 6*7?", "agent_name": "single_turn_agent", "data_source": "openai/gsm8k",
         "ground_truth": "42"}


def script(prompt: str, turn: int) -> str:
    return "6 * 7 = 42\n#### 42" if "gsm8k" in prompt else "```python\nprint('hi')\n```"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def transfer_queue():
    with transfer_queue_session("tgg-") as tq:
        yield tq


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    # the trip's window is retry_s, at least guard.MIN_WINDOW_S: 0 here, so that the tests' retry_s=0 trips at
    # the N-th failure in a row (test_one_burst_does_not_stop_a_run sets its own)
    monkeypatch.setattr(guard, "MIN_WINDOW_S", 0.0, raising=False)
    tconfig.set_active(None)
    tmetrics.drain()
    guard.reset()
    yield
    guard.reset()
    tconfig.set_active(None)


class InProcessManager:
    """verl's ``AgentLoopManagerTQ.generate_sequences`` (hand the batch to the workers, return once they
    took it) with one in-process ``AgentLoopWorkerTQ`` that runs on the test's event loop."""

    def __init__(self, worker, loop):
        self.worker, self.loop = worker, loop

    def generate_sequences(self, prompts) -> None:
        asyncio.run_coroutine_threadsafe(self.worker.generate_sequences(prompts), self.loop).result(60)


class Tripwire:
    """Where verl's model workers would be: the trainer went on to train on the batch it sampled."""

    def __getattr__(self, name):
        raise AssertionError(f"verl went on to train on the batch it sampled ({name})")


def _cfg(model_dir, url, limit, *extra):
    return verl_config(model_dir, [
        "reward.reward_manager.name=tangram",
        "+actor_rollout_ref.rollout.custom.tangram.enabled=true",
        f"+actor_rollout_ref.rollout.custom.tangram.url={url}",
        "+actor_rollout_ref.rollout.custom.tangram.retry_s=0",  # one try per call: one failure per sample
        f"+actor_rollout_ref.rollout.custom.tangram.max_consecutive_failures={limit}",
        "trainer.logger=[console]", "trainer.val_before_train=false", "data.gen_batch_size=1", *extra])


def _trainer(cfg, rows):
    """verl's own trainer of ``cfg``'s mode (its replay buffer, its refill function) whose dataloader
    yields ``rows`` one at a time, cycling (what verl's does at an epoch's end), with an in-process
    rollout worker; the model workers are a tripwire."""
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    importlib.import_module("integrations.verl.reward_manager")  # registers "tangram" (the plugin does in real runs)
    trainer = get_trainer_cls(cfg.trainer.v1.trainer_mode)(cfg)
    worker = AgentLoopWorkerTQ.__ray_actor_class__(cfg, None, None, reward_loop_workers(cfg))
    worker.llm_client = ScriptedLLM(worker.tokenizer, script)
    trainer.agent_loop_manager = InProcessManager(worker, asyncio.get_running_loop())
    trainer.train_dataloader, trainer.train_dataloader_it = [rollout_rows([r]) for r in rows], None
    trainer.global_steps, trainer.steps_per_epoch, trainer.total_training_steps = 0, 1, 1
    trainer.checkpoint_manager = trainer.actor_rollout_wg = Tripwire()
    return trainer, worker


async def _finish(worker):
    """Wait until the worker's samples are done (scored or failed)."""
    while worker.background_tasks:
        await asyncio.gather(*list(worker.background_tasks), return_exceptions=True)


async def _settle(tq, worker):
    """Wait for the worker's samples, then empty the train partition (as verl's trainer does after a step)."""
    await _finish(worker)
    tags = (await asyncio.to_thread(tq.kv_list, "train")).get("train", {})
    if tags:
        await asyncio.to_thread(tq.kv_clear, list(tags), "train")
    await close_clients()


async def test_dead_service_stops_verls_sync_fit_before_it_trains(model_dir, transfer_queue):
    """verl's default trainer (sync): one group of four survives the dead service (gsm8k, scored by verl's
    own scorer), so verl would train on it; the third failure in a row stops ``fit`` instead, in the
    replay buffer's poll, before the batch reaches the model workers, naming the cause and the setting."""
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = _cfg(model_dir, dead, 3, "data.train_batch_size=4")
    trainer, worker = _trainer(cfg, [SCORED, SCORED, GSM8K, SCORED])
    guard.install_hooks()  # what the verl.plugins entry point does in every process
    try:
        with pytest.raises(guard.TangramServiceDown) as err:
            await asyncio.to_thread(trainer.fit, trainer.agent_loop_manager)
        msg = str(err.value)
        assert dead in msg and "3 calls in a row" in msg and "max_consecutive_failures" in msg
        assert "cannot reach" in msg or "HTTP 0" in msg
        await _finish(worker)
        assert tmetrics.drain()["tangram/failed"] == 3  # the gsm8k sample did not fail
    finally:
        await _settle(transfer_queue, worker)


async def test_a_success_resets_the_count(model_dir, transfer_queue):
    """Two failures, a success once the service is up at that address, two failures after it stopped: the
    sync replay buffer hands the batch over (four failures, but never three in a row). The next failure
    is the third in a row: the next sampling raises."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    trainer, worker = _trainer(_cfg(model_dir, url, 3, "data.train_batch_size=1"), [])
    assert type(trainer.replay_buffer) is ReplayBuffer and guard.install_trainer_hook()

    async def dispatch(rows):
        trainer.train_dataloader, trainer.train_dataloader_it = [rollout_rows([r]) for r in rows], None
        await asyncio.to_thread(trainer._add_prompts_to_generate, len(rows))  # verl's own refill_fn
        await _finish(worker)

    def sample(n):
        return trainer.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=n)

    try:
        await dispatch([SCORED, SCORED])  # nothing listens yet
        with serve(port=port) as live:
            assert live == url
            await dispatch([SCORED])
        await close_clients()
        await dispatch([SCORED, GSM8K, SCORED])  # stopped again
        batch, _ = await asyncio.to_thread(sample, 6)
        assert len({k.split("_")[0] for k in batch.keys}) == 2  # the success and gsm8k: the rest failed
        await asyncio.to_thread(transfer_queue.kv_clear, batch.keys, "train")

        await dispatch([GSM8K, SCORED])
        with pytest.raises(guard.TangramServiceDown, match="3 calls in a row"):
            await asyncio.to_thread(sample, 2)
    finally:
        await _settle(transfer_queue, worker)


@pytest.mark.parametrize("mode", [["trainer.v1.trainer_mode=colocate_async"],
                                  ["trainer.v1.sampler.sync_refill_failed_groups=true"]], ids=["async", "sync-refill"])
async def test_dead_service_stops_the_refill_loop(model_dir, transfer_queue, mode):
    """verl's async trainers (and the sync one with ``sync_refill_failed_groups``) evict a failed group and
    refill it from the dataloader: with the service down that loop never ends (here: a tenth refill fails
    the test). The trip stops it; the trainer's process also learns it from the Ray actor the workers
    report to."""
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = _cfg(model_dir, dead, 4, "data.train_batch_size=2", *mode)
    trainer, worker = _trainer(cfg, [SCORED])
    trainer.replay_buffer.poll_interval = 0.2
    refill, refills = trainer.replay_buffer.refill_fn, []

    def bounded_refill(n):
        refills.append(n)
        if len(refills) >= 10:
            raise AssertionError(f"verl still drops failed groups and refills them ({sum(refills)} prompts so far)")
        return refill(n)

    trainer.replay_buffer.refill_fn = bounded_refill
    assert guard.install_trainer_hook()
    try:
        await asyncio.to_thread(trainer._add_prompts_to_generate, 2)
        with pytest.raises(guard.TangramServiceDown, match="max_consecutive_failures"):
            await asyncio.to_thread(trainer.replay_buffer.sample, global_steps=1, partition_id="train", batch_size=2)
        assert 0 < len(refills) < 10
        guard._tripped = None  # as the trainer's own process sees it: only through the actor
        assert "4 calls in a row" in (guard.tripped() or "")
    finally:
        await _settle(transfer_queue, worker)


async def test_only_a_service_failure_counts_and_zero_never_stops():
    """An error answer about the request (a 404) says nothing about the service: the count stays as it was
    (it neither counts nor resets); a service that cannot be reached counts. 0 turns the guard off. A trip
    also stops the run when verl's logger logs a step."""
    from verl.utils.tracking import Tracking

    guard.install_hooks()  # also after verl's logger logged a step (the legacy trainer, a custom sampler)
    tracking = Tracking("p", "e", default_backend=[])  # built by fit, before anything can trip
    port = free_port()
    s = TangramSettings(url=f"http://127.0.0.1:{port}", retry_s=0, max_consecutive_failures=3)
    try:
        for _ in range(2):
            with pytest.raises(TangramServiceError, match="HTTP 0"):
                await retrying(lambda: get_client(s).stats(), s, "stats")
        assert guard.count(s) == 2 and guard.tripped() is None
        with serve(port=port):
            with pytest.raises(TangramServiceError, match="404"):
                await retrying(lambda: get_client(s).delete_environment("no-such-env"), s, "delete")
            assert guard.count(s) == 2
        await close_clients()

        off = s.merged({"max_consecutive_failures": 0})
        for _ in range(5):
            with pytest.raises(TangramServiceError):
                await retrying(lambda: get_client(off).stats(), off, "stats")
        assert guard.count(s) == 7 and guard.tripped() is None
        with pytest.raises(TangramServiceError):
            await retrying(lambda: get_client(s).stats(), s, "stats")
        assert "8 calls in a row" in guard.tripped() and "max_consecutive_failures (now 3" in guard.tripped()
        assert "could not be reached (8)" in guard.tripped() and "start the service" in guard.tripped()
        with pytest.raises(guard.TangramServiceDown, match="stopping the training"):
            guard.check()

        step = {"training/global_step": 1}
        with pytest.raises(guard.TangramServiceDown, match="8 calls in a row"):
            tracking.log(data=step, step=1)
        assert "tangram/failed" in step  # the step's metrics were logged first
    finally:
        await close_clients()


def test_the_setting(model_dir):
    assert TangramSettings().max_consecutive_failures == 32
    over = "+actor_rollout_ref.rollout.custom.tangram.max_consecutive_failures"
    assert settings_from_config(verl_config(model_dir, [f"{over}=5"])).max_consecutive_failures == 5
    assert settings_from_config(verl_config(model_dir, [f"{over}=null"])).max_consecutive_failures == 0
    assert TangramSettings().merged({"max_consecutive_failures": "0"}).max_consecutive_failures == 0
    with pytest.raises(ValueError, match="max_consecutive_failures"):
        TangramSettings().merged({"max_consecutive_failures": -1})


# a service that answers but cannot run anything, told apart from one that can
EXIT_127 = {"status": "failed", "exit_code": 127, "stderr": "bash: pytest: command not found"}
NOT_RUN = {"status": "failed", "error": "RuntimeError: Cannot connect to the Docker daemon"}  # an executor error
DOWN = TangramHTTPError(0, "cannot reach http://127.0.0.1:9")
RESTARTED = {"status": "failed", "error": "the service restarted while this action was waiting or running; it may "
                                          "be resubmitted", "retryable": True}


class Stub:
    """A service that answers but may run nothing: ``create``, POST /v1/environments' status (201: made);
    ``results``, the answers of POST /v1/actions in turn (the last one stays); look-ups and deletes work."""

    def __init__(self):
        self.create, self.results, self.calls = 201, [NOT_RUN], []

    def routes(self):
        from aiohttp import web

        def answer(name):
            async def handler(request):
                self.calls.append(name)
                if name == "look":
                    return web.json_response({"environments": []})
                if name == "delete":
                    return web.Response(status=204)
                if name == "action":
                    out = self.results.pop(0) if len(self.results) > 1 else self.results[0]
                    return web.json_response({"id": f"a-{len(self.calls)}", "allocation": {}, **out})
                headers = {"Retry-After": "1"} if self.create in (429, 503) else {}
                body = {"id": f"env-{len(self.calls)}"} if self.create == 201 else {"error": f"stub {self.create}"}
                return web.json_response(body, status=self.create, headers=headers)
            return handler

        return [("POST", "/v1/environments", answer("create")), ("GET", "/v1/environments", answer("look")),
                ("DELETE", "/v1/environments/{env}", answer("delete")), ("POST", "/v1/actions", answer("action"))]


@pytest.fixture
async def stub():
    st = Stub()
    async with local_app(st.routes()) as url:
        st.url = url
        yield st
        await close_clients()


def _stub_settings(stub, limit=3):
    tconfig.set_active(TangramSettings(url=stub.url, retry_s=0, admission_wait_s=0, max_consecutive_failures=limit))
    return tconfig.active_settings()  # the tools' settings too


async def _reward(s, fields=None):
    from integrations.verl.reward import score_sample
    return await score_sample(SCORED["tangram"], fields or {}, settings=s, text="print('hi')")


async def _tool(tool, command="ls"):
    iid, _ = await tool.create(create_kwargs={})
    try:
        return await tool.execute(iid, {"command": command}, agent_data=None)
    finally:
        await tool.release(iid)


async def test_a_service_that_cannot_create_environments_stops_the_run(stub):
    """The service is up but its POST /v1/environments answers 502 (its Docker engine is gone): the
    look-up of an environment whose creation lost its answer succeeds every time, and neither it nor
    anything else that is not a verdict resets the count: the third sample trips, naming the cause."""
    stub.create = 502
    s = _stub_settings(stub)
    for n in (1, 2, 3):
        with pytest.raises(TangramServiceError, match="502"):
            await _reward(s)
        assert guard.count(s) == n
    assert stub.calls.count("look") == 3  # the look-up ran (and succeeded) every time
    reason = guard.tripped() or ""
    assert "3 calls in a row" in reason and "answered 5xx (3)" in reason and "creating an environment" in reason
    assert "read the service's log" in reason and "bring the service back" not in reason


async def test_actions_that_did_not_run_count_and_only_a_verdict_resets(stub):
    """Every call succeeds, but the actions do not run: an executor error, a timeout no executor ended, an
    answer `retryable` after a restart, an http call never made, a test command the image lacks (127: no
    verdict). Each counts; created environments, deletes and the action POSTs themselves reset nothing; a
    command that ran (exit code 1; killed at its timeout, 137; an http call made, the upstream's 500) is a
    verdict and resets. A sample whose
    rollout already failed is not counted again by its reward."""
    from integrations.verl.tools import TangramApiTool, TangramSandboxTool

    s = _stub_settings(stub)
    sh = TangramSandboxTool({}, None)
    api = TangramApiTool({"endpoint": "http://upstream.invalid/q", "api": "search"}, None)

    stub.results = [NOT_RUN]
    resp, _, info = await _tool(sh)
    assert info["status"] == "error" and "Docker daemon" in resp.text and guard.count(s) == 1
    stub.results = [{"status": "failed", "exit_code": 1, "stdout": "no such file"}]
    resp, _, info = await _tool(sh)
    assert "[exit code: 1]" in resp.text and guard.count(s) == 0  # it ran: a verdict
    stub.results = [{"status": "timeout", "error": "no result within 5 s"}]  # no executor ended it
    resp, _, info = await _tool(sh)
    assert info["status"] == "error" and "no result within" in resp.text and guard.count(s) == 1
    stub.results = [{"status": "timeout", "exit_code": 137, "error": "killed after 5 s"}]  # its executor did
    resp, _, info = await _tool(sh)
    assert "[timed out]" in resp.text and guard.count(s) == 0
    stub.results = [RESTARTED]
    await _tool(sh)
    assert guard.count(s) == 1
    stub.results = [{"status": "failed", "error": "not started: node n1 is down"}]
    resp, _, info = await _tool(api)
    assert info["status"] == "error" and "node n1 is down" in resp.text and guard.count(s) == 2
    stub.results = [{"status": "failed", "error": "HTTP 500", "output": {"status": 500, "body": "x", "latency_s": 0.1}}]
    resp, _, info = await _tool(api)
    assert info["status"] == "failed" and guard.count(s) == 0  # the call was made: a verdict

    stub.results = [NOT_RUN]
    await _tool(sh)
    await _tool(sh)
    with pytest.raises(TangramServiceError, match="lost an action"):
        await _reward(s, {"tangram_error": "tool run_shell: the service failed the command"})
    assert guard.count(s) == 2 and guard.tripped() is None  # counted at the tool, not again
    stub.results = [EXIT_127]
    with pytest.raises(TangramServiceError, match="127"):
        await _reward(s)
    reason = guard.tripped() or ""
    assert "3 calls in a row" in reason and "did not run or gave no verdict" in reason and "127" in reason
    assert "the reward" in reason and "Docker engine" in reason


@pytest.mark.parametrize("status, says, todo", [
    (429, "stayed full past admission_wait_s", "raise custom.tangram.admission_wait_s"),
    (401, "refused the run's token", "token_file")])
async def test_the_trip_names_its_cause_and_what_to_do(stub, status, says, todo):
    """A service full past admission_wait_s is overloaded, not down; a refused token is the run's setting."""
    stub.create = status
    s = _stub_settings(stub)
    for _ in range(3):
        with pytest.raises(TangramServiceError, match=str(status)):
            await _reward(s)
    reason = guard.tripped() or ""
    assert f"{says} (3)" in reason and todo in reason and "bring the service back" not in reason


async def test_one_burst_does_not_stop_a_run_failures_that_keep_coming_do(monkeypatch):
    """Calls in flight that fail together (an outage past retry_s; every action answered `retryable` after
    a restart of the service) reach the count at once: that alone does not trip; failures that keep coming
    for the window (retry_s, at least MIN_WINDOW_S) after it, with no verdict between, do."""
    monkeypatch.setattr(guard, "MIN_WINDOW_S", 0.3, raising=False)
    s = TangramSettings(url="http://127.0.0.1:9", retry_s=0, max_consecutive_failures=3)
    for _ in range(8):  # one burst
        await guard.failed(s, DOWN, "the exec reward action")
    assert guard.count(s) == 8 and guard.tripped() is None
    await asyncio.sleep(0.35)
    guard.verdict(s)  # the service is back
    for _ in range(3):
        await guard.failed(s, DOWN, "the exec reward action")
    await asyncio.sleep(0.35)
    assert guard.tripped() is None
    await guard.failed(s, DOWN, "the exec reward action")  # still failing a window later
    assert "4 calls in a row" in (guard.tripped() or "")
    assert guard.window_s(s.merged({"retry_s": 60})) == 60


async def test_the_trainer_is_told_at_the_next_failure_when_telling_it_failed(monkeypatch):
    """The Ray call that records the trip in the tangram_metrics actor fails (both tries): this process
    knows, and the next failure tells the trainer's process (once)."""
    told, tries = [], []

    class Actor:
        class trip:
            @staticmethod
            async def remote(reason):
                tries.append(reason)
                if len(tries) <= 2:
                    raise ConnectionError("the actor is not reachable yet")
                told.append(reason)

    monkeypatch.setattr(tmetrics, "_ray", lambda: object())
    monkeypatch.setattr(tmetrics, "_get_actor", lambda ray, create: Actor)
    s = TangramSettings(url="http://127.0.0.1:9", retry_s=0, max_consecutive_failures=2)
    for _ in range(2):
        await guard.failed(s, DOWN, "stats")
    assert guard._tripped and not told and len(tries) == 2
    await guard.failed(s, DOWN, "stats")
    assert told == [guard._tripped] and "2 calls in a row" in told[0]  # the first reason
    await guard.failed(s, DOWN, "stats")
    assert len(tries) == 3  # told once


async def test_a_new_fit_forgets_an_earlier_fits_trip(transfer_queue):
    """The tangram_metrics actor lives as long as the Ray job: a trip of an earlier fit is forgotten when
    the next fit builds verl's logger, and a trip of the new fit reaches the trainer again."""
    from verl.utils.tracking import Tracking

    guard.install_hooks()
    await guard.trip("an earlier fit's service went down")
    guard._tripped = None  # as the trainer's own process sees it: only through the actor
    assert guard.tripped() == "an earlier fit's service went down"
    Tracking("p", "e", default_backend=[])  # fit starts
    assert guard.tripped() is None
    await guard.trip("this fit's")
    guard._tripped = None
    assert guard.tripped() == "this fit's"
