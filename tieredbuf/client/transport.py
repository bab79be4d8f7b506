"""One HTTP attempt against one endpoint, over the standard library's ``http.client``.

Connections are kept alive, a few per endpoint (one per request in flight), and every
attempt says whether its request was **sent**: a failure to connect (refused, no
route, a name that does not resolve, the TLS handshake) or to write the whole request
is not sent, so it cannot have been stored (the service stages only a whole body); a
failure after that (a timeout, a reset, a connection closed before the answer) is
sent, with an unknown outcome.  So a kept-alive connection is used again only
while it is fresh: idle less than :data:`IDLE_REUSE_S` (the service closes idle ones
after 75 s, load balancers after about 60) and not closed by the other end (its socket
checked for an end of stream before each use, as urllib3 does).  A connection that
fails anyway fails the attempt like any other -- never resent behind the caller's
back, since it may have been taken.

A certificate that does not verify is a refusal (:class:`SendError` with
``permanent``): no retry makes it verify.  ``abort()`` shuts every connection in use
down, so a ``close(timeout)`` that runs out never waits for a socket timeout.

Why ``http.client`` and not aiohttp (a dependency already): the producer's senders
are threads, one per request in flight, as the direct producer's uploads are; an
asyncio client would need an event loop thread of its own and hand every request and
answer across it, for nothing a blocking keep-alive connection does not do here.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tieredbuf.client.endpoints import Endpoint
from tieredbuf.errors import ConfigError
from tieredbuf.runtime import redact

_TOKEN_RE = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")  # RFC 6750 b64token
IDLE_PER_ENDPOINT = 8
IDLE_REUSE_S = 15.0
"""A kept-alive connection idle longer than this is closed, not used again."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: dict[str, str]
    """Header names in lower case."""
    body: bytes


class SendError(Exception):
    """An attempt that got no answer.  ``sent``: the request may have reached the
    service; ``permanent``: retrying cannot help (a certificate that does not verify)."""

    def __init__(self, message: str, *, sent: bool, permanent: bool = False) -> None:
        super().__init__(message)
        self.sent = sent
        self.permanent = permanent


def check_token(token: str, where: str) -> str:
    if not _TOKEN_RE.match(token):
        raise ConfigError(
            f"the bearer token from {where} is not RFC 6750 token characters "
            "(letters, digits, -._~+/ and trailing =)"
        )
    redact.register(token)
    return token


class TokenSource:
    """The bearer token: given, or the first token of a file, re-read when the file
    changes (size, mtime or inode), so a rotated token is used from the next request."""

    def __init__(self, token: str | None, token_file: str | None) -> None:
        self._lock = threading.Lock()
        self._file = None if token_file is None else Path(token_file)
        self._seen: tuple[int, int, int] | None = None
        self._token = None if token is None else check_token(token, "token=")
        if self._file is not None:
            self._token = self._read()

    def _read(self) -> str:
        assert self._file is not None
        try:
            st = self._file.stat()
            text = self._file.read_text("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read token_file {self._file}: {e}") from None
        self._seen = (st.st_size, st.st_mtime_ns, st.st_ino)
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                return check_token(line.split()[0], f"token_file {self._file}")
        raise ConfigError(f"token_file {self._file} holds no token")

    def header(self) -> str | None:
        """``Bearer <token>``, or None without a token.  A token file that changed and
        cannot be read now keeps the token read before (a half-written file)."""
        with self._lock:
            if self._file is not None:
                try:
                    st = self._file.stat()
                    if (st.st_size, st.st_mtime_ns, st.st_ino) != self._seen:
                        self._token = self._read()
                except (OSError, ConfigError):
                    pass
            return None if self._token is None else f"Bearer {self._token}"


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """Verifying TLS: the system's authorities, or only those in ``ca_file``."""
    if ca_file is not None and not os.path.isfile(ca_file):
        raise ConfigError(f"ca_file {ca_file} is not a file")
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"cannot load ca_file {ca_file}: {e}") from None


