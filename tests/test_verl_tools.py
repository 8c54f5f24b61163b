"""verl tools on the scheduler: built by verl's own load_all_tools from the example
YAML, run against a real `tangram serve`; one environment per trajectory, kept
across turns, released at trajectory end (or by the TTL sweep)."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl not installed: pip install -r scripts/test-requirements.txt")

from integrations.verl import config as tconfig  # noqa: E402
from integrations.verl.session import REGISTRY, close_clients  # noqa: E402
from integrations.verl.testing import serve  # noqa: E402
from tests.service_helpers import local_app  # noqa: E402
from tangram.client import TangramClient  # noqa: E402

pytestmark = pytest.mark.verl

EXAMPLE_YAML = Path(__file__).resolve().parent.parent / "integrations" / "verl" / "examples" / "tool_config.yaml"


class _Search(BaseHTTPRequestHandler):
    def do_POST(self):  # echo the JSON body back
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        out = json.dumps({"results": [f"result for {body.get('query')}"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def search_api():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Search)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/search"
    srv.shutdown()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("svc") / "cluster.yaml"
    cfg.write_text("api_pools:\n  search: {concurrency: 1}\n")
    with serve(config=str(cfg)) as url:
        yield url


@pytest.fixture
def tools(service, monkeypatch):
    from verl.tools.tool_registry import load_all_tools

    monkeypatch.setenv("TANGRAM_URL", service)
    tconfig.set_active(None)
    loaded = {t.name: t for t in load_all_tools(tool_config_path=str(EXAMPLE_YAML), function_tool_path=None)}
    yield loaded
    REGISTRY._t.clear()  # forget what a failed test left (its environments die with the service)


async def _stats(url):
    async with TangramClient(url) as c:
        return await c.stats()


async def _call(tool, params, agent_data):
    """What verl's ToolAgentLoop._call_tool does: create -> execute -> release, per call."""
    iid, _ = await tool.create(create_kwargs={})
    try:
        return await tool.execute(iid, params, agent_data=agent_data)
    finally:
        await tool.release(iid)


def test_example_yaml_builds_the_tools_with_verl_load_all_tools(tools):
    from integrations.verl.tools import TangramApiTool, TangramSandboxTool

    assert isinstance(tools["run_shell"], TangramSandboxTool)
    assert isinstance(tools["search"], TangramApiTool)
    # no url in the YAML: the service comes from TANGRAM_URL
    assert tools["run_shell"].settings().url == tools["search"].settings().url


async def test_sandbox_state_persists_across_turns_and_is_released_at_trajectory_end(tools, service):
    sh = tools["run_shell"]
    traj = SimpleNamespace(request_id="req-1", tangram_trajectory="traj-A")
    other = SimpleNamespace(request_id="req-2", tangram_trajectory="traj-B")
    try:
        resp, reward, metrics = await _call(sh, {"command": "echo state-1 > notes.txt; echo written"}, traj)
        assert "written" in resp.text and "[exit code: 0]" in resp.text
        assert metrics["status"] == "succeeded" and metrics["exec_s"] >= 0 and "queued_s" in metrics
        # between turns: the environment exists, no core is held
        st = await _stats(service)
        assert st["environments"] == 1
        assert st["pools"]["cpu@local"]["used"] == 0
        # next turn (a new tool instance, as in verl): same files
        resp, _, _ = await _call(sh, {"command": "cat notes.txt"}, traj)
        assert "state-1" in resp.text
        # another trajectory has its own environment
        resp, _, _ = await _call(sh, {"command": "cat notes.txt"}, other)
        assert "No such file" in resp.text and "[exit code: 1]" in resp.text
        assert REGISTRY.environment_of("traj-A") != REGISTRY.environment_of("traj-B")
        assert (await _stats(service))["environments"] == 2
        assert [r["name"] for r in REGISTRY.records("traj-A")] == ["run_shell", "run_shell"]
        # trajectory end
        assert await REGISTRY.release("traj-A") is True
        assert await REGISTRY.release("traj-A") is False  # idempotent
        assert (await _stats(service))["environments"] == 1
    finally:
        await REGISTRY.release("traj-B")
        assert (await _stats(service))["environments"] == 0
        await close_clients()


