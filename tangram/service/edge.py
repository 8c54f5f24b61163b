"""The service's TCP edge: a request-head deadline and TLS.

aiohttp bounds the *size* of a request head and body but not the *time* a
client takes to send them: a client that opens connections and dribbles
header bytes (or none at all) would hold them open forever. Each
connection's protocol is wrapped here: from the moment it opens, or sends
the first byte after a finished request, it has ``header_timeout_s`` to
complete a request head; the body has its own deadline in the handler
(``service.body_timeout_s``, answered 408).
"""
from __future__ import annotations

import asyncio
import ssl
from typing import Any

from aiohttp import web


class HeadDeadline:
    """Tracks, per connection, whether a request head is overdue."""

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self.conns: dict[int, "_Guarded"] = {}  # id(transport) -> its guard
        self.closed_overdue = 0  # connections closed for a late head

    def request_started(self, transport: Any) -> None:
        g = self.conns.get(id(transport))
        if g is not None:
            g.active += 1
            g.disarm()

    def request_done(self, transport: Any) -> None:
        g = self.conns.get(id(transport))
        if g is not None:
            g.active -= 1

    def wrap(self, factory):
        loop = asyncio.get_running_loop()
        return lambda: _Guarded(factory(), self, loop)


class _Guarded(asyncio.Protocol):
    """Delegates to aiohttp's request handler; closes the connection when a head is overdue."""

    def __init__(self, inner: asyncio.Protocol, deadline: HeadDeadline, loop: asyncio.AbstractEventLoop):
        self.inner = inner
        self.deadline = deadline
        self.loop = loop
        self.transport: Any = None
        self.timer: asyncio.TimerHandle | None = None
        self.active = 0  # requests of this connection being handled

    def arm(self) -> None:
        if self.timer is None:
            self.timer = self.loop.call_later(self.deadline.timeout_s, self._expire)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self) -> None:
        self.timer = None
        t = self.transport
        if t is None or t.is_closing() or self.active > 0:
            return  # the head arrived: the body deadline and the handler take over
        self.deadline.closed_overdue += 1
        t.close()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.deadline.conns[id(transport)] = self
        self.inner.connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        if self.active == 0:
            self.arm()  # bytes of a new request: its head must be complete in time
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self.disarm()
        self.deadline.conns.pop(id(self.transport), None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def disarm_on_request(deadline: HeadDeadline):
    """Middleware: a request whose head arrived stops its connection's deadline until it is answered."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        t = request.transport
        deadline.request_started(t)
        try:
            return await handler(request)
        finally:
            deadline.request_done(t)

    return middleware


class GuardedSite(web.TCPSite):
    """A TCP site whose connections get a head deadline (and TLS when given a context)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, deadline: HeadDeadline,
                 ssl_context: ssl.SSLContext | None = None, backlog: int = 2048):
        super().__init__(runner, host, port, ssl_context=ssl_context, backlog=backlog)
        self.deadline = deadline

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner (what TCPSite.start does first)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.deadline.wrap(self._runner.server), self._host, self._port,
            ssl=self._ssl_context, backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
        socks = self._server.sockets or ()
        self._bound_port = socks[0].getsockname()[1] if socks else self._port


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx
