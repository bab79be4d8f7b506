"""Where a service producer sends its requests: ``http(s)://host:port[,host2:port2][/path]``.

Pure parsing, no I/O.  One URL may list several hosts (``http://a:8080,b:8080``): the
instances of one service on one buffer, each of which takes any request.  A list of
URLs is the same.  A path is a prefix the requests go under (an ingress that routes
``/tieredbuf/...``): ``POST <path>/v1/produce``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from tieredbuf.errors import ConfigError

SCHEMES = ("http", "https")
DEFAULT_PORTS = {"http": 80, "https": 443}
PRODUCE_PATH = "/v1/produce"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One instance (or one load-balanced address) of the service."""

    scheme: str
    host: str
    port: int
    path: str = ""
    """Prefix of the request paths, without a trailing slash ("" for none)."""

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"

    @property
    def produce_path(self) -> str:
        return self.path + PRODUCE_PATH


def _one(scheme: str, authority: str, path: str, whole: str) -> Endpoint:
    if not authority:
        raise ConfigError(f"no host in service URL {whole!r}: give http(s)://host:port")
    if "@" in authority:
        shown = authority.rsplit("@", 1)[1]
        raise ConfigError(
            f"service URL {scheme}://***@{shown} carries credentials: give the token as "
            "token= or token_file= (it is sent as a bearer token, never in the URL)"
        )
    parts = urlsplit(f"{scheme}://{authority}")
    try:
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"bad port in service URL {whole!r}: {e}") from None
    host = parts.hostname
    if not host:
        raise ConfigError(f"no host in service URL {whole!r}: give http(s)://host:port")
    return Endpoint(scheme, host, port or DEFAULT_PORTS[scheme], path)


def _groups(url: str) -> list[tuple[str, list[str], str]]:
    """``url`` as (scheme, authorities, path) groups: a comma starts another host of the
    same URL, or another URL where it names a scheme (``http://a:1,http://b:2``)."""
    groups: list[tuple[str, list[str], str]] = []
    for piece in url.split(","):
        piece = piece.strip()
        scheme, sep, rest = piece.partition("://")
        if sep:
            groups.append((scheme.lower(), [rest], ""))
        elif not groups:
            raise ConfigError(
                f"unsupported service URL {url!r}: give http://host:port or https://host:port "
                "(several: http://host1:port,host2:port)"
            )
        else:
            groups[-1][1].append(piece)
    out = []
    for scheme, authorities, _ in groups:
        if scheme not in SCHEMES:
            raise ConfigError(
                f"unsupported service URL {url!r}: give http://host:port or https://host:port "
                "(several: http://host1:port,host2:port)"
            )
        last, slash, tail = authorities[-1].partition("/")
        if any("/" in a for a in authorities[:-1]):
            raise ConfigError(f"service URL {url!r}: a path goes after the last host only")
        if any(c in tail or c in last for c in "?#"):
            raise ConfigError(f"service URL {url!r} has a query or fragment: give none")
        path = ("/" + tail).rstrip("/") if slash else ""
        out.append((scheme, [*authorities[:-1], last], path))
    return out


def parse_endpoints(urls: str | Sequence[str]) -> tuple[Endpoint, ...]:
    """Every endpoint ``urls`` names, in order; ConfigError (one line) for anything that
    is not an ``http://`` or ``https://`` URL with a host."""
    given = [urls] if isinstance(urls, str) else list(urls)
    if not given:
        raise ConfigError("no service URL given: give http(s)://host:port")
    out: list[Endpoint] = []
    for url in given:
        if not isinstance(url, str):
            raise ConfigError(f"a service URL is a string, got {type(url).__name__}")
        for scheme, authorities, path in _groups(url):
            for authority in authorities:
                out.append(_one(scheme, authority, path, url))
    if len(set(out)) != len(out):
        raise ConfigError(f"a service endpoint is listed twice in {given!r}")
    return tuple(out)
