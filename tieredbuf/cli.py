"""The ``tieredbuf`` command.

    tieredbuf demo [URL]                 produce, land as objects + manifest entries, consume back
    tieredbuf produce URL [FILE ...]     one record per input line (stdin when no FILE)
    tieredbuf consume URL [--no-ack] [--follow] [--json] [--out DIR|F.arrow|F.parquet]
                                         print records and bundles (or write them), then ack
    tieredbuf inspect URL [--json]       sequence range, depth, bytes, epoch, oldest age
    tieredbuf entries URL [--from SEQ] [--limit N] [--json]   list the queue (read-only)
    tieredbuf retention URL [--max-age D] [--max-bytes S | --none]   show or set retention
    tieredbuf subscribers URL [--json]   each subscriber's position, lag, epoch; rejected entries
    tieredbuf subscribers remove URL NAME   unregister one (releases what it held)
    tieredbuf gc URL [--grace 1h] [--dry-run] [--json]   (grace: the buffer's unless longer)
    tieredbuf grace URL [DURATION] [--force]  show (or set) the buffer's GC grace period
    tieredbuf drain STAGE_DIR URL [--timeout 15m]   take over a dead producer's stage: replay,
                                         export, empty it
    tieredbuf serve URL --staging DIR    HTTP ingest service (POST /v1/produce), N worker processes
                                         [--token-file F] [--tls-cert C --tls-key K] [--insecure]

Exit codes: 0 success; 1 partial failure (gc: some deletes failed, retried next run, or
its metrics could not be written or pushed; drain: a live producer holds a stage); 2 bad
usage or configuration (a wrong URL or scheme, missing credentials, no buffer at a URL
that is read, no stage in the directory, a stage that belongs to another buffer, a port
in use, a missing input file); 3 the store or the data failed
(credentials rejected, access denied, missing bucket, still unreachable at --timeout,
corrupt, fenced).  Every failure is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import builtins
import json
import logging
import os
import re
import sys
import time
import typing
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import tieredbuf
from tieredbuf import gc as gc_mod
from tieredbuf.cli_consume import plural
from tieredbuf.errors import BufferNotFoundError, ConfigError, TieredBufError
from tieredbuf.queue.subscribers import listing as subscriber_listing
from tieredbuf.redact import redact

EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``1048576``, ``64k``, ``16MiB``, ``4G`` (binary units)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 64k, 16MiB, 4G")
    unit = m.group(2).lower().rstrip("b").rstrip("i")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


class Progress:
    """One self-erasing status line on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, total: int | None = None, stream: TextIO | None = None,
                 interval: float = 0.1) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.label, self.total, self.interval = label, total, interval
        self.done = 0
        self.extra = ""
        self._drawn = 0.0
        self._width = 0

    def update(self, n: int = 1, extra: str | None = None) -> None:
        self.done += n
        if extra is not None:
            self.extra = extra
        now = time.monotonic()
        if self.enabled and now - self._drawn >= self.interval:
            self._drawn = now
            self._draw()

    def _draw(self) -> None:
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 20)
            text = f"{self.label} [{bar:<20}] {self.done}/{self.total}"
        else:
            text = f"{self.label} {self.done}"
        if self.extra:
            text += f"  {self.extra}"
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_duration(text: str) -> timedelta:
    """``500ms``, ``30s``, ``10m``, ``2h``, ``1d``."""
    if text.strip() == "0":  # zero needs no unit
        return timedelta(0)
    m = _DURATION.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 500ms, 30s, 10m, 2h")
    return timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])


def _store_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("S3 options (default: the standard AWS_* environment)")
    g.add_argument("--endpoint", metavar="URL",
                   help="S3 endpoint URL, e.g. http://127.0.0.1:9000 for MinIO (default: "
                        "AWS_ENDPOINT_URL, else AWS)")
    g.add_argument("--region", help="S3 region (default: AWS_REGION / AWS_DEFAULT_REGION)")
    g.add_argument("--allow-http", action="store_true", default=None,
                   help="allow plain HTTP (implied by an http:// endpoint; AWS_ALLOW_HTTP)")
    g.add_argument("--instance-metadata", action="store_true", default=None,
                   help="take credentials from the cloud instance metadata service (EC2 role)")
    g.add_argument("--skip-signature", action="store_true", default=None,
                   help="send unsigned requests (a public bucket)")


