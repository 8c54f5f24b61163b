#!/usr/bin/env python3
"""Property-based fuzzing of the wire API against ``docs/openapi.yaml`` with Schemathesis.

Starts a real ``tangram serve`` on the embedded default config (this machine as one local CPU node, a
bearer token, a SandboxFusion key, state in a temporary directory), runs ``schemathesis run`` on the
spec with every check (no 5xx, status codes, headers and bodies as documented, schema-valid requests
accepted and schema-invalid ones refused, unsupported methods answered 405 with ``Allow``, deleted
resources gone, auth enforced) through its examples, coverage, fuzzing and stateful phases, then:

* the service still answers ``/healthz`` (it did not go down);
* after removing the environments the run left behind, nothing leaks: ``/v1/environments`` is empty,
  ``/v1/stats`` shows every pool whole (free = capacity) and nothing held by admission, ``/healthz``
  nothing running or queued, and the service has no child process left;
* SIGTERM stops it cleanly (exit code 0).

``--json`` prints the counts: requests sent, answers by status, 5xx, Schemathesis' failures (code,
title, operations) and errors, the leaks found. Exit code 0 when all is clean. ``--max-examples`` and
``--seed`` bound and fix the run (the test suite runs a short one); ``--max-time`` runs longer.
The rules the spec cannot express are in ``scripts/fuzz/fuzz_api_hooks.py``.
"""
from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tangram.service import launch  # noqa: E402  (standard library only)
from tangram.service.launch import ServeProcess  # noqa: E402
SPEC = REPO / "docs" / "openapi.yaml"
# 422 answers a schema-valid demand the cluster can never satisfy (no GPU node, no such API pool, more
# memory than any node has, network refused), as the spec documents; 503/504/429 a full queue
ACCEPTED_FOR_VALID = ["2xx", "401", "404", "409", "422", "429", "503", "504"]
SETTLE_S = 30.0  # cancelled actions' kills and environment removals finish well within this


