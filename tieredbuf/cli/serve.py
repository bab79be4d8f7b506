"""``tieredbuf serve``: check the options once, then run the supervisor."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, TextIO

import tieredbuf
from tieredbuf.cli._common import (
    store_opts,
)
from tieredbuf.errors import ConfigError, PermanentStoreError, StoreError

log = logging.getLogger(__name__)


def _abspath(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def cmd_serve(args: argparse.Namespace, out: TextIO) -> int:
    from tieredbuf.service.auth import check_exposure
    from tieredbuf.service.config import ServiceConfig
    from tieredbuf.service.supervisor import serve
    from tieredbuf.service.tls import tls_context
    from tieredbuf.service.tokens import TokenSet

    store: dict[str, Any] = store_opts(args)
    producer: dict[str, Any] = {}
    for opt, key in (
        ("max_open_duration", "max_open_duration"),
        ("wal_flush_interval", "flush_interval"),
    ):
        v = getattr(args, opt)
        if v is not None:
            producer[key] = v.total_seconds()
    if args.manifest_writes_per_s is not None:
        if args.manifest_writes_per_s < 0:
            raise ConfigError(
                f"--manifest-writes-per-s must be >= 0, got {args.manifest_writes_per_s:g}"
            )
        producer["manifest_writes_per_s"] = args.manifest_writes_per_s
    for opt, key in (
        ("segment_size", "target_size"),
        ("size_cap", "size_cap"),
        ("size_cap_policy", "size_cap_policy"),
    ):
        v = getattr(args, opt)
        if v is not None:
            producer[key] = v
    with tieredbuf.open(args.url, **store) as buf:  # a bad URL or option fails here, exit 2
        try:  # a store that can never work (bucket, credentials) is exit 3 before binding
            buf.check_store()
        except PermanentStoreError:
            raise
        except StoreError as e:  # unreachable now: the stage holds writes until it works
            log.warning("the store does not answer yet (serving; writes stay staged): %s", e)
    config = ServiceConfig(
        url=args.url,
        staging_dir=args.staging,
        host=args.host,
        port=args.port,
        workers=args.workers or os.cpu_count() or 1,
        store_options=store,
        producer_options=producer,
        max_body_bytes=args.max_body,
        max_records=args.max_records,
        header_timeout_s=args.header_timeout.total_seconds(),
        body_timeout_s=args.body_timeout.total_seconds(),
        idle_timeout_s=args.idle_timeout.total_seconds(),
        max_connections=args.max_connections,
        backpressure_wait_s=args.backpressure_wait.total_seconds(),
        remote_timeout_s=args.remote_timeout.total_seconds(),
        shutdown_timeout_s=args.shutdown_timeout.total_seconds(),
        drain_timeout_s=args.drain_timeout.total_seconds(),
        store_check_s=args.store_check_interval.total_seconds(),
        token_file=_abspath(args.token_file),
        protect_metrics=args.protect_metrics,
        protect_health=args.protect_health,
        tls_cert=_abspath(args.tls_cert),
        tls_key=_abspath(args.tls_key),
        insecure=args.insecure,
    )
    # what the workers will load, checked once here: a bad token file, certificate or
    # an exposed port without tokens is exit 2 before anything binds
    tokens = TokenSet.from_config(config.token_file)
    if config.tls_cert is not None:
        tls_context(config.tls_cert, config.tls_key)
    check_exposure(config.host, tokens, config.insecure, config.tls_cert is not None)
    return serve(config, out, tokens)