def _open(args: argparse.Namespace) -> tieredbuf.Buffer:
    opts: dict[str, Any] = {}
    if args.url.startswith("s3://"):
        opts = _s3_opts(args)
    return tieredbuf.open(args.url, **opts)


def _open_existing(args: argparse.Namespace) -> tieredbuf.Buffer:
    """A buffer that must exist: a mistyped URL is BufferNotFoundError (exit 2), never
    an empty buffer read (or created) in its place."""
    from tieredbuf.cli_consume import require_buffer

    buf = _open(args)
    require_buffer(buf)
    return buf


_S3_FLAGS = ("endpoint", "region", "allow_http", "instance_metadata", "skip_signature")


def _s3_opts(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _S3_FLAGS if getattr(args, k, None) is not None}


def _lines(files: Sequence[str]) -> Iterator[bytes]:
    if not files:
        for line in sys.stdin.buffer:
            yield line.rstrip(b"\r\n")
        return
    for f in files:
        if f == "-":
            yield from _lines([])
            continue
        with open(f, "rb") as fh:
            for line in fh:
                yield line.rstrip(b"\r\n")


def cmd_produce(args: argparse.Namespace, out: TextIO) -> int:
    missing = [f for f in args.files if f != "-" and not os.path.isfile(f)]
    if missing:  # before anything is produced: half an input is worse than none
        raise ConfigError(f"input file {missing[0]!r} does not exist (or is not a file)"
                          + (f", nor {len(missing) - 1} more" if len(missing) > 1 else ""))
    buf = _open(args)
    producer = buf.producer(flush_interval=args.flush_interval)
    handles, chunk, n = [], [], 0
    for rec in _lines(args.files):
        chunk.append(rec)
        if len(chunk) >= args.batch:
            handles.append(producer.produce(chunk, metadata=args.metadata.encode()))
            n += len(chunk)
            chunk = []
    if chunk:
        handles.append(producer.produce(chunk, metadata=args.metadata.encode()))
        n += len(chunk)
    producer.close()
    seqs = sorted({h.wait().sequence for h in handles} - {None})
    span = f"sequences {seqs[0]}..{seqs[-1]}" if seqs else "nothing"
    print(f"produced {n} {plural(n, 'record')} in {len(handles)} {plural(len(handles), 'call')}"
          f" -> {span}", file=out)
    return EXIT_OK


def cmd_consume(args: argparse.Namespace, out: TextIO) -> int:
    from tieredbuf.cli_consume import cmd_consume as run

    return run(args, out, _open, Progress)


def cmd_entries(args: argparse.Namespace, out: TextIO) -> int:
    from tieredbuf.cli_queue import cmd_entries as run

    return run(args, out, _open_existing)


def cmd_retention(args: argparse.Namespace, out: TextIO) -> int:
    from tieredbuf.cli_queue import cmd_retention as run

    return run(args, out, _open_existing)


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
            s.name: {"next_sequence": s.next_sequence, "lag_entries": s.lag_entries,
                     "lag_bytes": s.lag_bytes, "shared": s.shared}
            for s in subscriber_listing(buf.queue, snap=snap)
        } if snap.exists else {},
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
    buf = _open(args)
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
            v = ", ".join(f"{name} (next {d['next_sequence']}, lag {d['lag_entries']})"
                          for name, d in v.items()) or "none"
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

    from tieredbuf.metrics import GcMetrics

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


