"""DeepSearch rollout: multi-hop questions answered with a quota-limited search API.

Each trajectory is one FanOutQA dev question (:func:`tangram.demo.search.load_questions`).
Turn 0 searches the question itself; each later turn searches, in parallel,
the sub-questions of one dependency level of its decomposition (the fan-out
that makes DeepSearch bursty). Before every turn the policy LLM "generates"
for a drawn time: that gap is the only simulated part (exponential, mean
``gap_s``, drawn once per trajectory from ``seed`` so both runs see the same).

Two ways to call the same search service (same limits, same latency):

* ``tangram``: every search is an ``http`` action on the service's API pool,
  whose limits are exactly the search service's;
* ``naive-retry``: every trajectory calls the API directly and retries a 429
  the way the OpenAI Python client does (what agent frameworks inherit):
  at most ``max_retries`` retries (its default: 2), ``Retry-After`` honoured
  when 0 < it <= 60 s, else ``min(0.5 * 2**n, 8)`` s times a jitter in (0.75, 1];
* ``naive-persistent``: the same with ``persistent_retries`` (10) retries, what
  a user sets so that (almost) no search fails for good.

ACT of a search: from the trajectory issuing it to its answer (queueing,
retries and back-off included).
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlencode

from tangram.demo.results import document, percentile, policy_entry
from tangram.demo.search import Question

# openai-python's retry policy (openai/_constants.py, openai/_base_client.py)
OPENAI_MAX_RETRIES = 2
OPENAI_INITIAL_RETRY_DELAY_S = 0.5
OPENAI_MAX_RETRY_DELAY_S = 8.0


@dataclass(frozen=True, slots=True)
class DeepSearchSpec:
    trajectories: int = 8
    max_searches: int = 8  # per trajectory (FanOutQA dev: 6.9 leaf sub-questions on average, + the question)
    gap_s: float = 1.0
    k: int = 5
    seed: int = 0
    max_retries: int = OPENAI_MAX_RETRIES
    persistent_retries: int = 10


@dataclass(slots=True)
class SearchSample:
    trajectory: int
    act_s: float
    ok: bool
    caller_429s: int = 0  # 429 answers this caller saw
    retries: int = 0
    top_title: str | None = None


@dataclass(slots=True)
class DeepSearchResult:
    samples: list[SearchSample] = field(default_factory=list)
    step_time_s: float = 0.0


def plan(spec: DeepSearchSpec, questions: list[Question]) -> list[list[list[str]]]:
    """Per trajectory, its turns of queries (the question, then one dependency level per turn)."""
    out = []
    for i in range(spec.trajectories):
        q = questions[i % len(questions)]
        turns, left = [[q.question]], spec.max_searches - 1
        for level in q.subquestions:
            if left <= 0:
                break
            turns.append(list(level[:left]))
            left -= len(turns[-1])
        out.append(turns)
    return out


def gaps(spec: DeepSearchSpec, trajectory: int, turns: int) -> list[float]:
    rng = random.Random(spec.seed * 1_000_003 + trajectory)
    return [rng.expovariate(1.0 / spec.gap_s) if spec.gap_s > 0 else 0.0 for _ in range(turns)]


def search_url(base: str, query: str, k: int) -> str:
    return f"{base}?{urlencode({'q': query, 'k': k})}"


async def _rollout(spec: DeepSearchSpec, questions: list[Question],
                   call: Callable[[int, str], Any], progress: Callable[[], None]) -> DeepSearchResult:
    result = DeepSearchResult()
    turns_of = plan(spec, questions)

    async def one(i: int) -> None:
        turns = turns_of[i]
        for gap, queries in zip(gaps(spec, i, len(turns)), turns):
            await asyncio.sleep(gap)
            samples = await asyncio.gather(*(call(i, q) for q in queries))
            result.samples.extend(samples)
            for _ in samples:
                progress()

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(spec.trajectories)))
    result.step_time_s = time.monotonic() - t0
    return result


async def run_with_service(client: Any, spec: DeepSearchSpec, questions: list[Question], url: str, pool: str,
                           progress: Callable[[], None] = lambda: None) -> DeepSearchResult:
    """Every search an ``http`` action on API pool ``pool`` of the tangram service behind ``client``."""

    run = uuid.uuid4().hex[:8]  # a name per rollout and run: the order credits each trajectory's generation

    async def call(i: int, query: str) -> SearchSample:
        t0 = time.monotonic()
        r = await client.run_action({"kind": "http", "url": search_url(url, query, spec.k), "method": "GET",
                                     "resources": {"api": pool}, "timeout_s": 600, "trajectory": f"q{i}-{run}"})
        act = time.monotonic() - t0
        status = (r.output or {}).get("status")
        body = (r.output or {}).get("body")
        top = body["results"][0]["title"] if r.ok and isinstance(body, dict) and body.get("results") else None
        return SearchSample(i, act, r.ok, caller_429s=int(status == 429), top_title=top)

    return await _rollout(spec, questions, call, progress)


def retry_delay(retries_so_far: int, retry_after: str | None, rng: random.Random) -> float:
    """openai-python's ``_calculate_retry_timeout``."""
    if retry_after is not None:
        try:
            ra = float(retry_after)
        except ValueError:
            ra = None
        if ra is not None and 0 < ra <= 60:
            return ra
    sleep = min(OPENAI_INITIAL_RETRY_DELAY_S * 2.0 ** retries_so_far, OPENAI_MAX_RETRY_DELAY_S)
    return sleep * (1 - 0.25 * rng.random())