async def test_parallel_calls_of_one_turn_share_one_environment(tools, service):
    sh = tools["run_shell"]
    traj = SimpleNamespace(request_id="req-3")  # plain ToolAgentLoop: keyed by request_id
    try:
        outs = await asyncio.gather(*[_call(sh, {"command": f"touch f{i}; echo ok"}, traj) for i in range(3)])
        assert all("ok" in r[0].text for r in outs)
        assert (await _stats(service))["environments"] == 1
        resp, _, _ = await _call(sh, {"command": "ls f* | wc -l"}, traj)
        assert resp.text.splitlines()[0].strip() == "3"
    finally:
        await REGISTRY.release("req-3")
        await close_clients()


async def test_ttl_sweep_releases_idle_environments(tools, service):
    sh = tools["run_shell"]
    await _call(sh, {"command": "true"}, SimpleNamespace(request_id="req-idle"))
    assert (await _stats(service))["environments"] == 1
    assert await REGISTRY.sweep(ttl_s=0.0) == ["req-idle"]
    assert (await _stats(service))["environments"] == 0
    await close_clients()


async def test_call_outside_a_trajectory_drops_its_environment_with_the_instance(tools, service):
    sh = tools["run_shell"]
    resp, _, _ = await _call(sh, {"command": "echo solo"}, None)
    assert "solo" in resp.text
    assert (await _stats(service))["environments"] == 0
    await close_clients()


async def test_api_tool_goes_through_the_api_pool(tools, service, search_api, monkeypatch):
    from tangram.client import TangramClient

    sent = []
    original = TangramClient.run_action

    async def recording(self, body, **kw):
        sent.append(body)
        return await original(self, body, **kw)

    monkeypatch.setattr(TangramClient, "run_action", recording)
    api = tools["search"]
    api.config["endpoint"] = search_api
    traj = SimpleNamespace(request_id="req-api")
    outs = await asyncio.gather(*[_call(api, {"query": f"q{i}"}, traj) for i in range(3)])
    # each call names its rollout, so the service's order credits the trajectory's generation
    assert [b.get("trajectory") for b in sent] == ["req-api"] * 3
    for i, (resp, _, metrics) in enumerate(outs):
        assert f"result for q{i}" in resp.text
        assert metrics["status"] == "succeeded" and metrics["kind"] == "http"
    st = await _stats(service)
    assert st["actions"].get("http:succeeded", 0) >= 3
    assert "api:search" in st["pools"]
    assert len(REGISTRY.records("req-api")) == 3
    await REGISTRY.release("req-api")
    await close_clients()


async def test_api_tool_searches_the_offline_wikipedia_through_the_pool(tools, service):
    # the demo's search service (BM25 over real Wikipedia summaries, a hosted API's limits)
    pytest.importorskip("bm25s")
    from tangram.demo.search import SearchIndex, SearchService, load_corpus
    from tangram.demo.upstream_limits import UpstreamLimits

    limits = UpstreamLimits(concurrency=1)  # the service's pool allows exactly one call at once
    async with SearchService(SearchIndex(load_corpus()), limits, latency_s=(0.05, 0.05)) as search:
        api = tools["search"]
        api.config["endpoint"] = search.url
        traj = SimpleNamespace(request_id="req-wiki")
        queries = ["Who painted the Mona Lisa?", "Louvre museum in Paris", "Mona Lisa"]
        outs = await asyncio.gather(*[_call(api, {"query": q}, traj) for q in queries])
    for resp, _, metrics in outs:
        assert metrics["status"] == "succeeded"
        assert json.loads(resp.text)["results"][0]["title"] in ("Mona Lisa", "Louvre")
    assert limits.stats.refused == 0 and limits.stats.admitted == 3
    await REGISTRY.release("req-wiki")
    await close_clients()


