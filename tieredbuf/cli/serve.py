"""``tieredbuf serve``: check the options once, then run the supervisor."""

from __future__ import annotations

import argparse
import logging
import os
from datetime import timedelta
from typing import Any, TextIO

import tieredbuf
from tieredbuf.cli._common import parse_duration, parse_size, store_args, store_opts
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


def add_parser(sub: Any) -> None:
    """``tieredbuf serve``'s options (docs/operations.md, "The ingest service")."""
    sv = sub.add_parser("serve", help="HTTP ingest service: POST /v1/produce, /metrics")
    sv.add_argument("url")
    sv.add_argument(
        "--staging", required=True, metavar="DIR", help="stage root; worker i uses DIR/worker-<i>"
    )
    sv.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    sv.add_argument("--port", type=int, default=8080, help="TCP port; 0: any free port (printed)")
    sv.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="worker processes (default 0: one per CPU)",
    )
    sv.add_argument(
        "--max-body",
        type=parse_size,
        default=16 << 20,
        metavar="SIZE",
        help="largest request body, e.g. 16MiB, as sent and decoded; larger: 413 (default 16MiB)",
    )
    sv.add_argument(
        "--max-records",
        type=int,
        default=100_000,
        metavar="N",
        help="most records (ndjson lines, octet-stream frames) per request; "
        "more: 413 (default 100000)",
    )
    sv.add_argument(
        "--backpressure-wait",
        type=parse_duration,
        metavar="DURATION",
        default=timedelta(milliseconds=500),
        help="wait at a stage cap, then 503",
    )
    sv.add_argument(
        "--remote-timeout",
        type=parse_duration,
        default=timedelta(seconds=30),
        metavar="DURATION",
        help="durability=remote requests wait this long for export, then 504",
    )
    sv.add_argument(
        "--shutdown-timeout",
        type=parse_duration,
        default=timedelta(seconds=30),
        metavar="DURATION",
        help="on SIGTERM: time for in-flight requests",
    )
    sv.add_argument(
        "--drain-timeout",
        type=parse_duration,
        default=timedelta(minutes=5),
        metavar="DURATION",
        help="on SIGTERM: time to seal and export the stage",
    )
    sv.add_argument(
        "--store-check-interval",
        type=parse_duration,
        default=timedelta(seconds=30),
        metavar="DURATION",
        help="while /readyz is asked, check the store (one LIST) at most this often: a "
        "missing bucket or rejected credentials make /readyz 503 (default 30s)",
    )
    g4 = sv.add_argument_group("connections (see docs/operations.md: limits and timeouts)")
    g4.add_argument(
        "--header-timeout",
        type=parse_duration,
        default=timedelta(seconds=10),
        metavar="DURATION",
        help="a request head (and a TLS handshake) must "
        "arrive within this long, or the connection is closed (default 10s)",
    )
    g4.add_argument(
        "--body-timeout",
        type=parse_duration,
        default=timedelta(seconds=60),
        metavar="DURATION",
        help="a request body must arrive within this long of its head, or 408 (default 60s)",
    )
    g4.add_argument(
        "--idle-timeout",
        type=parse_duration,
        default=timedelta(seconds=75),
        metavar="DURATION",
        help="close a kept-alive connection idle this long (default 75s)",
    )
    g4.add_argument(
        "--max-connections",
        type=int,
        default=512,
        metavar="N",
        help="open connections per worker; more: 503 and closed (default 512)",
    )
    g2 = sv.add_argument_group("stage (see docs/operations.md: sizing the stage)")
    g2.add_argument(
        "--max-open-duration",
        type=parse_duration,
        metavar="DURATION",
        help="seal an open segment after this long (default 5s): REMOTE latency",
    )
    g2.add_argument(
        "--wal-flush-interval",
        type=parse_duration,
        metavar="DURATION",
        help="WAL group-commit window (default 25ms): LOCAL latency",
    )
    g2.add_argument(
        "--segment-size", type=parse_size, metavar="SIZE", help="seal at this size (default 32MiB)"
    )
    g2.add_argument(
        "--size-cap", type=parse_size, metavar="SIZE", help="stage disk cap (default 16GiB)"
    )
    g2.add_argument(
        "--size-cap-policy",
        choices=("backpressure", "drop_oldest"),
        help="at the cap: wait (then 503), or drop the oldest sealed segment "
        "(default backpressure)",
    )
    g2.add_argument(
        "--manifest-writes-per-s",
        type=float,
        metavar="N",
        help="manifest appends per second per buffer, shared by every writer "
        "(default: the store's, 1 on Cloudflare R2, else 5; 0: unpaced): "
        "REMOTE latency vs PUT cost",
    )
    g3 = sv.add_argument_group(
        "security (see docs/operations.md: securing the service)",
        "Tokens: --token-file, or $TIEREDBUF_SERVICE_TOKENS (comma-separated).  A host "
        "other than loopback needs tokens unless --insecure.",
    )
    g3.add_argument(
        "--token-file",
        metavar="FILE",
        help="bearer tokens, one per line; re-read when it changes "
        "and on SIGHUP (rotation without a restart)",
    )
    g3.add_argument(
        "--protect-metrics", action="store_true", help="require a token on /metrics too"
    )
    g3.add_argument(
        "--protect-health", action="store_true", help="require a token on /healthz and /readyz too"
    )
    g3.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve HTTPS")
    g3.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    g3.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback --host without tokens"
    )
    store_args(sv)
    sv.set_defaults(fn=cmd_serve)