class Transport:
    """Keep-alive connections to the endpoints; one ``post`` is one attempt."""

    def __init__(self, timeout_s: float, tls: ssl.SSLContext | None) -> None:
        self._timeout = timeout_s
        self._tls = tls
        self._lock = threading.Lock()
        self._idle: dict[Endpoint, list[tuple[http.client.HTTPConnection, float]]] = {}
        self._busy: set[http.client.HTTPConnection] = set()
        self._closed = False

    def _take(self, ep: Endpoint) -> http.client.HTTPConnection:
        """A connection to ``ep``: a fresh idle one, else a new one."""
        stale: list[http.client.HTTPConnection] = []
        kept: http.client.HTTPConnection | None = None
        with self._lock:
            if self._closed:
                raise SendError("the producer is closing", sent=False)
            idle = self._idle.get(ep, [])
            now = time.monotonic()
            while idle and kept is None:
                old, since = idle.pop()
                if now - since > IDLE_REUSE_S or _dropped(old):
                    stale.append(old)
                else:
                    kept = old
                    self._busy.add(kept)
        for c in stale:
            c.close()
        if kept is not None:
            return kept
        conn: http.client.HTTPConnection
        if ep.scheme == "https":
            conn = http.client.HTTPSConnection(
                ep.host, ep.port, timeout=self._timeout, context=self._tls
            )
        else:
            conn = http.client.HTTPConnection(ep.host, ep.port, timeout=self._timeout)
        with self._lock:
            self._busy.add(conn)
        return conn

    def _give_back(self, ep: Endpoint, conn: http.client.HTTPConnection, keep: bool) -> None:
        with self._lock:
            self._busy.discard(conn)
            idle = self._idle.setdefault(ep, [])
            if keep and not self._closed and len(idle) < IDLE_PER_ENDPOINT:
                idle.append((conn, time.monotonic()))
                return
        conn.close()

    def post(self, ep: Endpoint, path: str, body: bytes, headers: dict[str, str | bytes]) -> Answer:
        """One attempt; SendError when no answer came (``sent``: it may have been taken)."""
        return self._post(ep, self._take(ep), path, body, headers)

    def _post(
        self,
        ep: Endpoint,
        conn: http.client.HTTPConnection,
        path: str,
        body: bytes,
        headers: dict[str, str | bytes],
    ) -> Answer:
        keep = False
        try:
            if conn.sock is None:
                try:
                    conn.connect()
                except ssl.SSLCertVerificationError as e:
                    raise SendError(
                        f"{ep.url}: TLS certificate not trusted: {e.verify_message} "
                        "(give ca_file= with the authority that signed it)",
                        sent=False,
                        permanent=True,
                    ) from None
                except (OSError, ssl.SSLError) as e:
                    raise SendError(f"{ep.url}: cannot connect: {_why(e)}", sent=False) from None
                if self._closed:
                    raise SendError("the producer is closing", sent=False)
            try:
                conn.request("POST", path, body=body, headers=headers)
            except (OSError, http.client.HTTPException) as e:
                # not all of it went out: the service stages only a whole body
                raise SendError(f"{ep.url}: not sent: {_why(e)}", sent=False) from None
            try:
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as e:
                raise SendError(f"{ep.url}: no answer: {_why(e)}", sent=True) from None
            keep = not resp.will_close
            return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
        finally:
            self._give_back(ep, conn, keep)

    def abort(self) -> None:
        """Shut every connection down, those in use too (their attempts fail at once)."""
        with self._lock:
            self._closed = True
            busy = list(self._busy)
            idle = [c for conns in self._idle.values() for c, _ in conns]
            self._idle.clear()
        for c in busy:  # its sender closes it when its attempt fails
            sock = c.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for c in idle:
            c.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c, _ in idle]
            self._idle.clear()
        for c in conns:
            c.close()


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """An idle connection the other end closed (or wrote to: nothing is owed on it)."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _why(e: BaseException) -> str:
    if isinstance(e, TimeoutError | socket.timeout):
        return "timed out"
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text
