"""The keys under which the aiohttp app keeps its state (shared by every handler module)."""
from __future__ import annotations

from aiohttp import web

from tangram.runtime import Runtime
from tangram.service.admission import FairGate
from tangram.service.config import ClusterConfig
from tangram.service.edge import HeadDeadline
from tangram.service.metrics import ServiceMetrics

CONFIG_KEY = web.AppKey("config", ClusterConfig)
RUNTIME_KEY = web.AppKey("runtime", Runtime)
METRICS_KEY = web.AppKey("metrics", ServiceMetrics)
WAITERS_KEY = web.AppKey("waiters", dict)  # action id -> request awaiting it
DEADLINE_KEY = web.AppKey("head_deadline", HeadDeadline)
GATE_KEY = web.AppKey("gate", FairGate)  # admission control between the wire and the runtime
