"""Checks of the options every network store takes: booleans, durations, the endpoint,
the prefix, obstore's HTTP client and retry settings built from them, and the obstore
store built with those."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from tieredbuf.errors import ConfigError
from tieredbuf.runtime import redact
from tieredbuf.store.objstore import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_RETRY,
    DEFAULT_TIMEOUT,
)
from tieredbuf.store.obserrors import short

CLIENT_OPTIONS = frozenset(
    {
        "allow_http",
        "retry_config",
        "max_retries",
        "retry_timeout",
        "timeout",
        "connect_timeout",
        "probe",
        "chunk_size",
    }
)
"""Options every network store (s3://, az://) takes besides its own."""

_T = TypeVar("_T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"option {name} must be a bool or 'true'/'false', got {value!r}")


def as_duration(name: str, value: Any) -> timedelta:
    if isinstance(value, timedelta):
        d = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        d = timedelta(seconds=value)
    else:
        raise ConfigError(f"option {name} must be a timedelta or seconds, got {value!r}")
    if d <= timedelta(0):
        raise ConfigError(f"option {name} must be positive, got {value!r}")
    return d


def check_endpoint(endpoint: str, credentials_hint: str) -> None:
    """An http(s) URL with a host (obstore panics on some malformed ones, e.g. an
    unclosed IPv6 bracket, instead of raising)."""
    if not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"endpoint must be an http:// or https:// URL, got {endpoint!r}")
    try:
        parts = urlsplit(endpoint)
        _ = parts.port  # raises on a port that is not a number in range
    except ValueError as e:
        raise ConfigError(f"endpoint {endpoint!r} is not a valid URL: {e}") from None
    if not parts.hostname:
        raise ConfigError(f"endpoint {endpoint!r} names no host")
    if parts.username or parts.password:  # not echoed: the URL holds a secret
        raise ConfigError(f"the endpoint URL must not carry credentials: use {credentials_hint}")
    if parts.query or parts.fragment:
        raise ConfigError(f"endpoint {endpoint!r} must not carry a query or a fragment")


def url_prefix(url: str, path: str, what: str) -> str:
    """The key prefix a store URL names (``/a/b/`` -> ``a/b``), checked."""
    prefix = unquote(path).strip("/")
    if "//" in prefix or any(p in (".", "..") for p in prefix.split("/")):
        raise ConfigError(f"{what} URL {url!r} has an invalid prefix {prefix!r}")
    return prefix


def string_options(opts: dict[str, Any], names: tuple[str, ...]) -> dict[str, str]:
    """The options among ``names`` that are set, each checked to be a string."""
    out: dict[str, str] = {}
    for name in names:
        value = opts.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise ConfigError(f"option {name} must be a string, got {value!r}")
            out[name] = value
    return out


def client_options(opts: dict[str, Any], endpoint: str | None) -> dict[str, Any]:
    """obstore ClientConfig: timeouts, and plain HTTP when the endpoint is http://."""
    client: dict[str, Any] = {
        "connect_timeout": as_duration("connect_timeout", opts["connect_timeout"])
        if opts.get("connect_timeout") is not None
        else DEFAULT_CONNECT_TIMEOUT,
        "timeout": as_duration("timeout", opts["timeout"])
        if opts.get("timeout") is not None
        else DEFAULT_TIMEOUT,
    }
    plain_http = endpoint is not None and endpoint.startswith("http://")
    if opts.get("allow_http") is not None:
        client["allow_http"] = as_bool("allow_http", opts["allow_http"])
        if plain_http and not client["allow_http"]:
            raise ConfigError(
                f"endpoint {endpoint!r} is plain HTTP but allow_http is false: use an "
                f"https:// endpoint, or drop allow_http=false"
            )
    elif plain_http:
        client["allow_http"] = True  # an http:// endpoint says so itself
    return client


def retry_options(opts: dict[str, Any]) -> dict[str, Any]:
    """obstore RetryConfig: :data:`DEFAULT_RETRY` unless told otherwise."""
    retry = (
        dict(opts["retry_config"]) if opts.get("retry_config") is not None else dict(DEFAULT_RETRY)
    )
    if opts.get("max_retries") is not None:
        if not isinstance(opts["max_retries"], int) or opts["max_retries"] < 0:
            raise ConfigError(f"max_retries must be an int >= 0, got {opts['max_retries']!r}")
        retry["max_retries"] = opts["max_retries"]
    if opts.get("retry_timeout") is not None:
        retry["retry_timeout"] = as_duration("retry_timeout", opts["retry_timeout"])
    return retry


def chunk_size(opts: dict[str, Any]) -> int:
    value = opts.get("chunk_size", DEFAULT_CHUNK_SIZE)
    if not isinstance(value, int) or value < (5 << 20):
        raise ConfigError(f"chunk_size must be an int >= 5 MiB (S3 part minimum), got {value!r}")
    return value


def obstore_store(
    store_class: Callable[..., _T],
    what: str,
    url: str,
    name: str,
    prefix: str,
    config: dict[str, Any],
    client: dict[str, Any],
    retry: dict[str, Any],
) -> _T:
    """obstore's ``store_class`` (S3Store, AzureStore) for bucket or container ``name``
    under ``prefix``; a ConfigError for ``url`` naming the ``what`` store if obstore
    refuses the settings (its text may dump the configuration: redacted)."""
    try:
        return store_class(
            name, prefix=prefix or None, config=config, client_options=client, retry_config=retry
        )
    except Exception as e:
        raise ConfigError(
            f"cannot configure {what} store for {url!r}: {redact.redact(short(e))}"
        ) from redact.redacted_copy(e)
