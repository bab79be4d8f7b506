"""Looking after a buffer: ``tieredbuf inspect``, ``gc``, ``grace`` and ``create-container``."""

from __future__ import annotations

import argparse
import builtins
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

import tieredbuf
from tieredbuf import gc as gc_mod
from tieredbuf.cli._common import (
    EXIT_OK,
    EXIT_PARTIAL,
    Progress,
    one_line,
    open_buffer,
    open_existing,
    store_opts,
)
from tieredbuf.errors import BufferNotFoundError, ConfigError
from tieredbuf.queue.subscribers import listing as subscriber_listing
from tieredbuf.store.azure import is_azure_url
from tieredbuf.store.azure_admin import create_container


def inspect_buffer(buf: tieredbuf.Buffer, *, verify: bool = True) -> dict[str, Any]:
    """The figures ``tieredbuf inspect`` shows.

    Depth, bytes, age and tree shape come from the root (plus one group GET per level);
    ``verify`` also lists ``data/`` and checks every queued entry's object exists.
    """
    snap = buf.snapshot()
    if not snap.exists:  # a mistyped URL is an error, never an empty buffer
        raise BufferNotFoundError(buf.url, "a reader never creates one")
    root = snap.root
    now_ms = time.time_ns() // 1_000_000
    head = next(iter(snap.iter_from(snap.head)), None) if snap.footer.entry_count else None
    oldest = min((m.ingestion_time_ms for m in head.metadata), default=None) if head else None
    levels: dict[str, int] = {"root_entries": root.n_entries}
    for r in root.refs:
        name = {0: "group", 1: "kgroup", 2: "mgroup"}.get(r.level, f"level{r.level}")
        levels[f"{name}_refs"] = levels.get(f"{name}_refs", 0) + 1
    info: dict[str, Any] = {
        "url": buf.url,
        "first_sequence": snap.footer.first_sequence,
        "next_sequence": snap.footer.next_sequence,
        "depth": snap.footer.entry_count,
        "queued_bytes": snap.total_bytes,
        "retained_from": snap.low,
        "epoch": snap.footer.epoch,
        "manifest_version": snap.footer.version,
        "manifest_bytes": len(snap.view.raw),
        "tree_levels": 1 + (max(r.level for r in root.refs) + 1 if root.refs else 0),
        "tree": levels,
        "producer_watermarks": len(snap.view.watermarks),
        "buffer_id": snap.buffer_id,
        "gc_grace_s": None if snap.gc_grace_ms is None else snap.gc_grace_ms / 1000,
        "oldest_age_s": None if oldest is None else round((now_ms - oldest) / 1000, 3),
        "subscribers": {
            s.name: {
                "next_sequence": s.next_sequence,
                "lag_entries": s.lag_entries,
                "lag_bytes": s.lag_bytes,
                "shared": s.shared,
            }
            for s in subscriber_listing(buf.queue, snap=snap)
        }
        if snap.exists
        else {},
    }
    if verify:
        with Progress("inspect: listing data/") as bar:
            sizes = {}
            for m in buf.store.list("data/"):
                sizes[m.key] = m.size
                bar.update()
            missing = 0
            bar.label, bar.done = "inspect: checking entries", 0
            for e in snap.iter_from(snap.head):
                missing += e.location not in sizes
                bar.update()
        info["stored_objects"] = len(sizes)
        info["missing_objects"] = missing
    return info


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    buf = open_buffer(args)
    info = inspect_buffer(buf, verify=not args.quick)  # no buffer: exit 2, from its root GET
    # what this inspection itself cost: the store requests of this process, by
    # operation and object kind (a service's totals are in its /metrics)
    info["requests"] = buf.requests.as_dict()
    if args.json:
        out.write(json.dumps(info) + "\n")
        return EXIT_OK
    text = dict(info)
    text["requests"] = {"total": info["requests"]["total"], **info["requests"]["by_op"]}
    width = max(len(k) for k in text)
    for k, v in text.items():
        if k == "subscribers":
            v = (
                ", ".join(
                    f"{name} (next {d['next_sequence']}, lag {d['lag_entries']})"
                    for name, d in v.items()
                )
                or "none"
            )
        elif isinstance(v, dict):
            v = ", ".join(f"{name} {n}" for name, n in v.items())
        out.write(f"{k.ljust(width)}  {v}\n")
    return EXIT_OK


class _CountingStore:
    """Wraps a store so a GC pass over a large listing can show progress."""

    def __init__(self, store: Any, bar: Progress) -> None:
        self._store, self._bar = store, bar

    def list(self, prefix: str) -> Iterator[Any]:
        for m in self._store.list(prefix):
            self._bar.update(1, f"listing {prefix}")
            yield m

    def delete_many(self, keys: builtins.list[str]) -> Any:
        self._bar.update(0, f"deleting {len(keys)}")
        return self._store.delete_many(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class _GcView:
    """The part of a Buffer that gc.run_once uses, with a counting store."""

    def __init__(self, buf: tieredbuf.Buffer, bar: Progress) -> None:
        self._buf = buf
        self.store = _CountingStore(buf.store, bar)
        self.queue = buf.queue  # refreshes the subscribers' published positions first

    def snapshot(self) -> Any:
        return self._buf.snapshot()


def _write_gc_metrics(args: argparse.Namespace, report: Any, seconds: float) -> None:
    from prometheus_client import CollectorRegistry, push_to_gateway, write_to_textfile

    from tieredbuf.ops.metrics import GcMetrics

    registry = CollectorRegistry()
    gcm = GcMetrics()
    gcm.observe(report, seconds)
    registry.register(gcm)
    if args.metrics_file:
        folder = os.path.dirname(os.path.abspath(args.metrics_file))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"the folder of --metrics-file ({folder}) does not exist")
        write_to_textfile(args.metrics_file, registry)  # atomic: temp file + rename
    if args.pushgateway:
        push_to_gateway(args.pushgateway, job="tieredbuf_gc", registry=registry)


