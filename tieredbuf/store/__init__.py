"""Object storage: one Store contract, chosen by URL scheme.

open_store("s3://bucket/prefix", endpoint=..., region=...)   # obstore S3Store
open_store("file:///abs/dir"), open_store("./rel/dir")      # LocalDirStore
open_store("memory://")                                     # fresh, private
open_store("memory://name")                                 # shared by name, per process
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any
from urllib.parse import unquote, urlsplit

from tieredbuf.config import (
    S3_CREDENTIAL_ENV,
    S3_OPTION_ENV,
    SECRET_OPTIONS,
    store_options_from_env,
)
from tieredbuf.errors import ConfigError, MissingCredentialsError
from tieredbuf.runtime import redact
from tieredbuf.store.base import GetResult, IfMatch, ObjectMeta, PutMode, Store
from tieredbuf.store.botostore import S3Settings
from tieredbuf.store.localdir import LocalDirStore
from tieredbuf.store.objstore import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_RETRY,
    DEFAULT_TIMEOUT,
    ObjStore,
    short,
)

__all__ = [
    "GetResult",
    "IfMatch",
    "LocalDirStore",
    "ObjStore",
    "ObjectMeta",
    "PutMode",
    "S3_OPTIONS",
    "Store",
    "open_store",
]

S3_OPTIONS = frozenset(S3_OPTION_ENV) | {
    "retry_config",
    "max_retries",
    "retry_timeout",
    "timeout",
    "connect_timeout",
    "probe",
    "chunk_size",
}
"""Keyword options open_store() accepts for s3:// URLs."""

_SCHEMES = ("s3", "file", "memory")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

_named_memory: dict[str, Any] = {}
_named_memory_lock = threading.Lock()


def _renew_lock_after_fork() -> None:
    global _named_memory_lock
    _named_memory_lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_lock_after_fork)