async def run_naive(session: Any, spec: DeepSearchSpec, questions: list[Question], url: str,
                    progress: Callable[[], None] = lambda: None, *, max_retries: int | None = None) -> DeepSearchResult:
    """Every trajectory calls the API directly, retrying 429s with back-off (``session``: aiohttp)."""
    rng = random.Random(spec.seed)
    max_retries = spec.max_retries if max_retries is None else max_retries

    async def call(i: int, query: str) -> SearchSample:
        t0 = time.monotonic()
        seen = retries = 0
        while True:
            async with session.get(search_url(url, query, spec.k)) as resp:
                body = await resp.json(content_type=None)
                status, retry_after = resp.status, resp.headers.get("Retry-After")
            if status != 429:
                break
            seen += 1
            if retries >= max_retries:
                break
            await asyncio.sleep(retry_delay(retries, retry_after, rng))
            retries += 1
        ok = 200 <= status < 300
        top = body["results"][0]["title"] if ok and body.get("results") else None
        return SearchSample(i, time.monotonic() - t0, ok, caller_429s=seen, retries=retries, top_title=top)

    return await _rollout(spec, questions, call, progress)


def summarize(r: DeepSearchResult, run_no: int = 0) -> dict[str, Any]:
    acts = [s.act_s for s in r.samples]
    out = {
        "run": run_no,
        "searches": len(acts),
        "mean_act_s": statistics.fmean(acts) if acts else 0.0,
        "p50_act_s": percentile(acts, 50),
        "p99_act_s": percentile(acts, 99),
        "step_time_s": r.step_time_s,
        "caller_429s": sum(s.caller_429s for s in r.samples),
        "retries": sum(s.retries for s in r.samples),
        "failed": sum(not s.ok for s in r.samples),
        # failed on a 429 with no retry left (a naive caller's designed give-up; a 429 seen per retry + the last)
        "gave_up": sum(not s.ok and s.caller_429s > s.retries for s in r.samples),
    }
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


COUNTS = ("searches", "caller_429s", "retries", "gave_up")  # summed over runs (the rest: medians, results.policy_entry)


def policy_summary(runs: list[DeepSearchResult]) -> dict[str, Any]:
    """The shared demo shape for one policy (tangram.demo.results), counts summed over runs."""
    per_run = [summarize(r, i) for i, r in enumerate(runs)]
    out = policy_entry(per_run, summed=COUNTS)
    del out["run"]
    return out


