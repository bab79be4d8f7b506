"""An HTTP front on loopback, in front of one ``tieredbuf serve`` (or of nothing): what a
load balancer or a lossy network does to a client's requests.

Each request is handled by the next action of its script (then by ``default``):

* ``PASS``: forwarded to the upstream, its answer passed back;
* ``LOSE``: forwarded, and the connection closed without the answer (the service
  stored the request; the client never hears of it);
* ``Status(code, retry_after)``: answered by the front itself, not forwarded;
* ``HANG``: held without an answer until the front closes (a stalled instance);
* ``DROP``: the connection closed before anything is forwarded.

An upstream that does not answer (refused, reset: an instance that was killed) is
answered 502, as a load balancer does.  ``upstream`` may be changed while it runs
(the instance restarted on another port).

Every request is logged with its ``Idempotency-Key``, a hash of its body and what
was done, so a test can see each attempt a client made.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PASS, LOSE, HANG, DROP = "pass", "lose", "hang", "drop"
HOP_HEADERS = {"host", "connection", "content-length", "keep-alive", "transfer-encoding"}


@dataclass(frozen=True)
class Status:
    code: int
    retry_after: str | None = None
    error: str | None = None
    """The answer's ``error`` (default: ``front answers <code>``)."""


@dataclass(frozen=True)
class Seen:
    path: str
    key: str | None
    body_sha: str
    headers: dict[str, str]
    action: str
    status: int | None
    """What the upstream answered (PASS, LOSE) or the front did (Status); None otherwise."""
    at: float
    """When the request had arrived whole (time.monotonic())."""


Action = str | Status


class Front:
    def __init__(
        self,
        upstream: tuple[str, int] | None = None,
        default: Action = PASS,
        idle_timeout: float | None = None,
    ) -> None:
        self.upstream = upstream
        self.default = default
        self.log: list[Seen] = []
        self._script: deque[Action] = deque()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle_timeout  # a kept-alive connection idle this long is closed

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                front._handle(self)

            def do_GET(self) -> None:
                front._handle(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def script(self, *actions: Action) -> None:
        with self._lock:
            self._script.extend(actions)

    def _next(self) -> Action:
        with self._lock:
            return self._script.popleft() if self._script else self.default

    def _note(
        self, h: BaseHTTPRequestHandler, body: bytes, action: str, status: int | None, at: float
    ) -> None:
        seen = Seen(
            h.path,
            h.headers.get("Idempotency-Key"),
            hashlib.sha256(body).hexdigest(),
            {k.lower(): v for k, v in h.headers.items()},
            action,
            status,
            at,
        )
        with self._lock:
            self.log.append(seen)

    def _forward(
        self, h: BaseHTTPRequestHandler, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        assert self.upstream is not None, "a front without an upstream cannot pass requests on"
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in HOP_HEADERS}
            conn.request(h.command, h.path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, r.getheaders(), r.read()
        finally:
            conn.close()

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(n) if n else b""
        at = time.monotonic()
        action = self._next()
        if action == DROP:
            self._note(h, body, DROP, None, at)
            h.close_connection = True
            return
        if action == HANG:
            self._note(h, body, HANG, None, at)
            self._closing.wait()
            h.close_connection = True
            return
        if isinstance(action, Status):
            self._note(h, body, f"status {action.code}", action.code, at)
            said = action.error or f"front answers {action.code}"
            out = json.dumps({"error": said, "status": action.code})
            h.send_response(action.code)
            h.send_header("Content-Type", "application/json")
            if action.retry_after is not None:
                h.send_header("Retry-After", action.retry_after)
            h.send_header("Content-Length", str(len(out)))
            h.end_headers()
            h.wfile.write(out.encode())
            return
        try:
            status, headers, data = self._forward(h, body)
        except OSError as e:  # the upstream is down: a load balancer answers 502
            action, status = f"upstream down ({type(e).__name__})", 502
            headers, data = [("Content-Type", "application/json")], b'{"error": "bad gateway"}'
        self._note(h, body, action, status, at)
        if action == LOSE:
            h.close_connection = True
            return
        h.send_response(status)
        for k, v in headers:
            if k.lower() not in HOP_HEADERS:
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def attempts(self) -> list[Seen]:
        with self._lock:
            return [s for s in self.log if s.path.startswith("/v1/produce")]

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
