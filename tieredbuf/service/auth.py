"""Bearer-token authentication for ``tieredbuf serve`` (RFC 6750, ``Authorization:
Bearer <token>``): the middleware, and the check that refuses an exposed port without
tokens.  Which tokens are valid, and how they are reloaded, is
:mod:`tieredbuf.service.tokens`.

A request without credentials gets 401 (``WWW-Authenticate: Bearer``), one with a
token that matches none gets 403.  Every candidate is compared with
:func:`hmac.compare_digest` (no early exit), so timing says nothing about how much
of a token was right.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from tieredbuf.errors import ConfigError
from tieredbuf.service.tokens import TOKENS_ENV, TokenSet

log = logging.getLogger("tieredbuf.service.auth")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name, resolved) reaches only this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host == "":
        return False  # every interface
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(str(i[4][0]).split("%", 1)[0]).is_loopback for i in infos
    )


def check_exposure(host: str, tokens: TokenSet | None, insecure: bool, tls: bool) -> None:
    """Refuse a service reachable from the network that anyone could write to; warn
    when its tokens would cross the network in clear text."""
    if is_loopback(host):
        return
    if tokens is None and not insecure:
        raise ConfigError(
            f"refusing to serve on {host or '*'} without authentication: anyone who can "
            f"reach the port could write to the buffer.  Give --token-file FILE or set "
            f"${TOKENS_ENV}, or pass --insecure to accept unauthenticated writes."
        )
    if tokens is None:
        log.warning("serving on %s WITHOUT authentication (--insecure)", host or "*")
    elif not tls:
        log.warning(
            "serving on %s over plain HTTP: bearer tokens cross the network in "
            "clear text; use --tls-cert/--tls-key or a TLS-terminating proxy",
            host or "*",
        )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middleware(tokens: TokenSet, open_paths: frozenset[str]) -> Middleware:
    """aiohttp middleware: every path not in ``open_paths`` needs a valid token."""

    @web.middleware
    async def bearer_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        d = tokens.check(request.headers.get("Authorization"))
        if d.status == 200:
            return await handler(request)
        if d.status == 401:
            return web.json_response(
                {
                    "error": "authentication required: send Authorization: Bearer <token>",
                    "status": 401,
                },
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="tieredbuf"'},
            )
        return web.json_response(
            {"error": "the bearer token is not valid here", "status": 403},
            status=403,
            headers={"WWW-Authenticate": 'Bearer realm="tieredbuf", error="invalid_token"'},
        )

    return bearer_auth