@dataclass(frozen=True, slots=True)
class ApiSpec:
    """The search service's limits and latency (both policies call the same service)."""

    concurrency: int = 3
    quota: int = 6
    period_s: float = 2.0
    window: str = "sliding"
    # a hosted search API answers in tens to hundreds of ms; this is added to the real BM25 time
    latency_s: tuple[float, float] = (0.05, 0.3)


async def demo(spec: DeepSearchSpec, api: ApiSpec = ApiSpec(), *, repeats: int = 1, baseline: bool = True,
               progress: Callable[[str, int], Callable[[], None]] | None = None) -> dict[str, Any]:
    """Run the rollout through tangram, then under naive retry, ``repeats`` times; the demo document."""
    import aiohttp
    from aiohttp import web

    from tangram.client import TangramClient
    from tangram.demo.search import SearchIndex, SearchService, load_corpus, load_questions
    from tangram.demo.upstream_limits import UpstreamLimits
    from tangram.service.app import RUNTIME_KEY, create_app
    from tangram.service.config import parse_config

    questions = load_questions()
    index = SearchIndex(load_corpus())
    total = sum(len(q) for turns in plan(spec, questions) for q in turns)
    tick = (lambda label: progress(label, total)) if progress else (lambda label: (lambda: None))

    def limits() -> UpstreamLimits:  # a fresh upstream per phase: each starts with its whole quota
        return UpstreamLimits(concurrency=api.concurrency, quota=api.quota, period_s=api.period_s, window=api.window)

    cfg = parse_config({
        "service": {"host": "127.0.0.1", "port": 0}, "cpu_nodes": [], "gpu_nodes": [],
        "api_pools": {"search": {"concurrency": api.concurrency, "quota": api.quota, "period_s": api.period_s,
                                 "window": api.window}},
    })
    baselines = {"naive-retry": spec.max_retries, "naive-persistent": spec.persistent_retries}
    runs: dict[str, list[DeepSearchResult]] = {name: [] for name in ("tangram", *baselines)}
    upstream: dict[str, list[dict]] = {name: [] for name in runs}
    absorbed = 0
    for rep in range(repeats):
        lim = limits()
        async with SearchService(index, lim, latency_s=api.latency_s, seed=spec.seed + rep) as search:
            app = create_app(cfg)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            try:
                async with TangramClient(f"http://127.0.0.1:{runner.addresses[0][1]}") as client:
                    runs["tangram"].append(await run_with_service(client, spec, questions, search.url, "search",
                                                                  tick(f"{'tangram':16}")))
                absorbed += sum(app[RUNTIME_KEY].upstream_429s_absorbed.values())
            finally:
                await runner.cleanup()
        upstream["tangram"].append(lim.stats.as_dict())
        if not baseline:
            continue
        for name, retries in baselines.items():
            lim = limits()
            async with SearchService(index, lim, latency_s=api.latency_s, seed=spec.seed + rep) as search:
                async with aiohttp.ClientSession() as session:
                    runs[name].append(await run_naive(session, spec, questions, search.url, tick(f"{name:16}"),
                                                      max_retries=retries))
            upstream[name].append(lim.stats.as_dict())
    policies = {}
    for name, rs in runs.items():
        if rs:
            policies[name] = policy_summary(rs)
            policies[name]["upstream_429s_sent"] = sum(u["refused_429"] for u in upstream[name])
    policies["tangram"]["upstream_429s_absorbed"] = absorbed
    # ratios: baseline / tangram; a baseline whose searches failed for good finishes them sooner
    return document(
        "deepsearch", policies, reference="tangram",
        projection=None,  # a rollout against one real API: nothing is projected
        spec={**{k: getattr(spec, k) for k in spec.__dataclass_fields__},
              "api": {k: getattr(api, k) for k in api.__dataclass_fields__}, "repeats": repeats},
        corpus={"articles": len(index.articles), "index_s": round(index.index_s, 3), "questions": len(questions)},
    )