async def test_bad_arguments_do_not_reach_the_service(tools):
    resp, _, metrics = await _call(tools["run_shell"], {"cmd": "ls"}, None)
    assert "must be a non-empty string" in resp.text and metrics["status"] == "invalid"


async def test_token_comes_from_the_environment_unless_the_yaml_sets_one(tmp_path, monkeypatch):
    from verl.tools.tool_registry import load_all_tools

    tconfig.set_active(None)
    with serve(token="t0ken", tmp=tmp_path) as url:
        monkeypatch.setenv("TANGRAM_URL", url)
        monkeypatch.setenv("TANGRAM_TOKEN", "t0ken")
        sh = {t.name: t for t in load_all_tools(str(EXAMPLE_YAML), None)}["run_shell"]
        try:
            resp, _, metrics = await _call(sh, {"command": "echo authorised"}, None)
            assert "authorised" in resp.text and metrics["status"] == "succeeded"
            sh.config["token"] = "wrong"  # the YAML's own token wins
            resp, _, metrics = await _call(sh, {"command": "echo authorised"}, None)
            assert metrics["status"] == "error" and "sandbox service failed" in resp.text
        finally:
            await close_clients()
            REGISTRY._t.clear()


async def test_a_tool_with_its_own_url_keeps_the_environment_on_that_service(tools, service, tmp_path):
    """The trajectory was declared against a dead default; the tool's YAML names the live service:
    the environment is created, used, handed over and deleted on that one service."""
    from integrations.verl.config import TangramSettings

    sh = tools["run_shell"]
    sh.config["url"] = service
    traj = SimpleNamespace(request_id="req-u", tangram_trajectory="traj-U", extra_fields={})
    REGISTRY.declare("traj-U", TangramSettings(url="http://127.0.0.1:9"))
    try:
        resp, _, _ = await _call(sh, {"command": "echo here > f; cat f"}, traj)
        assert "here" in resp.text and "[exit code: 0]" in resp.text
        assert traj.extra_fields["tangram_url"] == service
        env = traj.extra_fields["tangram_environment"]
        assert REGISTRY.environment_of("traj-U") == env and (await _stats(service))["environments"] == 1
    finally:
        del sh.config["url"]
        await REGISTRY.release("traj-U")
        assert (await _stats(service))["environments"] == 0
        await close_clients()


async def test_a_failed_delete_is_kept_and_retried_until_it_succeeds(tools, service):
    from integrations.verl.config import TangramSettings
    from integrations.verl.session import PENDING_DELETES, delete_environment

    live = TangramSettings(url=service, retry_s=0.5)
    async with TangramClient(service) as c:
        env = await c.create_environment()
    dead = TangramSettings(url="http://127.0.0.1:9", retry_s=0.5)
    try:
        # the service that holds it cannot be reached: not deleted, not forgotten
        assert await delete_environment(dead, env) is False and (dead, env) in PENDING_DELETES
        assert (await _stats(service))["environments"] == 1
        # the same environment on the reachable service: a later delete of anything retries it
        PENDING_DELETES[(live, env)] = PENDING_DELETES.pop((dead, env))
        async with TangramClient(service) as c:
            other = await c.create_environment()
        assert await delete_environment(live, other) is True
        assert not PENDING_DELETES and (await _stats(service))["environments"] == 0
    finally:
        PENDING_DELETES.clear()
        await close_clients()


