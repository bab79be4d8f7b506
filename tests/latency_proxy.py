"""An HTTP proxy in front of an S3 server that adds S3's round trips, and chaos.

Every figure taken on loopback (1-3 ms a request) hides what S3's 20-50 ms do to a
path that makes its requests one after another.  This proxy sits between tieredbuf and
moto (or SeaweedFS) and, per request:

* waits ``delays[method]`` seconds before forwarding it (default: 20 ms for GET and
  HEAD, 40 ms for PUT, POST and DELETE -- a small S3 GET and PUT);
* with ``lose_responses`` (a probability), forwards a write and then drops the
  connection instead of answering: the write landed, its response was lost, and the
  client retries it (I2: a retry must recognise its own landed write);
* with ``lose_if`` (a function of the method, the path with its query and the
  headers), does the same to exactly the writes it picks: a deterministic lost response;
* with ``fail_writes`` (a probability), answers a write ``503 SlowDown`` without
  forwarding it (a transient refusal);
* with ``key_write_window_s``, refuses a PUT or POST to a key within that many seconds
  of the last one the server accepted for it (``429 SlowDown``, not forwarded), as GCS
  and Cloudflare R2 limit writes to one object key to about one per second.  A
  create-if-absent PUT (``If-None-Match: *``) is forwarded: to a key written within the
  window it fails with 412 anyway (it exists), which is no write (the conditional-write
  probe creates a key twice in a row and expects the 412).  Unlike
  :class:`tests.faults.KeyRateLimitedStore` (one process's store), the proxy
  sees every process's writes.

Used by the tests (``latency_proxy`` fixtures) and by ``bench/`` (a 20 ms / 40 ms column
beside loopback), so that no path can again be tuned only for 1 ms.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

S3_ROUND_TRIPS: Mapping[str, float] = {
    "GET": 0.020,
    "HEAD": 0.020,
    "PUT": 0.040,
    "POST": 0.040,
    "DELETE": 0.040,
}
"""Seconds added per method: a small S3 GET takes about 20 ms, a PUT about 40 ms."""
_WRITES = ("PUT", "POST", "DELETE")
_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
}


class LatencyProxy:
    """``with LatencyProxy("http://127.0.0.1:PORT") as p: p.endpoint`` -- a proxy on a
    free loopback port in front of ``upstream``."""

    def __init__(
        self,
        upstream: str,
        delays: Mapping[str, float] = S3_ROUND_TRIPS,
        *,
        lose_responses: float = 0.0,
        fail_writes: float = 0.0,
        key_write_window_s: float = 0.0,
        lose_if: Callable[[str, str, Message], bool] | None = None,
        seed: int | None = None,
    ) -> None:
        u = urlsplit(upstream)
        assert u.hostname is not None and u.port is not None
        self.upstream = (u.hostname, u.port)
        self.delays = dict(delays)
        self.lose_responses = lose_responses
        self.fail_writes = fail_writes
        self.key_write_window_s = key_write_window_s
        self.lose_if = lose_if
        self._accepted: dict[str, float] = {}
        """Per key (path): when the server last accepted a write to it (monotonic)."""
        self._key_locks: dict[str, threading.Lock] = {}
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        """Requests seen, by method, and ``lost`` / ``refused`` / ``key_refused`` for the
        chaos done."""
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # TCP_NODELAY: the headers and the body go out in separate writes, and with
            # Nagle's algorithm against the client's delayed ACK each request waited ~40 ms
            # more than ``delays`` says
            disable_nagle_algorithm = True

            def log_message(self, fmt: str, *args: object) -> None:
                pass

            def _handle(self) -> None:
                proxy.forward(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _chance(self, p: float) -> bool:
        if p <= 0:
            return False
        with self._lock:
            return self.rng.random() < p

    def _picked(self, method: str, path: str, headers: Message) -> bool:
        if self.lose_if is None:
            return False
        with self._lock:  # one decision at a time: a picker may count what it picked
            return self.lose_if(method, path, headers)

    def forward(self, h: BaseHTTPRequestHandler) -> None:
        if (
            self.key_write_window_s > 0
            and h.command in ("PUT", "POST")
            and h.headers.get("If-None-Match") is None
        ):
            key = urlsplit(h.path).path
            with self._lock:
                lock = self._key_locks.setdefault(key, threading.Lock())
            with lock:  # one write to a key at a time: the check and the write are one step
                self._forward(h, key)
        else:
            self._forward(h, None)

    def _forward(self, h: BaseHTTPRequestHandler, limited_key: str | None) -> None:
        method = h.command
        with self._lock:
            self.counts[method] += 1
        time.sleep(self.delays.get(method, 0.0))
        n = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(n) if n else b""
        if method in _WRITES and self._chance(self.fail_writes):
            with self._lock:
                self.counts["refused"] += 1
            _slow_down(h, 503)
            return
        if limited_key is not None:
            last = self._accepted.get(limited_key)
            if last is not None and time.monotonic() - last < self.key_write_window_s:
                with self._lock:
                    self.counts["key_refused"] += 1
                _slow_down(h, 429)
                return
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            conn.request(method, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if limited_key is not None and resp.status < 300:
            self._accepted[limited_key] = time.monotonic()
        if method in _WRITES and (
            self._chance(self.lose_responses) or self._picked(method, h.path, h.headers)
        ):
            with self._lock:
                self.counts["lost"] += 1
            h.close_connection = True  # the write landed; its answer never comes
            with contextlib.suppress(OSError):
                h.connection.shutdown(2)
            return
        h.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP and k.lower() != "content-length":
                h.send_header(k, v)
        length = resp.getheader("Content-Length") if method == "HEAD" else None
        h.send_header("Content-Length", length or str(len(data)))  # a HEAD's: the object's
        h.end_headers()
        if method != "HEAD":
            h.wfile.write(data)


def _slow_down(h: BaseHTTPRequestHandler, status: int) -> None:
    """Answer ``status`` SlowDown without forwarding the request."""
    msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
    h.send_response(status)
    h.send_header("Content-Length", str(len(msg)))
    h.send_header("Content-Type", "application/xml")
    h.end_headers()
    h.wfile.write(msg)


@contextlib.contextmanager
def latency_proxy(upstream: str, **kw: object) -> Iterator[LatencyProxy]:
    with LatencyProxy(upstream, **kw) as p:  # type: ignore[arg-type]
        yield p