def cmd_gc(args: argparse.Namespace, out: TextIO) -> int:
    buf = _open_existing(args)
    t0 = time.monotonic()
    with Progress("gc: objects") as bar:
        report = gc_mod.run_once(_GcView(buf, bar), grace=args.grace, dry_run=args.dry_run)
    metrics_failed = None
    if args.metrics_file or args.pushgateway:
        try:
            _write_gc_metrics(args, report, time.monotonic() - t0)
        except OSError as e:  # URLError too: the summary still prints, exit 1
            metrics_failed = f"metrics not written: {_one_line(e)}"
    if args.json:
        d = report.as_dict()
        d["deleted_keys"] = d["deleted_keys"][:1000]
        d["seconds"] = round(time.monotonic() - t0, 3)
        out.write(json.dumps(d) + "\n")
    else:
        verb = "would delete" if args.dry_run else "deleted"
        n = report.candidates if args.dry_run else report.deleted
        out.write(
            f"listed {report.listed}, referenced {report.referenced}, {verb} {n}, "
            f"failed {report.failed}, kept (young) {report.kept_young}, "
            f"kept (newer than oldest entry) {report.kept_newer_than_oldest}, "
            f"groups deleted {report.groups_deleted}\n"
        )
    if metrics_failed:
        print(f"tieredbuf: {metrics_failed}", file=sys.stderr)
    return EXIT_PARTIAL if report.failed or metrics_failed else EXIT_OK


def cmd_grace(args: argparse.Namespace, out: TextIO) -> int:
    """Show the buffer's GC grace period (root section 6), or set it (one CAS)."""
    buf = _open(args)
    if not buf.exists():
        raise tieredbuf.BufferNotFoundError(buf.url)
    if args.duration is not None:
        buf.set_gc_grace_period(args.duration, force=args.force)
        if args.force and args.duration < 2 * buf.tree_config.link_deadline:
            print(f"tieredbuf: warning: a GC grace period of {args.duration} is under twice "
                  "the link deadline: GC may delete an object a slow writer is still linking "
                  "(use it only while no writer runs)", file=sys.stderr)
    out.write(f"{buf.gc_grace_period}\n")  # None: an older root (GC: --grace, else 10m)
    return EXIT_OK


def _subscribers(args: argparse.Namespace, out: TextIO) -> int:
    from tieredbuf.cli_subscribers import cmd_subscribers

    return cmd_subscribers(args, out, _open)


DEMO_URL, DEMO_STAGE = "file://./demo-buffer", "./demo-stage"


def demo_stage(url: str) -> str:
    """The demo's default stage: ``./demo-stage`` for the default URL, else
    ``./demo-stage-<12 hex digits of the URL>`` (a stage belongs to one buffer)."""
    import hashlib

    from tieredbuf.stage_binding import canonical_url

    if canonical_url(url) == canonical_url(DEMO_URL):
        return DEMO_STAGE
    return f"{DEMO_STAGE}-{hashlib.sha256(canonical_url(url).encode()).hexdigest()[:12]}"


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    """Stage records locally, export them as objects + manifest entries, consume them back."""
    buf = tieredbuf.open(args.url)
    if args.staging is None:  # one stage per demo URL: never one URL's records in another
        args.staging = demo_stage(args.url)
    waves, calls, per_call = 5, args.calls // 5 or 1, 10
    total = waves * calls * per_call
    print(f"buffer: {buf.url}   stage: {args.staging}", file=out)
    t0 = time.perf_counter()
    with buf.producer(staging_dir=args.staging) as producer:
        for w in range(waves):
            t = time.perf_counter()
            handles = [
                producer.produce(
                    [f"record {w}.{i}.{j}".encode() for j in range(per_call)],
                    metadata=f"wave {w} call {i}".encode(),
                )
                for i in range(calls)
            ]
            handles[-1].wait(tieredbuf.Durability.LOCAL)
            t_local = time.perf_counter() - t
            producer.flush()  # seal the open segment and wait for the exporter
            remote = handles[-1].wait(tieredbuf.Durability.REMOTE)
            print(
                f"  wave {w}: {calls * per_call} records LOCAL (fdatasync) in "
                f"{t_local * 1000:.1f} ms, REMOTE in {(time.perf_counter() - t) * 1000:.1f} ms "
                f"-> seq {remote.sequence} {remote.location}",
                file=out,
            )
    print(f"produced {total} records in {time.perf_counter() - t0:.2f}s; "
          "the stage is empty after close()", file=out)
    snap = buf.snapshot()
    print(
        f"manifest: {snap.footer.entry_count} entries, sequences "
        f"{snap.footer.first_sequence}..{snap.footer.next_sequence - 1}, epoch {snap.footer.epoch}",
        file=out,
    )
    consumer = buf.consumer()
    consumer.initialize()
    got = 0
    while (b := consumer.next_batch()) is not None:
        got += len(b.entries)
        print(
            f"  consumed seq {b.sequence}: {len(b.entries)} records, {len(b.metadata)} metadata "
            f"items, first {b.entries[0]!r}",
            file=out,
        )
        consumer.ack(b.sequence)
    consumer.flush()
    consumer.close()
    print(f"consumed {got} records, acked and dequeued; queue depth now "
          f"{buf.snapshot().footer.entry_count}", file=out)
    return EXIT_OK if got == total else EXIT_FAILED