async def test_transient_errors_are_retried_within_the_deadline_then_raise():
    """A service answering 503 twice then 200 is retried through; one that keeps failing raises
    TangramServiceError naming it once retry_s is spent."""
    from aiohttp import web

    from integrations.verl.config import TangramSettings
    from integrations.verl.session import TangramServiceError, get_client, retrying

    hits = {"flaky": 0, "down": 0}

    async def flaky(request):
        hits["flaky"] += 1
        if hits["flaky"] <= 2:
            return web.json_response({"error": "overloaded"}, status=503)
        return web.json_response({"environments": 0})

    async def down(request):
        hits["down"] += 1
        return web.json_response({"error": "overloaded"}, status=503)

    async with local_app([("GET", "/flaky/v1/stats", flaky), ("GET", "/down/v1/stats", down)]) as url:
        try:
            s = TangramSettings(url=f"{url}/flaky", retry_s=10)
            assert await retrying(lambda: get_client(s).stats(), s, "stats") == {"environments": 0}
            assert hits["flaky"] == 3
            s = TangramSettings(url=f"{url}/down", retry_s=1)
            with pytest.raises(TangramServiceError, match=r"/down: stats failed after \d+ tries: HTTP 503"):
                await retrying(lambda: get_client(s).stats(), s, "stats")
            assert 2 <= hits["down"] <= 5
            # a 4xx is not transient: no retry
            s = TangramSettings(url=f"{url}/nowhere", retry_s=10)
            with pytest.raises(TangramServiceError, match="after 1 try"):
                await retrying(lambda: get_client(s).stats(), s, "stats")
        finally:
            await close_clients()


async def test_the_retry_deadline_starts_at_the_first_error_not_at_the_call():
    """A call that ran longer than retry_s (a test suite's action) and then lost its answer is still sent
    again: the deadline counted from the call's start gave it no retry at all."""
    from integrations.verl.config import TangramSettings
    from integrations.verl.session import retrying
    from tangram.client import TangramHTTPError

    calls = []

    async def long_then_lost():
        calls.append(1)
        if len(calls) == 1:
            await asyncio.sleep(0.6)  # past retry_s
            raise TangramHTTPError(0, "connection lost")
        return "the result"

    s = TangramSettings(url="http://127.0.0.1:1", retry_s=0.5)
    assert await retrying(long_then_lost, s, "a long action", report=False) == "the result"
    assert len(calls) == 2


async def test_a_lost_answer_is_sent_again_under_its_key_and_the_command_runs_once(service):
    """A gateway that forwards a POST and then answers 502 (or drops the connection): the command ran.
    The integration sends an action again only under the Idempotency-Key it first sent, so the service
    answers with that run's result; a command such as ``echo >> f`` is never applied twice. A bare POST
    that makes an environment is not sent again after such an answer (a second one would be left
    behind); the integration's own creation labels its environment and, after a lost answer, finds it
    before sending again."""
    import aiohttp
    from aiohttp import web

    from integrations.verl.config import TangramSettings
    from integrations.verl.session import (EnvSpec, TangramServiceError, create_environment, get_client, new_key,
                                           retrying)

    lost = {"/v1/actions": 1, "/v1/environments": 1}  # answers to lose per path
    seen = []

    async def gateway(request):
        body = await request.read()
        keep = {k: v for k, v in request.headers.items() if k in ("Content-Type", "Idempotency-Key")}
        async with aiohttp.ClientSession() as s, s.request(request.method, service + request.path_qs, data=body,
                                                           headers=keep) as r:
            out, status = await r.read(), r.status
        seen.append((request.path, request.headers.get("Idempotency-Key")))
        if lost.get(request.path, 0) > 0:
            lost[request.path] -= 1
            return web.json_response({"error": "bad gateway"}, status=502)
        return web.Response(body=out, status=status, content_type="application/json")

    async with local_app([("*", "/{tail:.*}", gateway)]) as url:
        s = TangramSettings(url=url, retry_s=10)
        try:
            async with TangramClient(service) as direct:
                env = await direct.create_environment()
                key = new_key()
                r = await retrying(lambda: get_client(s).exec(env, "echo x >> n; wc -l < n", idempotency_key=key),
                                   s, "a tool call")
                assert r.stdout.strip() == "1"  # ran once, though sent twice
                assert [k for p, k in seen if p == "/v1/actions"] == [key, key]
                with pytest.raises(TangramServiceError, match="after 1 try: HTTP 502"):
                    await retrying(lambda: get_client(s).create_environment(), s, "creating an environment",
                                   resendable=False)
                assert len([p for p, _ in seen if p == "/v1/environments" and _ is None]) == 1
                lost["/v1/environments"] = 1  # the integration's own creation: it finds what the lost answer made
                found, _setup = await create_environment(s, EnvSpec())
                made = {e["id"] for e in (await direct._request("GET", "/v1/environments"))["environments"]}
                for e in made:
                    await direct.delete_environment(e)
                assert env in made and found in made and len(made) == 3  # found, not doubled
        finally:
            await close_clients()


