"""The producer side: ``tieredbuf produce``, ``demo`` and ``drain`` (the commands that
may create a buffer, and the stage's own)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import tieredbuf
from tieredbuf.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_USAGE,
    Progress,
    one_line,
    open_buffer,
    plural,
)
from tieredbuf.errors import ConfigError


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
    buf = open_buffer(args)
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
    seqs = sorted(s for s in {h.wait().sequence for h in handles} if s is not None)
    span = f"sequences {seqs[0]}..{seqs[-1]}" if seqs else "nothing"
    print(f"produced {n} {plural(n, 'record')} in {len(handles)} {plural(len(handles), 'call')}"
          f" -> {span}", file=out)
    return EXIT_OK


DEMO_URL, DEMO_STAGE = "file://./demo-buffer", "./demo-stage"


def demo_stage(url: str) -> str:
    """The demo's default stage: ``./demo-stage`` for the default URL, else
    ``./demo-stage-<12 hex digits of the URL>`` (a stage belongs to one buffer)."""
    import hashlib

    from tieredbuf.produce.stage_binding import canonical_url

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
    from tieredbuf.produce.stage_binding import canonical_url, describe, read_binding
    from tieredbuf.produce.staged import stage_producer_ids

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
    buf = open_buffer(args)
    timeout = args.timeout.total_seconds() if args.timeout is not None else None
    busy = lost = wrong = 0
    for root, pid in stages:
        print(f"{pid}: draining {root / pid} ({describe(read_binding(root / pid))}) "
              f"into {canonical_url(buf.url)}", file=out)
        with Progress(f"drain {root.name}/{pid}: segments") as bar:

            def progress(ex: Any, bar: Progress = bar) -> None:
                bar.update(1, ex.location)

            try:
                stats = buf.drain_stage(root, pid, on_exported=progress, timeout=timeout)
            except StageLockedError:
                print(f"{pid}: skipped, a live producer holds its stage", file=out)
                busy += 1
                continue
            except StageBufferMismatchError as e:
                print(f"tieredbuf: {pid}: {one_line(e)}", file=sys.stderr)
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