def _stage_roots(root: Path) -> list[Path]:
    """``root`` itself, or its ``worker-<i>`` folders when it is a ``tieredbuf serve`` stage."""
    workers = sorted(p for p in root.glob("worker-*") if p.is_dir()) if root.is_dir() else []
    return workers or [root]


def cmd_drain(args: argparse.Namespace, out: TextIO) -> int:
    from tieredbuf.errors import StageBufferMismatchError, StageLockedError
    from tieredbuf.stage_binding import canonical_url, describe, read_binding
    from tieredbuf.staged import drain, stage_producer_ids

    stage_dir = Path(args.stage_dir)
    if not stage_dir.is_dir():
        print(f"tieredbuf: {stage_dir} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    stages = [
        (root, pid)
        for root in _stage_roots(stage_dir)
        for pid in ([args.producer_id] if args.producer_id else stage_producer_ids(root))
    ]
    if not stages:
        print(f"tieredbuf: no producer stage under {stage_dir} (a stage is a directory "
              f"holding {'stage.lock'}, wal/ and segments/)", file=sys.stderr)
        return EXIT_USAGE
    buf = _open(args)
    timeout = args.timeout.total_seconds() if args.timeout is not None else None
    busy = lost = wrong = 0
    for root, pid in stages:
        print(f"{pid}: draining {root / pid} ({describe(read_binding(root / pid))}) "
              f"into {canonical_url(buf.url)}", file=out)
        with Progress(f"drain {root.name}/{pid}: segments") as bar:

            def progress(ex: Any, bar: Progress = bar) -> None:
                bar.update(1, ex.location)

            try:
                stats = drain(buf, root, pid, on_exported=progress, timeout=timeout)
            except StageLockedError:
                print(f"{pid}: skipped, a live producer holds its stage", file=out)
                busy += 1
                continue
            except StageBufferMismatchError as e:
                print(f"tieredbuf: {pid}: {_one_line(e)}", file=sys.stderr)
                wrong += 1
                continue
        replayed, segs = stats.get("replayed_entries", 0), stats.get("segments_exported", 0)
        nbytes = stats.get("bytes_exported", 0)
        print(
            f"{pid}: replayed {replayed} WAL {plural(replayed, 'entry')}, exported {segs} "
            f"{plural(segs, 'segment')} ({nbytes} {plural(nbytes, 'byte')}); stage empty",
            file=out,
        )
        if stats.get("quarantined"):
            lost += 1
            print(f"tieredbuf: StagedDataLossError: {pid}: corrupt "
                  f"{plural(len(stats['quarantined']), 'segment')} quarantined, "
                  f"not exported, their records lost: {', '.join(stats['quarantined'])}",
                  file=sys.stderr)
    if lost:
        return EXIT_FAILED
    if wrong:
        return EXIT_USAGE
    return EXIT_PARTIAL if busy else EXIT_OK