async def test_any_exception_of_a_tool_call_breaks_the_trajectory_loudly(tools, monkeypatch):
    """Not only the service's own errors: an exception of any kind in the call (a payload cut short, an
    answer that does not parse) marks the trajectory broken, so its reward raises instead of scoring it;
    verl's own handler would have shown the model an error and scored the sample as usual."""
    from tangram.client import TangramClient as Client

    async def broken(self, *a, **kw):
        raise KeyError("status")

    monkeypatch.setattr(Client, "run_action", broken)
    for name, params in (("run_shell", {"command": "true"}), ("search", {"query": "q"})):
        traj = SimpleNamespace(request_id=f"req-broken-{name}", extra_fields={})
        try:
            resp, _, metrics = await _call(tools[name], params, traj)
            assert metrics["status"] == "error" and f"tool {name}" in traj.extra_fields["tangram_error"], resp.text
            assert "KeyError" in traj.extra_fields["tangram_error"] or "status" in traj.extra_fields["tangram_error"]
        finally:
            await REGISTRY.release(f"req-broken-{name}")
            await close_clients()


async def test_a_rollout_past_the_services_queue_caps_waits_instead_of_failing(tmp_path, monkeypatch):
    """Six trajectories' tool calls at once against a service that queues two per job: the calls the
    service refuses for now (429 + Retry-After) wait and run, none fails its sample, and the wait
    shows in the step's metrics (tangram/admission_wait_mean_s)."""
    from verl.tools.tool_registry import load_all_tools

    from integrations.verl import metrics as tmetrics

    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("cpu_nodes:\n  - {name: local, executor: local, cores: 1, memory_mb: 4096}\ngpu_nodes: []\n"
                   "service: {max_queued_per_job: 2, max_queued_total: 100}\n")
    trajs = [SimpleNamespace(request_id=f"r{i}", tangram_trajectory=f"burst-{i}") for i in range(6)]
    with serve(config=str(cfg)) as url:
        monkeypatch.setenv("TANGRAM_URL", url)
        tconfig.set_active(None)
        sh = {t.name: t for t in load_all_tools(tool_config_path=str(EXAMPLE_YAML), function_tool_path=None)}[
            "run_shell"]
        try:
            outs = await asyncio.gather(*(_call(sh, {"command": f"sleep 0.3; echo out-{i}"}, t)
                                          for i, t in enumerate(trajs)))
            for i, (resp, _, metrics) in enumerate(outs):
                assert f"out-{i}" in resp.text and metrics["status"] == "succeeded", resp.text
            records = [r for t in trajs for r in REGISTRY.records(t.tangram_trajectory)]
            assert len(records) == 6 and sum(1 for r in records if r["admission_wait_s"] >= 1.0) >= 1
            tmetrics.drain()  # what earlier tests published
            tmetrics.publish(records)
            m = tmetrics.drain()
            assert m["tangram/actions"] == 6 and m["tangram/admission_wait_mean_s"] > 0
        finally:
            for t in trajs:
                await REGISTRY.release(t.tangram_trajectory)
            await close_clients()
            tconfig.set_active(None)


