"""The ``tieredbuf`` command.

    tieredbuf demo [URL]                 produce, land as objects + manifest entries, consume back
    tieredbuf produce URL [FILE ...]     one record per input line (stdin when no FILE)
    tieredbuf consume URL [--out DIR]    print records (or write one file per batch), then ack
    tieredbuf inspect URL [--json]       sequence range, depth, bytes, epoch, oldest age
    tieredbuf gc URL [--grace 10m] [--dry-run] [--json]
    tieredbuf drain STAGE_DIR URL        take over a dead producer's stage: replay, export, empty it

Exit codes: 0 success; 1 partial failure (gc: some deletes failed, retried next run);
2 bad usage or configuration; 3 the store or the data failed (unreachable, corrupt, fenced).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import tieredbuf
from tieredbuf import gc as gc_mod
from tieredbuf.errors import ConfigError, TieredBufError

EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """``500ms``, ``30s``, ``10m``, ``2h``, ``1d``."""
    m = _DURATION.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 500ms, 30s, 10m, 2h")
    return timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])


def _store_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("S3 options (default: the standard AWS_* environment)")
    g.add_argument("--endpoint", help="S3 endpoint URL, e.g. http://127.0.0.1:9000 for MinIO")
    g.add_argument("--region")
    g.add_argument("--allow-http", action="store_true", default=None)


def _open(args: argparse.Namespace) -> tieredbuf.Buffer:
    opts: dict[str, Any] = {}
    if args.url.startswith("s3://"):
        for name in ("endpoint", "region", "allow_http"):
            if getattr(args, name, None) is not None:
                opts[name] = getattr(args, name)
    return tieredbuf.open(args.url, **opts)


def _lines(files: Sequence[str]) -> Iterator[bytes]:
    if not files:
        for line in sys.stdin.buffer:
            yield line.rstrip(b"\r\n")
        return
    for f in files:
        with open(f, "rb") as fh:
            for line in fh:
                yield line.rstrip(b"\r\n")


def cmd_produce(args: argparse.Namespace, out: TextIO) -> int:
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
    print(f"produced {n} records in {len(handles)} calls -> {span}", file=out)
    return EXIT_OK


def cmd_consume(args: argparse.Namespace, out: TextIO) -> int:
    buf = _open(args)
    consumer = buf.consumer()
    consumer.initialize(args.after)
    batches = records = 0
    outdir = Path(args.out) if args.out else None
    if outdir:
        outdir.mkdir(parents=True, exist_ok=True)
    while args.max_batches is None or batches < args.max_batches:
        b = consumer.next_batch()
        if b is None:
            break
        if outdir:
            (outdir / f"{b.sequence:020d}.batch").write_bytes(b.data)
        else:
            for r in b.entries:
                out.write(r.decode("utf-8", "backslashreplace") + "\n")
        batches += 1
        records += len(b.entries) if b.location.endswith(".batch") else 0
        if not args.no_ack:
            consumer.ack(b.sequence)
    if not args.no_ack:
        consumer.flush()
    consumer.close()
    print(f"consumed {batches} batches, {records} records", file=sys.stderr)
    return EXIT_OK


def inspect_buffer(buf: tieredbuf.Buffer) -> dict[str, Any]:
    """The figures ``tieredbuf inspect`` shows."""
    snap = buf.snapshot()
    entries = snap.entries()
    sizes = {m.key: m.size for m in buf.store.list("data/")}
    now_ms = time.time_ns() // 1_000_000
    oldest = min((m.ingestion_time_ms for e in entries for m in e.metadata), default=None)
    return {
        "url": buf.url,
        "first_sequence": snap.footer.first_sequence,
        "next_sequence": snap.footer.next_sequence,
        "depth": snap.footer.entry_count,
        "queued_bytes": sum(sizes.get(e.location, 0) for e in entries),
        "missing_objects": sum(1 for e in entries if e.location not in sizes),
        "stored_objects": len(sizes),
        "epoch": snap.footer.epoch,
        "manifest_version": snap.footer.version,
        "manifest_bytes": len(snap.view.raw),
        "producer_watermarks": len(snap.view.watermarks),
        "oldest_age_s": None if oldest is None else round((now_ms - oldest) / 1000, 3),
    }


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    info = inspect_buffer(_open(args))
    if args.json:
        out.write(json.dumps(info) + "\n")
        return EXIT_OK
    width = max(len(k) for k in info)
    for k, v in info.items():
        out.write(f"{k.ljust(width)}  {v}\n")
    return EXIT_OK


def cmd_gc(args: argparse.Namespace, out: TextIO) -> int:
    report = gc_mod.run_once(_open(args), grace=args.grace, dry_run=args.dry_run)
    if args.json:
        d = report.as_dict()
        d["deleted_keys"] = d["deleted_keys"][:1000]
        out.write(json.dumps(d) + "\n")
    else:
        verb = "would delete" if args.dry_run else "deleted"
        n = report.candidates if args.dry_run else report.deleted
        out.write(
            f"listed {report.listed}, referenced {report.referenced}, {verb} {n}, "
            f"failed {report.failed}, kept (young) {report.kept_young}, "
            f"kept (newer than oldest entry) {report.kept_newer_than_oldest}\n"
        )
    return EXIT_PARTIAL if report.failed else EXIT_OK


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    buf = tieredbuf.open(args.url)
    n_calls, per_call = args.calls, 10
    print(f"buffer: {buf.url}", file=out)
    t0 = time.perf_counter()
    with buf.producer(flush_interval=timedelta(milliseconds=50)) as producer:
        handles = []
        for i in range(n_calls):
            handles.append(producer.produce(
                [f"record {i}.{j}".encode() for j in range(per_call)], metadata=f"call {i}".encode()
            ))
            if i % 10 == 9:  # a few waves, so several objects and manifest entries appear
                handles[-1].wait()
    outcomes = [h.wait() for h in handles]
    locations = sorted({o.location for o in outcomes if o.location})
    print(
        f"produced {n_calls * per_call} records in {n_calls} calls "
        f"({time.perf_counter() - t0:.2f}s) -> {len(locations)} data objects",
        file=out,
    )
    for loc in locations[:5]:
        print(f"  object  {loc}  ({buf.store.head(loc).size} bytes)", file=out)
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
    return EXIT_OK if got == n_calls * per_call else EXIT_FAILED


def cmd_drain(args: argparse.Namespace, out: TextIO) -> int:
    from tieredbuf.errors import StageLockedError
    from tieredbuf.staged import drain, stage_producer_ids

    buf = _open(args)
    root = Path(args.stage_dir)
    ids = [args.producer_id] if args.producer_id else stage_producer_ids(root)
    if not ids:
        print(f"no stage under {root}", file=out)
        return EXIT_OK
    busy = 0
    for pid in ids:
        done = [0]

        def progress(ex: Any, pid: str = pid, done: list[int] = done) -> None:
            done[0] += 1
            print(f"  {pid}: exported segment {done[0]} -> {ex.location}", file=sys.stderr)

        try:
            stats = drain(buf, root, pid, on_exported=progress)
        except StageLockedError:
            print(f"{pid}: skipped, a live producer holds its stage", file=out)
            busy += 1
            continue
        print(
            f"{pid}: replayed {stats.get('replayed_entries', 0)} WAL entries, exported "
            f"{stats.get('segments_exported', 0)} segments "
            f"({stats.get('bytes_exported', 0)} bytes); stage empty",
            file=out,
        )
    return EXIT_PARTIAL if busy else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tieredbuf", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"tieredbuf {tieredbuf.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="produce, store, consume on a local directory")
    d.add_argument("url", nargs="?", default="file://./demo-buffer")
    d.add_argument("--calls", type=int, default=50)
    d.set_defaults(fn=cmd_demo)

    pr = sub.add_parser("produce", help="produce one record per input line")
    pr.add_argument("url")
    pr.add_argument("files", nargs="*")
    pr.add_argument("--batch", type=int, default=1000, help="records per produce() call")
    pr.add_argument("--metadata", default="", help="metadata payload for every call")
    pr.add_argument("--flush-interval", type=parse_duration, default=timedelta(milliseconds=100))
    _store_args(pr)
    pr.set_defaults(fn=cmd_produce)

    co = sub.add_parser("consume", help="consume, print or write, then ack")
    co.add_argument("url")
    co.add_argument("--out", help="write each batch's data object to DIR/<sequence>.batch")
    co.add_argument("--max-batches", type=int)
    co.add_argument("--after", type=int, help="resume after this acked sequence")
    co.add_argument("--no-ack", action="store_true", help="read without acking or dequeuing")
    _store_args(co)
    co.set_defaults(fn=cmd_consume)

    ins = sub.add_parser("inspect", help="queue depth, sequence range, bytes, epoch, age")
    ins.add_argument("url")
    ins.add_argument("--json", action="store_true")
    _store_args(ins)
    ins.set_defaults(fn=cmd_inspect)

    g = sub.add_parser("gc", help="delete data objects nothing refers to (run from cron)")
    g.add_argument("url")
    g.add_argument("--grace", type=parse_duration, default=timedelta(minutes=10))
    g.add_argument("--dry-run", action="store_true")
    g.add_argument("--json", action="store_true")
    _store_args(g)
    g.set_defaults(fn=cmd_gc)

    dr = sub.add_parser("drain", help="export a dead producer's stage (another machine's disk)")
    dr.add_argument("stage_dir")
    dr.add_argument("url")
    dr.add_argument("--producer-id", help="only this producer's stage (default: every one)")
    _store_args(dr)
    dr.set_defaults(fn=cmd_drain)
    return p


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.fn(args, out or sys.stdout)
        return code
    except ConfigError as e:
        print(f"tieredbuf: configuration error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TieredBufError as e:
        print(f"tieredbuf: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