def _abspath(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def cmd_serve(args: argparse.Namespace, out: TextIO) -> int:
    from tieredbuf.service.auth import TokenSet, check_exposure
    from tieredbuf.service.config import ServiceConfig
    from tieredbuf.service.supervisor import serve
    from tieredbuf.service.worker import tls_context

    store: dict[str, Any] = _s3_opts(args) if args.url.startswith("s3://") else {}
    producer: dict[str, Any] = {}
    for opt, key in (("max_open_duration", "max_open_duration"),
                     ("wal_flush_interval", "flush_interval")):
        v = getattr(args, opt)
        if v is not None:
            producer[key] = v.total_seconds()
    for opt, key in (("segment_size", "target_size"), ("size_cap", "size_cap"),
                     ("size_cap_policy", "size_cap_policy")):
        v = getattr(args, opt)
        if v is not None:
            producer[key] = v
    tieredbuf.open(args.url, **store).close()  # a bad URL or option fails here, exit 2
    config = ServiceConfig(
        url=args.url, staging_dir=args.staging, host=args.host, port=args.port,
        workers=args.workers or os.cpu_count() or 1, store_options=store,
        producer_options=producer, max_body_bytes=args.max_body,
        backpressure_wait_s=args.backpressure_wait.total_seconds(),
        remote_timeout_s=args.remote_timeout.total_seconds(),
        shutdown_timeout_s=args.shutdown_timeout.total_seconds(),
        drain_timeout_s=args.drain_timeout.total_seconds(),
        token_file=_abspath(args.token_file), protect_metrics=args.protect_metrics,
        protect_health=args.protect_health, tls_cert=_abspath(args.tls_cert),
        tls_key=_abspath(args.tls_key), insecure=args.insecure,
    )
    # what the workers will load, checked once here: a bad token file, certificate or
    # an exposed port without tokens is exit 2 before anything binds
    tokens = TokenSet.from_config(config.token_file)
    tls_context(config)
    check_exposure(config.host, tokens, config.insecure, config.tls_cert is not None)
    return serve(config, out)


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's help shows its default unless it already says one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        if ("default" in text or d is None or d is False or d is argparse.SUPPRESS
                or not action.option_strings):
            return text
        if isinstance(d, timedelta):
            d = _fmt_duration(d)
        return f"{text} (default {d})" if text else f"(default {d})"


