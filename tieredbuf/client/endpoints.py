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
        scheme, sep, rest = url.strip().partition("://")
        scheme = scheme.lower()
        if not sep or scheme not in SCHEMES:
            raise ConfigError(
                f"unsupported service URL {url!r}: give http://host:port or https://host:port "
                "(several: http://host1:port,host2:port)"
            )
        authorities, slash, tail = rest.partition("/")
        if "?" in tail or "#" in tail or "?" in authorities or "#" in authorities:
            raise ConfigError(f"service URL {url!r} has a query or fragment: give none")
        path = ("/" + tail).rstrip("/") if slash else ""
        for authority in authorities.split(","):
            out.append(_one(scheme, authority.strip(), path, url))
    if len(set(out)) != len(out):
        raise ConfigError(f"a service endpoint is listed twice in {given!r}")
    return tuple(out)
