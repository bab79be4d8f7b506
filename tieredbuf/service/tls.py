"""The TLS pair ``tieredbuf serve`` serves with: checked once, kept as a snapshot.

The supervisor loads ``--tls-cert``/``--tls-key`` at start and on every SIGHUP.  A
pair that loads and matches is written, certificate chain then key, into one file
under the stage root (owner-only, replaced by rename); a pair that does not (say,
the new certificate written but not yet its key: the normal middle of a rotation)
is logged and the snapshot keeps the last good pair.  Workers load only the
snapshot, when they start and on SIGHUP, so a worker restarted in the middle of a
rotation starts with the pair in use instead of failing on the half-written one
(three such failures stopped the whole service).

:class:`TlsContexts` is the worker's side: the context it listens with, and the
newest one loaded.  This module imports only the standard library: the supervisor
never imports the worker's web stack.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from tieredbuf.errors import ConfigError
from tieredbuf.runtime.fsutil import write_private

SNAPSHOT_NAME = ".tls.pem"


def tls_context(cert: str, key: str | None) -> ssl.SSLContext:
    """A new server TLS context (TLS 1.2 or later) holding the pair; ConfigError when
    it cannot be loaded (or the key does not match the certificate)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"cannot load --tls-cert {cert} / --tls-key {key}: "
            f"{type(e).__name__}: {e.strerror or e}"
        ) from None
    return ctx


class TlsSnapshot:
    """The last good pair, one PEM file under the stage root (the supervisor's side)."""

    def __init__(self, cert: str, key: str, staging_root: Path) -> None:
        self.cert, self.key = cert, key
        self.path = staging_root / SNAPSHOT_NAME

    def refresh(self) -> None:
        """Load the configured pair; when it loads and matches, replace the snapshot
        with it.  ConfigError (and the snapshot unchanged) when it does not."""
        with open(self.cert, "rb") as f:
            chain = f.read()
        with open(self.key, "rb") as f:
            key = f.read()
        tmp = self.path.with_name(self.path.name + ".tmp")
        write_private(tmp, chain.rstrip(b"\n") + b"\n" + key)
        try:  # checked as read back: what the workers will load is what was checked
            tls_context(str(tmp), None)
        except ConfigError:
            tmp.unlink()
            tls_context(self.cert, self.key)  # names the operator's files
            raise
        os.replace(tmp, self.path)


class TlsContexts:
    """The context the server listens with, and the newest certificate loaded.

    asyncio wraps each new connection with the context the server started with; its
    SNI callback, which OpenSSL calls for every client hello (with a server name or
    without), moves the connection to the newest context.  A reload builds a fresh
    context and replaces the newest one only once the pair loaded and matched: a
    failed reload changes nothing, where loading into the live context had already
    installed the certificate when the key check failed, breaking every new
    connection."""

    def __init__(self, pem: str) -> None:
        self.pem = pem
        ctx = tls_context(pem, None)
        self.listening = self.current = ctx
        ctx.sni_callback = self._pick

    def _pick(self, conn: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        current = self.current
        if current is not ctx:
            conn.context = current

    def reload(self) -> None:
        """ConfigError (and no change) when the pair cannot be used."""
        self.current = tls_context(self.pem, None)