def _fmt_duration(d: timedelta) -> str:
    s = d.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= size and s % size == 0:
            return f"{int(s // size)}{unit}"
    return f"{round(s * 1000)}ms"


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line (and exit 2), naming where to find the usage."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _Help)
        super().__init__(*a, **kw)

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tieredbuf", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"tieredbuf {tieredbuf.__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    d = sub.add_parser("demo", help="stage, export, consume on a local directory")
    d.add_argument("url", nargs="?", default=DEMO_URL, help=f"the buffer (default {DEMO_URL})")
    d.add_argument("--staging", help=f"the producer's staging directory (default {DEMO_STAGE} "
                   f"for the default URL, {DEMO_STAGE}-<hash of the URL> for another)")
    d.add_argument("--calls", type=int, default=50,
                   help="produce() calls of 10 records each, in 5 waves (default 50)")
    d.set_defaults(fn=cmd_demo)

    pr = sub.add_parser("produce", help="produce one record per input line")
    pr.add_argument("url")
    pr.add_argument("files", nargs="*", metavar="FILE",
                    help="input files, one record per line ('-' or none: stdin)")
    pr.add_argument("--batch", type=int, default=1000, metavar="N",
                    help="records per produce() call")
    pr.add_argument("--metadata", default="", metavar="TEXT",
                    help="metadata payload for every call (default: empty)")
    pr.add_argument("--flush-interval", type=parse_duration, default=timedelta(milliseconds=100),
                    metavar="DURATION",
                    help="the stateless producer's batching window, e.g. 100ms, 1s")
    _store_args(pr)
    pr.set_defaults(fn=cmd_produce)

    from tieredbuf.cli_consume import add_parser as add_consume

    add_consume(sub, _store_args, parse_duration)
    sub.choices["consume"].set_defaults(fn=cmd_consume)
    from tieredbuf.cli_queue import add_parsers as add_queue

    add_queue(sub, _store_args, parse_duration, parse_size)
    sub.choices["entries"].set_defaults(fn=cmd_entries)
    sub.choices["retention"].set_defaults(fn=cmd_retention)

    ins = sub.add_parser("inspect", help="queue depth, sequence range, bytes, epoch, age")
    ins.add_argument("url")
    ins.add_argument("--json", action="store_true", help="one JSON object")
    ins.add_argument("--quick", action="store_true",
                     help="skip listing data/ (no stored_objects / missing_objects)")
    _store_args(ins)
    ins.set_defaults(fn=cmd_inspect)

    su = sub.add_parser("subscribers", help="list subscribers (or: subscribers remove URL NAME)",
                        usage="tieredbuf subscribers URL [--json] | "
                              "tieredbuf subscribers remove URL NAME")
    su.add_argument("words", nargs="+", metavar="URL | remove URL NAME")
    su.add_argument("--json", action="store_true")
    _store_args(su)
    su.set_defaults(fn=_subscribers)

    g = sub.add_parser("gc", help="delete data objects nothing refers to (run from cron)")
    g.add_argument("url")
    g.add_argument("--grace", type=parse_duration, metavar="DURATION",
                   help="e.g. 30m, 2h; honoured only if longer than the buffer's own grace "
                        "period (default: the buffer's, see tieredbuf grace)")
    g.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    g.add_argument("--json", action="store_true", help="the report as one JSON object")
    g.add_argument("--metrics-file", metavar="FILE",
                   help="write Prometheus metrics here (node_exporter textfile); if it "
                        "cannot be written the summary still prints and gc exits 1")
    g.add_argument("--pushgateway", metavar="HOST:PORT",
                   help="push Prometheus metrics to this Pushgateway; if it is unreachable "
                        "the summary still prints and gc exits 1")
    _store_args(g)
    g.set_defaults(fn=cmd_gc)

    gr = sub.add_parser("grace", help="show or set the buffer's GC grace period (in its root)")
    gr.add_argument("url")
    gr.add_argument("duration", nargs="?", type=parse_duration, metavar="DURATION",
                    help="set it (e.g. 10m, 2h; 0 with --force); omit to show it")
    gr.add_argument("--force", action="store_true",
                    help="allow one under 2 x the link deadline (4m by default), with a "
                         "warning")
    _store_args(gr)
    gr.set_defaults(fn=cmd_grace)

    dr = sub.add_parser("drain", help="export a dead producer's stage (another machine's disk)")
    dr.add_argument("stage_dir", help="a staging directory (or a tieredbuf serve stage root)")
    dr.add_argument("url", help="the buffer to export into; must be the stage's own")
    dr.add_argument("--producer-id", metavar="ID",
                    help="only this producer's stage (default: every one)")
    dr.add_argument("--timeout", type=parse_duration, default=timedelta(minutes=15),
                    metavar="DURATION",
                    help="give up (exit 3, saying what is still staged) after this long "
                         "while the store keeps failing transiently (default 15m)")
    _store_args(dr)
    dr.set_defaults(fn=cmd_drain)

    sv = sub.add_parser("serve", help="HTTP ingest service: POST /v1/produce, /metrics")
    sv.add_argument("url")
    sv.add_argument("--staging", required=True, metavar="DIR",
                    help="stage root; worker i uses DIR/worker-<i>")
    sv.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    sv.add_argument("--port", type=int, default=8080, help="TCP port; 0: any free port (printed)")
    sv.add_argument("--workers", type=int, default=0, metavar="N",
                    help="worker processes (default 0: one per CPU)")
    sv.add_argument("--max-body", type=parse_size, default=16 << 20, metavar="SIZE",
                    help="largest request body, e.g. 16MiB; larger: 413 (default 16MiB)")
    sv.add_argument("--backpressure-wait", type=parse_duration, metavar="DURATION",
                    default=timedelta(milliseconds=500), help="wait at a stage cap, then 503")
    sv.add_argument("--remote-timeout", type=parse_duration, default=timedelta(seconds=30),
                    metavar="DURATION",
                    help="durability=remote requests wait this long for export, then 504")
    sv.add_argument("--shutdown-timeout", type=parse_duration, default=timedelta(seconds=30),
                    metavar="DURATION", help="on SIGTERM: time for in-flight requests")
    sv.add_argument("--drain-timeout", type=parse_duration, default=timedelta(minutes=5),
                    metavar="DURATION", help="on SIGTERM: time to seal and export the stage")
    g2 = sv.add_argument_group("stage (see docs/operations.md: sizing the stage)")
    g2.add_argument("--max-open-duration", type=parse_duration, metavar="DURATION",
                    help="seal an open segment after this long (default 5s): REMOTE latency")
    g2.add_argument("--wal-flush-interval", type=parse_duration, metavar="DURATION",
                    help="WAL group-commit window (default 25ms): LOCAL latency")
    g2.add_argument("--segment-size", type=parse_size, metavar="SIZE",
                    help="seal at this size (default 32MiB)")
    g2.add_argument("--size-cap", type=parse_size, metavar="SIZE",
                    help="stage disk cap (default 16GiB)")
    g2.add_argument("--size-cap-policy", choices=("backpressure", "drop_oldest"),
                    help="at the cap: wait (then 503), or drop the oldest sealed segment "
                         "(default backpressure)")
    g3 = sv.add_argument_group(
        "security (see docs/operations.md: securing the service)",
        "Tokens: --token-file, or $TIEREDBUF_SERVICE_TOKENS (comma-separated).  A host "
        "other than loopback needs tokens unless --insecure.")
    g3.add_argument("--token-file", metavar="FILE",
                    help="bearer tokens, one per line; re-read when it changes "
                    "and on SIGHUP (rotation without a restart)")
    g3.add_argument("--protect-metrics", action="store_true",
                    help="require a token on /metrics too")
    g3.add_argument("--protect-health", action="store_true",
                    help="require a token on /healthz and /readyz too")
    g3.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve HTTPS")
    g3.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    g3.add_argument("--insecure", action="store_true",
                    help="allow a non-loopback --host without tokens")
    _store_args(sv)
    sv.set_defaults(fn=cmd_serve)
    return p


class _StderrLog(logging.Handler):
    """tieredbuf's warnings as ``tieredbuf: ...`` lines on the current stderr (retries of
    a store that is down, once per interval), redacted (:mod:`tieredbuf.redact`).
    Errors that are also raised to the command are skipped: main() prints those once."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "tb_raised", False):
            return
        try:
            sys.stderr.write(redact(f"tieredbuf: {record.getMessage()}\n"))
        except Exception:
            self.handleError(record)


def _log_to_stderr() -> None:
    """WARNING and up (``TIEREDBUF_LOG_LEVEL`` to change) from tieredbuf's loggers."""
    logger = logging.getLogger("tieredbuf")
    if not any(isinstance(h, _StderrLog) for h in logger.handlers):
        level = os.environ.get("TIEREDBUF_LOG_LEVEL", "").upper()
        if level not in logging.getLevelNamesMapping():
            level = ""
        logger.addHandler(_StderrLog(level or logging.WARNING))
        if level:
            logger.setLevel(level)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    try:
        code: int = args.fn(args, out or sys.stdout)
        return code
    except ConfigError as e:
        print(redact(f"tieredbuf: configuration error: {_one_line(e)}"), file=sys.stderr)
        return EXIT_USAGE
    except BufferNotFoundError as e:
        print(redact(f"tieredbuf: {_one_line(e)}"), file=sys.stderr)
        return EXIT_USAGE
    except TieredBufError as e:
        print(redact(f"tieredbuf: {type(e).__name__}: {_one_line(e)}"), file=sys.stderr)
        return EXIT_FAILED
    except Exception as e:
        if type(e).__module__.split(".")[0] != "obstore":
            raise
        from tieredbuf.store.objstore import short

        print(redact(f"tieredbuf: store error: {short(e)}"), file=sys.stderr)
        return EXIT_FAILED


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split("\n\nDebug source:", 1)[0].split())
    return text or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