async def test_a_command_the_service_ended_without_an_exit_code_breaks_the_trajectory_loudly(tools, service):
    """The trajectory's environment deleted while its command runs: the action ends cancelled with no exit
    code. That is not the model's doing and has no result to show: the tool says the service failed and
    marks the trajectory (its reward then raises) instead of handing the model '[cancelled: ...]' as the
    command's output to be scored."""
    sh = tools["run_shell"]
    traj = SimpleNamespace(request_id="req-cut", tangram_trajectory="traj-cut", extra_fields={})
    try:
        call = asyncio.create_task(_call(sh, {"command": "sleep 30"}, traj))
        while REGISTRY.environment_of("traj-cut") is None or (await _stats(service))["pools"]["cpu@local"]["used"] == 0:
            await asyncio.sleep(0.05)
        async with TangramClient(service) as c:
            await c.delete_environment(REGISTRY.environment_of("traj-cut"))
        resp, reward, metrics = await asyncio.wait_for(call, 30)
        assert resp.text.startswith("Error: the sandbox service failed") and "cancelled" in resp.text, resp.text
        assert metrics["status"] == "error" and "tool run_shell" in traj.extra_fields["tangram_error"]
        assert [r["status"] for r in traj.extra_fields["tangram_trace"]] == ["cancelled"]
    finally:
        REGISTRY._t.pop("traj-cut", None)
        await close_clients()


async def test_an_api_call_the_service_cancelled_breaks_the_trajectory_loudly(tools, service, search_api, monkeypatch):
    """An API call cancelled by someone else (here a DELETE of it on the real service while it waits for
    the pool) has no answer to show: the trajectory is marked broken. An upstream's own error stays the
    call's answer (test_api_tool_goes_through_the_api_pool covers the answers)."""
    import socket

    from tangram.client import TangramClient as Client

    silent = socket.socket()  # an upstream that takes the connection and never answers: the call waits
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    api = tools["search"]
    api.config["endpoint"] = f"http://127.0.0.1:{silent.getsockname()[1]}/search"
    blocker_done = asyncio.Event()

    async def cancelled_by_someone_else(self, body, *, timeout_s=None, idempotency_key=None):
        aid = await self.submit(body)
        await self.cancel(aid)  # as an operator's DELETE would
        blocker_done.set()
        return await self.wait(aid, timeout_s=30)

    monkeypatch.setattr(Client, "run_action", cancelled_by_someone_else)
    traj = SimpleNamespace(request_id="req-api-cut", extra_fields={})
    try:
        resp, _, metrics = await _call(api, {"query": "q"}, traj)
        assert blocker_done.is_set()
        assert resp.text.startswith("Error: the sandbox service failed") and "cancelled" in resp.text, resp.text
        assert metrics["status"] == "error" and "tool search" in traj.extra_fields["tangram_error"]
    finally:
        api.config["endpoint"] = search_api
        silent.close()
        await REGISTRY.release("req-api-cut")
        await close_clients()


async def test_the_samples_environment_fields_win_and_the_tools_yaml_fills_the_rest(monkeypatch):
    """The agent loop declares the sample's environment (here only its setup_command); the tool's YAML and
    create_kwargs give an image and memory. The environment is built with the sample's setup and the
    YAML's image and memory: the YAML was once used only when the sample said nothing at all."""
    from integrations.verl import session
    from integrations.verl.config import TangramSettings
    from integrations.verl.session import EnvSpec, TrajectoryRegistry

    built = []

    async def fake_create(settings, spec, labels={}, trajectory=None):
        built.append(spec)
        assert trajectory == "t"  # the service counts the rollout's calls so far as the environment's
        return "env-x", None

    monkeypatch.setattr(session, "create_environment", fake_create)
    reg = TrajectoryRegistry()
    s = TangramSettings(url="http://127.0.0.1:9")
    reg.declare("t", s, EnvSpec(setup_command="cp -r /data/x .", labels={"a": "sample"}))
    assert await reg.ensure("t", s, EnvSpec(image="swe:1", memory_mb=2048, setup_command="echo yaml",
                                            labels={"a": "yaml", "b": "yaml"})) == "env-x"
    assert built == [EnvSpec(image="swe:1", memory_mb=2048, setup_command="cp -r /data/x .",
                             labels={"a": "sample", "b": "yaml"})]