def open_store(url: str, **options: Any) -> Store:
    """The Store for ``url``.  Raises ConfigError for a bad URL or an unknown option."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"store URL must be a non-empty string, got {url!r}")
    if "://" not in url:
        if urlsplit(url).scheme.lower() in _SCHEMES:
            raise ConfigError(f"malformed store URL {url!r}: use file:///abs/dir or file://./rel")
        _no_options("a local directory", options)
        return LocalDirStore(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise ConfigError(f"store URL {url!r} must not carry a query or fragment")
    if scheme == "s3":
        return _open_s3(url, parts.netloc, parts.path, options)
    if scheme == "file":
        _no_options("file://", options)
        return LocalDirStore(_file_path(url, parts.netloc, parts.path), url=url)
    if scheme == "memory":
        _no_options("memory://", options)
        return _open_memory(url, parts.netloc, parts.path)
    raise ConfigError(
        f"unsupported store URL scheme {parts.scheme!r} in {url!r}: use s3://, file:// or memory://"
    )


def _no_options(what: str, options: dict[str, Any]) -> None:
    if options:
        raise ConfigError(f"unknown option(s) for {what} store: {', '.join(sorted(options))}")


def _file_path(url: str, netloc: str, path: str) -> str:
    path = unquote(path)
    if netloc in ("", "localhost"):
        if not path.startswith("/"):
            raise ConfigError(f"file URL {url!r} needs an absolute path (file:///abs/dir)")
        return path
    if netloc in (".", ".."):
        return netloc + path  # file://./rel -> ./rel
    raise ConfigError(
        f"file URL {url!r} names host {netloc!r}; use file:///abs/dir or file://./rel/dir"
    )


def _open_memory(url: str, netloc: str, path: str) -> Store:
    from obstore.store import MemoryStore

    if path not in ("", "/"):
        raise ConfigError(f"memory URL {url!r} takes only a name: memory://name")
    if not netloc:
        return ObjStore(MemoryStore(), url)
    with _named_memory_lock:
        inner = _named_memory.get(netloc)
        if inner is None:
            inner = _named_memory[netloc] = MemoryStore()
    return ObjStore(inner, url)


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"option {name} must be a bool or 'true'/'false', got {value!r}")


def _as_duration(name: str, value: Any) -> timedelta:
    if isinstance(value, timedelta):
        d = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        d = timedelta(seconds=value)
    else:
        raise ConfigError(f"option {name} must be a timedelta or seconds, got {value!r}")
    if d <= timedelta(0):
        raise ConfigError(f"option {name} must be positive, got {value!r}")
    return d


def _check_endpoint(endpoint: str) -> None:
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
        raise ConfigError("the endpoint URL must not carry credentials: use "
                          "access_key_id / secret_access_key or the AWS_* environment")
    if parts.query or parts.fragment:
        raise ConfigError(f"endpoint {endpoint!r} must not carry a query or a fragment")


def _open_s3(url: str, bucket: str, path: str, options: dict[str, Any]) -> Store:
    from obstore.store import S3Store

    unknown = set(options) - S3_OPTIONS
    if unknown:
        raise ConfigError(
            f"unknown option(s) for s3:// store: {', '.join(sorted(unknown))}; "
            f"known: {', '.join(sorted(S3_OPTIONS))}"
        )
    if not bucket:
        raise ConfigError(f"S3 URL {url!r} names no bucket: s3://bucket/prefix")
    prefix = unquote(path).strip("/")
    if "//" in prefix or any(p in (".", "..") for p in prefix.split("/")):
        raise ConfigError(f"S3 URL {url!r} has an invalid prefix {prefix!r}")
    opts = store_options_from_env(options)
    # from here on, no error, log line or HTTP answer of this process shows them
    redact.register(*(opts.get(k) for k in SECRET_OPTIONS))

    config: dict[str, Any] = {}
    for name in ("endpoint", "region", "access_key_id", "secret_access_key", "session_token"):
        value = opts.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise ConfigError(f"option {name} must be a string, got {value!r}")
            config[name] = value
    endpoint = config.get("endpoint")
    if endpoint is not None:
        _check_endpoint(endpoint)
    skip_signature = _as_bool("skip_signature", opts.get("skip_signature", False))
    if skip_signature:
        config["skip_signature"] = True
    instance_metadata = _as_bool("instance_metadata", opts.get("instance_metadata", False))

    client: dict[str, Any] = {
        "connect_timeout": _as_duration("connect_timeout", opts.get("connect_timeout"))
        if opts.get("connect_timeout") is not None
        else DEFAULT_CONNECT_TIMEOUT,
        "timeout": _as_duration("timeout", opts["timeout"])
        if opts.get("timeout") is not None
        else DEFAULT_TIMEOUT,
    }
    plain_http = endpoint is not None and endpoint.startswith("http://")
    if opts.get("allow_http") is not None:
        client["allow_http"] = _as_bool("allow_http", opts["allow_http"])
        if plain_http and not client["allow_http"]:
            raise ConfigError(
                f"endpoint {endpoint!r} is plain HTTP but allow_http is false: use an "
                f"https:// endpoint, or drop allow_http=false"
            )
    elif plain_http:
        client["allow_http"] = True  # an http:// endpoint says so itself

    retry = (
        dict(opts["retry_config"]) if opts.get("retry_config") is not None else dict(DEFAULT_RETRY)
    )
    if opts.get("max_retries") is not None:
        if not isinstance(opts["max_retries"], int) or opts["max_retries"] < 0:
            raise ConfigError(f"max_retries must be an int >= 0, got {opts['max_retries']!r}")
        retry["max_retries"] = opts["max_retries"]
    if opts.get("retry_timeout") is not None:
        retry["retry_timeout"] = _as_duration("retry_timeout", opts["retry_timeout"])

    chunk_size = opts.get("chunk_size", DEFAULT_CHUNK_SIZE)
    if not isinstance(chunk_size, int) or chunk_size < (5 << 20):
        raise ConfigError(
            f"chunk_size must be an int >= 5 MiB (S3 part minimum), got {chunk_size!r}"
        )
    probe = _as_bool("probe", opts.get("probe", True))
    _check_credentials(url, config, skip_signature, instance_metadata)

    try:
        inner = S3Store(
            bucket,
            prefix=prefix or None,
            config=config,  # type: ignore[arg-type]
            client_options=client,  # type: ignore[arg-type]
            retry_config=retry,  # type: ignore[arg-type]
        )
    except Exception as e:  # obstore's text may dump the configuration: redacted
        raise ConfigError(
            f"cannot configure S3 store for {url!r}: {redact.redact(short(e))}"
        ) from redact.redacted_copy(e)
    settings = S3Settings(bucket, prefix, dict(config), dict(client), dict(retry),
                          instance_metadata)
    target = (endpoint or "aws", bucket)
    return ObjStore(inner, url, probe_target=target if probe else None, chunk_size=chunk_size,
                    s3=settings)


def _check_credentials(
    url: str, config: dict[str, Any], skip_signature: bool, instance_metadata: bool
) -> None:
    """Refuse an s3:// URL with no credential source, before any request.

    Without static keys obstore would ask the cloud instance metadata service
    (169.254.169.254) and fail, or hang, far from the cause.  That service is used only
    when asked (``instance_metadata=True``).
    """
    has_id, has_secret = "access_key_id" in config, "secret_access_key" in config
    if has_id and has_secret:
        return
    if has_id != has_secret:
        given, missing = (
            ("access_key_id", "secret_access_key") if has_id
            else ("secret_access_key", "access_key_id")
        )
        raise MissingCredentialsError(
            f"incomplete S3 credentials for {url}: {given} is set but {missing} is not "
            f"(set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY together)"
        )
    if skip_signature or instance_metadata:
        return
    if any(os.environ.get(name) for name in S3_CREDENTIAL_ENV):
        return
    raise MissingCredentialsError(
        f"no S3 credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
        f"pass access_key_id= / secret_access_key=); on EC2/ECS/EKS pass "
        f"instance_metadata=True (or set TIEREDBUF_S3_INSTANCE_METADATA=1) to use the "
        f"machine's role; skip_signature=True for a public bucket"
    )
