"""docs/service.md's "Metrics" table against what a running service's /metrics exposes, and the source."""
from __future__ import annotations

import re
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.service_helpers import config, running_service

ROOT = Path(__file__).resolve().parent.parent


def documented() -> dict[str, tuple[str, set[str]]]:
    """metric -> (type, labels) from the table under "## Metrics"."""
    text = (ROOT / "docs" / "service.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, tuple[str, set[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`tangram_"):
            continue
        labels = set(re.findall(r"`([a-z_]+)`", cells[2]))
        for name in re.findall(r"`(tangram_[a-z0-9_]+)`", cells[0]):
            out[name] = (cells[1], labels)
    return out


async def _scrape(cfg) -> str:
    async with running_service(cfg) as svc, svc.client() as c:
        await c.exec(None, "true")
        async with aiohttp.ClientSession() as s, s.get(f"{svc.url}/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


async def test_every_metric_the_service_exposes_is_documented_with_its_type_and_labels():
    docs = documented()
    assert len(docs) >= 18
    # an API quota pool, so its families have samples too
    text = await _scrape(config(api_pools={"search": {"concurrency": 2, "quota": 4, "period_s": 1.0}}))
    seen = set()
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("tangram_"):
            continue
        if fam.name.endswith("_created") and fam.name.removesuffix("_created") in docs:
            continue  # prometheus_client's creation time of a counter or histogram, not a metric of ours
        seen.add(fam.name)
        assert fam.name in docs, f"{fam.name} is exposed but not in docs/service.md's Metrics"
        kind, labels = docs[fam.name]
        assert fam.type == kind, f"{fam.name}: exposed as a {fam.type}, documented as a {kind}"
        for sample in fam.samples:
            extra = set(sample.labels) - labels - {"le"}
            assert not extra, f"{fam.name}: label(s) {sorted(extra)} not documented"
    assert {"tangram_actions", "tangram_action_completion_seconds", "tangram_api_quota_books",
            "tangram_admission_held", "tangram_gc_pause_seconds"} <= seen


def test_every_documented_metric_is_defined_in_the_source():
    source = "\n".join(p.read_text() for p in (ROOT / "tangram" / "service").glob("*.py"))
    for name in documented():
        assert f'"{name}"' in source, f"docs/service.md documents {name}, which no service module defines"
