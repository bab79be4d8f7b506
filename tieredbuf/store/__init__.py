"""Object storage: one Store contract, chosen by URL scheme.

open_store("s3://bucket/prefix", endpoint=..., region=...)   # obstore S3Store
open_store("az://container/prefix", account_name=...)       # obstore AzureStore (also
    # abfs[s]://container[@account.dfs.core.windows.net]/prefix and
    # https://account.blob.core.windows.net/container/prefix): tieredbuf/store/azure.py
open_store("gs://bucket/prefix")                            # GCSStore, the JSON API through
    # google-cloud-storage (the gcs extra): tieredbuf/store/gcs_open.py, gcs.py
open_store("file:///abs/dir"), open_store("./rel/dir")      # LocalDirStore
open_store("memory://")                                     # fresh, private
open_store("memory://name")                                 # shared by name, per process
"""

from __future__ import annotations

import os
import threading
from typing import Any
from urllib.parse import unquote, urlsplit

from tieredbuf.config import S3_CREDENTIAL_ENV, S3_OPTION_ENV, SECRET_OPTIONS
from tieredbuf.errors import ConfigError, MissingCredentialsError
from tieredbuf.runtime import redact
from tieredbuf.store.azure import AZURE_OPTIONS, AZURE_SCHEMES, is_azure_https, open_azure
from tieredbuf.store.base import (
    DEFAULT_MANIFEST_WRITES_PER_S,
    KEY_LIMITED_MANIFEST_WRITES_PER_S,
    GetResult,
    IfMatch,
    ObjectMeta,
    PutMode,
    Store,
)
from tieredbuf.store.botostore import S3Settings
from tieredbuf.store.gcs_open import GCS_OPTIONS, open_gcs
from tieredbuf.store.localdir import LocalDirStore
from tieredbuf.store.objstore import ObjStore
from tieredbuf.store.options import (
    CLIENT_OPTIONS,
    as_bool,
    check_endpoint,
    client_options,
    obstore_store,
    retry_options,
    string_options,
    url_prefix,
)
from tieredbuf.store.options import chunk_size as chunk_size_option
from tieredbuf.store.settings import store_options_from_env

__all__ = [
    "AZURE_OPTIONS",
    "GCS_OPTIONS",
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

S3_OPTIONS = frozenset(S3_OPTION_ENV) | CLIENT_OPTIONS | {"r2"}
"""Keyword options open_store() accepts for s3:// URLs."""

_SCHEMES = ("s3", "file", "memory", "gs", *AZURE_SCHEMES)
R2_HOST_SUFFIX = ".r2.cloudflarestorage.com"
"""Cloudflare R2's S3 endpoints: ``https://ACCOUNT.r2.cloudflarestorage.com`` (and the
``.eu.`` / ``.fedramp.`` jurisdictions under it)."""

_named_memory: dict[str, Any] = {}
_named_memory_lock = threading.Lock()


def _renew_lock_after_fork() -> None:
    global _named_memory_lock
    _named_memory_lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_lock_after_fork)


def _meant(url: str) -> str:
    """The URL a scheme without ``//`` was meant to be: ``s3:/b/x`` -> ``s3://b/x``,
    ``file:/tmp/x`` -> ``file:///tmp/x``, ``file:rel`` -> ``file://./rel``."""
    scheme, _, rest = url.partition(":")
    if scheme.lower() == "file":
        return f"file://{rest}" if rest.startswith("/") else f"file://./{rest}"
    return f"{scheme}://{rest.lstrip('/')}"


def open_store(url: str, **options: Any) -> Store:
    """The Store for ``url``.  Raises ConfigError for a bad URL or an unknown option."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"store URL must be a non-empty string, got {url!r}")
    if "://" not in url:
        if urlsplit(url).scheme.lower() in _SCHEMES:
            raise ConfigError(f"malformed store URL {url!r}: did you mean {_meant(url)}?")
        _no_options("a local directory", options)
        return LocalDirStore(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise ConfigError(f"store URL {url!r} must not carry a query or fragment")
    if scheme == "s3":
        return _open_s3(url, parts.netloc, parts.path, options)
    if scheme in AZURE_SCHEMES or (scheme == "https" and is_azure_https(parts.hostname)):
        return open_azure(url, options)
    if scheme == "gs":
        return open_gcs(url, parts.netloc, parts.path, options)
    if scheme == "file":
        _no_options("file://", options)
        return LocalDirStore(_file_path(url, parts.netloc, parts.path), url=url)
    if scheme == "memory":
        _no_options("memory://", options)
        return _open_memory(url, parts.netloc, parts.path)
    raise ConfigError(
        f"unsupported store URL scheme {parts.scheme!r} in {url!r}: use s3://, gs://, az:// "
        f"(or abfs://, https://ACCOUNT.blob.core.windows.net/...), file:// or memory://"
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
    prefix = url_prefix(url, path, "S3")
    opts = store_options_from_env(options, S3_OPTION_ENV)
    # from here on, no error, log line or HTTP answer of this process shows them
    redact.register(*(opts.get(k) for k in SECRET_OPTIONS))

    config: dict[str, Any] = string_options(
        opts, ("endpoint", "region", "access_key_id", "secret_access_key", "session_token")
    )
    endpoint = config.get("endpoint")
    if endpoint is not None:
        check_endpoint(endpoint, "access_key_id / secret_access_key or the AWS_* environment")
    skip_signature = as_bool("skip_signature", opts.get("skip_signature", False))
    if skip_signature:
        config["skip_signature"] = True
    instance_metadata = as_bool("instance_metadata", opts.get("instance_metadata", False))
    r2 = as_bool("r2", opts["r2"]) if opts.get("r2") is not None else is_r2_endpoint(endpoint)

    client = client_options(opts, endpoint)
    retry = retry_options(opts)
    chunk_size = chunk_size_option(opts)
    probe = as_bool("probe", opts.get("probe", True))
    _check_credentials(url, config, skip_signature, instance_metadata)

    inner = obstore_store(S3Store, "S3", url, bucket, prefix, config, client, retry)
    settings = S3Settings(
        bucket, prefix, dict(config), dict(client), dict(retry), instance_metadata
    )
    target = (endpoint or "aws", bucket)
    budget = KEY_LIMITED_MANIFEST_WRITES_PER_S if r2 else DEFAULT_MANIFEST_WRITES_PER_S
    return ObjStore(
        inner,
        url,
        probe_target=target if probe else None,
        chunk_size=chunk_size,
        s3=settings,
        manifest_writes_per_s=budget,
    )


def is_r2_endpoint(endpoint: str | None) -> bool:
    """True for a Cloudflare R2 endpoint (about one write per second to one key)."""
    if endpoint is None:
        return False
    host = (urlsplit(endpoint).hostname or "").lower().rstrip(".")
    return host.endswith(R2_HOST_SUFFIX)


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
            ("access_key_id", "secret_access_key")
            if has_id
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
