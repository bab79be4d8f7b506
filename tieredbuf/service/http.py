"""The connection layer of a ``tieredbuf serve`` worker: what happens before a request
reaches the application (service/app.py), against slow and malformed clients.

* **A request head in time.**  A new connection, and a kept-alive one once it sends
  the first byte of its next request, must deliver the whole request head (request
  line and headers) within ``header_timeout_s``, or it is closed.  A TLS handshake
  gets the same time.  Between requests a kept-alive connection may stay idle for
  ``idle_timeout_s``.  (The body's deadline is the handler's: service/app.py.)
* **A cap on connections.**  Past ``max_connections`` open connections a new one is
  answered ``503`` (``Retry-After: 1``) and closed at once; counted in
  ``tieredbuf_http_connections_refused_total``.
* **Malformed requests quote nothing.**  aiohttp answers a request it cannot parse
  with a page quoting the offending bytes (an ``Authorization`` header with a bad
  byte: the bearer token) and logs a traceback at ERROR.  Here the answer is
  ``400 {"error": "malformed HTTP request: <reason>"}`` and the log one INFO line;
  ``<reason>`` is the parser's wording up to its first quote or colon, never the
  request's bytes.

aiohttp offers no hook for the parse-error page (aio-libs/aiohttp#3287), so
:class:`Connection` is aiohttp's ``RequestHandler`` with ``handle_error`` and the
protocol callbacks overridden, started by :class:`GuardedSite` (a ``BaseSite``, like
aiohttp's own ``SockSite``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
import time
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from prometheus_client import Counter

from tieredbuf.runtime.redact import redact

log = logging.getLogger("tieredbuf.service.http")

REFUSED = Counter(
    "tieredbuf_http_connections_refused",
    "Connections answered 503 and closed because the worker had --max-connections open.",
)
REFUSED_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
REFUSED_LOG_EVERY_S = 10.0
REFUSED_LINGER_S = 2.0
_REASON = re.compile(r"[A-Za-z][A-Za-z0-9 -]{0,79}")


def parse_error_reason(exc: BaseException | None) -> str:
    """The parser's own words for what is wrong (``Invalid header value char``),
    without the request bytes it quotes after them."""
    if isinstance(exc, HttpProcessingError):
        m = _REASON.match(exc.message.strip())
        if m and m.group().strip():
            return redact(m.group().strip())
    return type(exc).__name__ if exc is not None else "unreadable"


class Connection(RequestHandler):
    """One HTTP connection: aiohttp's handler plus the request-head deadline and a
    400 page that quotes nothing."""

    __slots__ = ("_head_timeout", "_head_timer", "_in_request")

    def __init__(self, manager: web.Server, *, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout = head_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_request = False

    # --- the request-head deadline ---------------------------------------------------

    def _arm(self) -> None:
        if self._head_timer is None and not self._in_request:
            loop = asyncio.get_running_loop()
            self._head_timer = loop.call_later(self._head_timeout, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self._in_request:
            log.info(
                "closed a connection from %s: no whole request head within %g s",
                self.peername,
                self._head_timeout,
            )
            self.force_close()

    def request_started(self) -> None:
        """The application got a request (its head is in): the head deadline is met."""
        self._in_request = True
        self._disarm()

    def request_finished(self) -> None:
        self._in_request = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if data:
            self._arm()
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # --- requests that do not parse --------------------------------------------------

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        reason = parse_error_reason(exc)
        log.info("malformed HTTP request from %s: %s (answered %d)", request.remote, reason, status)
        if request.writer.output_size > 0:
            raise ConnectionError("a response is already on its way: none for the error")
        resp = web.json_response(
            {"error": f"malformed HTTP request: {reason}", "status": status}, status=status
        )
        resp.force_close()
        return resp


@web.middleware
async def track_requests(request: web.Request, handler: Any) -> web.StreamResponse:
    """Tells the request's :class:`Connection` when the application has it."""
    conn = request.protocol
    if not isinstance(conn, Connection):
        return await handler(request)  # type: ignore[no-any-return]
    conn.request_started()
    try:
        return await handler(request)  # type: ignore[no-any-return]
    finally:
        conn.request_finished()


class _Refused(asyncio.Protocol):
    """A connection past the cap: one 503, then closed.  What the client sent is read
    and dropped until it closes (at most :data:`REFUSED_LINGER_S`): closing with
    unread bytes would reset the connection, and the client could lose the 503."""

    def __init__(self) -> None:
        self.transport: asyncio.WriteTransport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.transport = transport
        body = b'{"error": "too many connections: retry", "status": 503}'
        transport.write(REFUSED_ANSWER % (len(body), body))
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # dropped

    def eof_received(self) -> bool:
        if self.transport is not None:
            self.transport.close()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


class GuardedSite(web.BaseSite):
    """Serve ``runner`` on an already bound socket (``SockSite`` with the guards in
    the module doc)."""

    __slots__ = (
        "_head_timeout",
        "_idle_timeout",
        "_max_connections",
        "_name",
        "_refused",
        "_refused_logged",
        "_sock",
    )

    def __init__(
        self,
        runner: web.AppRunner,
        sock: socket.socket,
        *,
        ssl_context: ssl.SSLContext | None,
        head_timeout: float,
        idle_timeout: float,
        max_connections: int,
        backlog: int = 2048,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._sock = sock
        host, port = sock.getsockname()[:2]
        scheme = "https" if ssl_context else "http"
        self._name = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
        self._head_timeout = head_timeout
        self._idle_timeout = idle_timeout
        self._max_connections = max_connections
        self._refused = 0
        self._refused_logged = 0.0

    @property
    def name(self) -> str:
        return self._name

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None
        if len(server.connections) >= self._max_connections:
            REFUSED.inc()
            self._refused += 1
            now = time.monotonic()
            if now - self._refused_logged >= REFUSED_LOG_EVERY_S:
                log.warning(
                    "too many connections (--max-connections %d): %d refused with "
                    "503 since the last report",
                    self._max_connections,
                    self._refused,
                )
                self._refused, self._refused_logged = 0, now
            return _Refused()
        return Connection(
            server,
            loop=asyncio.get_running_loop(),
            head_timeout=self._head_timeout,
            keepalive_timeout=self._idle_timeout,
            access_log=None,
        )

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol,
            sock=self._sock,
            ssl=self._ssl_context,
            backlog=self._backlog,
            ssl_handshake_timeout=self._head_timeout if self._ssl_context else None,
        )