def _http(method: str, url: str, token: str | None = None, timeout: float = 30.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_serve(workdir: Path) -> tuple[ServeProcess, str, str]:
    """``tangram serve`` on the embedded default config; returns it, its token and sandbox key."""
    token, key = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    for name, secret in (("token", token), ("sandbox-key", key)):
        (workdir / name).write_text(secret + "\n")
        os.chmod(workdir / name, 0o600)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    serve = launch.start_serve(["--port", "0", "--token-file", str(workdir / "token"), "--sandbox-key-file",
                                str(workdir / "sandbox-key"), "--log-level", "WARNING"],
                               env=env, cwd=REPO, state_dir=workdir / "state")
    return serve, token, key


def run_schemathesis(url: str, token: str, key: str, workdir: Path, args: argparse.Namespace) -> dict:
    """One ``schemathesis run``; returns its JSON report with the answers it got, counted from its events."""
    toml = workdir / "schemathesis.toml"
    toml.write_text(
        "[generation]\ndatabase = \"none\"\n"  # nothing written to the working tree
        f"[parameters]\n\"path.key\" = \"{key}\"\n"
        f"[checks.positive_data_acceptance]\nexpected-statuses = {json.dumps(ACCEPTED_FOR_VALID)}\n")
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(toml), "run", str(SPEC), "--url", url,
           "--header", f"Authorization: Bearer {token}", "--checks", "all", "--continue-on-failure",
           "--workers", str(args.workers), "--seed", str(args.seed), "--request-timeout", str(args.request_timeout),
           "--report", "json,ndjson", "--report-json-path", str(workdir / "report.json"),
           "--report-ndjson-path", str(workdir / "events.ndjson"), "--no-color",
           # a service with a token has no keyless sandbox route (404 for every method, as documented)
           "--exclude-path", "/sandbox/run_code"]
    if args.max_examples:
        cmd += ["--max-examples", str(args.max_examples)]
    if args.max_time:
        cmd += ["--max-time", str(args.max_time)]
    if args.phases:
        cmd += ["--phases", args.phases]
    if args.deterministic:
        cmd += ["--generation-deterministic"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_api_hooks",
           "PYTHONPATH": os.pathsep.join([str(REPO / "scripts" / "fuzz"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if not (workdir / "report.json").exists():
        raise RuntimeError(f"schemathesis produced no report (rc {p.returncode}): {p.stdout[-3000:]}{p.stderr[-3000:]}")
    report = json.loads((workdir / "report.json").read_text())
    statuses: collections.Counter = collections.Counter()
    by_operation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    refused: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in (workdir / "events.ndjson").read_text().splitlines():
        event = json.loads(line).get("ScenarioFinished")
        if not event:
            continue
        label = event["recorder"]["label"]
        for interaction in event["recorder"].get("interactions", {}).values():
            response = interaction.get("response")
            code = str(response["status_code"]) if response else "no-response"
            statuses[code] += 1
            by_operation[label][code] += 1
            if code.startswith("4"):
                refused[label][f"{code} {_field_of(response)}"] += 1
    report["statuses"] = dict(sorted(statuses.items()))
    report["by_operation"] = {k: dict(sorted(v.items())) for k, v in sorted(by_operation.items())}
    # what refused requests were refused for: status and field, the most common per operation
    report["refusals"] = {k: dict(v.most_common(8)) for k, v in sorted(refused.items())}
    report["output_tail"] = p.stdout[-6000:] if p.returncode else ""
    return report


def _field_of(response: dict) -> str:
    """The ``field`` of a recorded error answer (its body is text or ``{"$base64": ...}``)."""
    content = response.get("content")
    if isinstance(content, dict) and "$base64" in content:
        content = base64.b64decode(content["$base64"]).decode("utf-8", "replace")
    try:
        field = json.loads(content or "").get("field")
    except (ValueError, AttributeError):
        return "-"
    return field if isinstance(field, str) else "-"


def descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def clean_up_and_check(url: str, token: str, serve: ServeProcess) -> list[str]:
    """Remove what the run left behind, then every way the service could still hold something."""
    leaks: list[str] = []
    status, listing = _http("GET", f"{url}/v1/environments", token)
    for env in (listing or {}).get("environments", []) if status == 200 else []:
        code, _ = _http("DELETE", f"{url}/v1/environments/{env['id']}", token)
        if code not in (204, 404):
            leaks.append(f"DELETE environment {env['id']}: {code}")
    deadline = time.monotonic() + SETTLE_S
    while True:
        problems = []
        _, health = _http("GET", f"{url}/healthz")
        _, stats = _http("GET", f"{url}/v1/stats", token)
        _, listing = _http("GET", f"{url}/v1/environments", token)
        if not isinstance(health, dict) or health.get("running") or health.get("queue_length"):
            problems.append(f"healthz after cleanup: {health}")
        if not isinstance(listing, dict) or listing.get("environments"):
            problems.append(f"environments left: {listing}")
        if not isinstance(stats, dict):
            problems.append(f"stats: {stats}")
        else:
            for name, pool in stats["pools"].items():
                if not pool["type"].startswith("api:") and pool["free"] != pool["capacity"]:
                    problems.append(f"pool {name}: free {pool['free']} of {pool['capacity']}")
            if stats["admission"]["held"]:
                problems.append(f"admission still holds {stats['admission']['held']}")
        kids = descendants(serve.pid)
        if kids:
            problems.append(f"child processes left: {kids}")
        if not problems or time.monotonic() > deadline:
            return leaks + problems
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--max-examples", type=int, default=100, help="test cases per operation and phase (default 100)")
    ap.add_argument("--max-time", type=float, help="seconds: repeat fuzzing until spent (a longer run)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0): the same seed, the same run")
    ap.add_argument("--deterministic", action="store_true", help="Schemathesis' deterministic generation")
    ap.add_argument("--phases", help="comma-separated: examples, coverage, fuzzing, stateful (default all)")
    ap.add_argument("--workers", type=int, default=1, help="concurrent Schemathesis workers (default 1)")
    ap.add_argument("--request-timeout", type=float, default=60.0, help="seconds per request (default 60)")
    args = ap.parse_args(argv)

    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="tangram-fuzz-"))
    serve = None
    summary: dict[str, Any] = {"seed": args.seed, "max_examples": args.max_examples}
    try:
        serve, token, key = start_serve(workdir)
        url = serve.url
        report = run_schemathesis(url, token, key, workdir, args)
        health, _ = _http("GET", f"{url}/healthz")
        summary.update({
            "schemathesis": report["schemathesis_version"],
            "requests": sum(report["statuses"].values()),
            "statuses": report["statuses"],
            "server_errors": sum(n for code, n in report["statuses"].items() if code.startswith("5")),
            "by_operation": report["by_operation"],
            "refusals": report["refusals"],
            "test_cases": report["test_cases"],
            "failures": [{"code": f["code"], "title": f["title"], "count": f["count"],
                          "operations": f["operations"]} for f in report["failures"]],
            "errors": report["errors"],
            "warnings": {k: v for k, v in report["warnings"].items() if v},
            "service_alive": serve.proc.poll() is None and health == 200,
        })
        summary["leaks"] = clean_up_and_check(url, token, serve)
        summary["serve_exit_code"] = serve.stop(grace_s=60)
        summary["output_tail"] = report["output_tail"]
    finally:
        if serve is not None:
            serve.kill()  # no-op once stopped
            if summary.get("serve_exit_code") != 0:
                summary["serve_log_tail"] = serve.output()[-4000:]
        shutil.rmtree(workdir, ignore_errors=True)
    summary["elapsed_s"] = round(time.monotonic() - started, 1)
    ok = (not summary["failures"] and not summary["errors"] and summary["server_errors"] == 0
          and summary["service_alive"] and not summary["leaks"] and summary["serve_exit_code"] == 0)
    summary["ok"] = ok
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{summary['requests']} requests {summary['statuses']}; failures {summary['failures']}; "
              f"errors {len(summary['errors'])}; leaks {summary['leaks']}; {'OK' if ok else 'NOT OK'}")
        if summary["output_tail"]:
            print(summary["output_tail"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