def _gc_output(args: argparse.Namespace, report: Any, seconds: float, out: TextIO) -> str | None:
    """Write one pass's report (and its metrics); the metrics failure, if any."""
    metrics_failed = None
    if args.metrics_file or args.pushgateway:
        try:
            _write_gc_metrics(args, report, seconds)
        except (OSError, ValueError) as e:  # URLError, a bad HOST:PORT: summary, exit 1
            reason = getattr(e, "reason", None)  # URLError wraps the socket's error
            cause = reason if isinstance(reason, BaseException) else e
            where = f" to {args.pushgateway}" if args.pushgateway else ""
            text = getattr(cause, "strerror", None) or one_line(cause)
            metrics_failed = f"metrics not written{where}: {text}"
    if args.json:
        d = report.as_dict()
        d["deleted_keys"] = d["deleted_keys"][:1000]
        d["seconds"] = round(seconds, 3)
        out.write(json.dumps(d) + "\n")
    else:
        verb = "would delete" if args.dry_run else "deleted"
        n = report.candidates if args.dry_run else report.deleted
        out.write(
            f"listed {report.listed}, referenced {report.referenced}, {verb} {n}, "
            f"failed {report.failed}, kept (young) {report.kept_young}, "
            f"kept (newer than oldest entry) {report.kept_newer_than_oldest}, "
            f"groups deleted {report.groups_deleted}, "
            f"requests {sum(report.requests.values())} "
            f"(groups read {report.groups_read}, cached {report.groups_cached})\n"
        )
    out.flush()
    if metrics_failed:
        print(f"tieredbuf: {metrics_failed}", file=sys.stderr)
    return metrics_failed


def cmd_gc(args: argparse.Namespace, out: TextIO) -> int:
    buf = open_existing(args)
    if args.loop is not None:
        return _gc_loop(args, buf, out)
    t0 = time.monotonic()
    with Progress("gc: objects") as bar:
        report = gc_mod.run_once(_GcView(buf, bar), grace=args.grace, dry_run=args.dry_run)
    metrics_failed = _gc_output(args, report, time.monotonic() - t0, out)
    return EXIT_PARTIAL if report.failed or metrics_failed else EXIT_OK


def _gc_loop(args: argparse.Namespace, buf: tieredbuf.Buffer, out: TextIO) -> int:
    """``gc --loop INTERVAL``: a pass every INTERVAL until SIGTERM or SIGINT; groups read
    once are cached across passes (gc.run_forever)."""
    import signal

    from tieredbuf.runtime.signals import SignalEvent

    stop = SignalEvent()  # a threading.Event set from a handler may deadlock its waiter
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def on_report(report: gc_mod.GcReport, seconds: float) -> None:
        _gc_output(args, report, seconds, out)

    gc_mod.run_forever(
        buf,
        interval=args.loop,
        stop=stop,
        grace=args.grace,
        dry_run=args.dry_run,
        on_report=on_report,
    )
    return EXIT_OK


def cmd_grace(args: argparse.Namespace, out: TextIO) -> int:
    """Show the buffer's GC grace period (root section 6), or set it (one CAS)."""
    buf = open_buffer(args)
    if not buf.exists():
        raise tieredbuf.BufferNotFoundError(buf.url)
    if args.duration is not None:
        buf.set_gc_grace_period(args.duration, force=args.force)
        if args.force and args.duration < 2 * buf.tree_config.link_deadline:
            print(
                f"tieredbuf: warning: a GC grace period of {args.duration} is under twice "
                "the link deadline: GC may delete an object a slow writer is still linking "
                "(use it only while no writer runs)",
                file=sys.stderr,
            )
    out.write(f"{buf.gc_grace_period}\n")  # None: an older root (GC: --grace, else 10m)
    return EXIT_OK


def cmd_create_container(args: argparse.Namespace, out: TextIO) -> int:
    """Create the Azure container of ``args.url`` (obstore cannot): fine if it exists."""
    if not is_azure_url(args.url):
        raise ConfigError(
            f"create-container is for Azure URLs (az://container/prefix), not {args.url}: "
            f"make an S3 bucket with the aws CLI (aws s3 mb s3://BUCKET) or the store's "
            f"console; a local directory needs nothing"
        )
    created, where = create_container(args.url, timeout=args.timeout, **store_opts(args))
    container = args.url.split("://", 1)[1].split("/", 1)[0].split("@", 1)[0]
    if created:
        print(f"created container {container!r} at {where}", file=out)
    else:
        print(f"container {container!r} already exists at {where}", file=out)
    return EXIT_OK
