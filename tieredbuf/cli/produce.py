"""The producer side: ``tieredbuf produce``, ``demo`` and ``drain`` (the commands that
may create a buffer, and the stage's own)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import tieredbuf
from tieredbuf.buffer import is_service_url
from tieredbuf.cli._common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_USAGE,
    Progress,
    fmt_duration,
    one_line,
    open_buffer,
    plural,
)
from tieredbuf.client.producer import header_metadata
from tieredbuf.config import RetryConfig
from tieredbuf.errors import BackpressureError, ConfigError, FlushTimeoutError, TieredBufError
from tieredbuf.produce.api import RecordProducer
from tieredbuf.produce.handles import WriteHandle
from tieredbuf.runtime.redact import redact


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


def _name(f: str) -> str:
    return "stdin" if f == "-" else f


def refuse_partial_json(name: str, first: bytes) -> None:
    """A first line that opens a JSON value without closing it: pretty-printed JSON, which
    one-record-per-line would cut into junk records (``[``, ``  {``)."""
    head = first.strip()
    if not head.startswith((b"{", b"[")):
        return
    try:
        json.loads(head)
    except ValueError:
        raise ConfigError(
            f"{name}: line 1 ({head[:20].decode('utf-8', 'replace')!r}) is not a whole JSON "
            f"value: the input looks like pretty-printed JSON, which is not one record per "
            f"line; give --format json to produce the items of its array (or the object) as "
            f"records, or compact it first (jq -c '.[]' {name if name != 'stdin' else 'FILE'}"
            f" | tieredbuf produce URL); --format lines takes the lines as they are"
        ) from None


def _checked_lines(files: Sequence[str]) -> Iterator[bytes]:
    """One record per line, each input's first line checked now, before any record is
    produced (half an input is worse than none); stdin's first line is read to check it."""
    names = list(files) or ["-"]
    for f in names:
        if f != "-":
            with open(f, "rb") as fh:
                refuse_partial_json(f, fh.readline())
    if "-" not in names:
        return _lines(names)
    first = sys.stdin.buffer.readline()
    if first:
        refuse_partial_json("stdin", first)

    def chained() -> Iterator[bytes]:
        for f in names:
            if f == "-" and first:
                yield first.rstrip(b"\r\n")
            if f == "-":  # stdin once; a second '-' reads what is left (nothing)
                yield from _lines([])
            else:
                yield from _lines([f])

    return chained()


def _json_records(files: Sequence[str]) -> list[bytes]:
    """``--format json``: each input is a sequence of JSON values (one array, an object,
    or a stream of pretty-printed values); an array's items, or each other value, become
    records, compacted.  Every input is parsed before anything is produced."""
    dec = json.JSONDecoder()
    out: list[bytes] = []
    for f in list(files) or ["-"]:
        raw = sys.stdin.buffer.read() if f == "-" else Path(f).read_bytes()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{_name(f)} is not UTF-8 text (--format json): {e}") from None
        i = 0
        while True:
            while i < len(text) and text[i].isspace():
                i += 1
            if i == len(text):
                break
            try:
                value, i = dec.raw_decode(text, i)
            except ValueError as e:
                raise ConfigError(f"{_name(f)} is not valid JSON (--format json): {e}") from None
            for v in value if isinstance(value, list) else [value]:
                out.append(json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode())
    return out


def _chunks(records: Iterable[bytes], n: int) -> Iterator[list[bytes]]:
    chunk: list[bytes] = []
    for rec in records:
        chunk.append(rec)
        if len(chunk) >= n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _close_quietly(producer: Any, timeout: float) -> None:
    """Close after a failure (or Ctrl-C): what is not stored by then is reported, not raised."""
    with contextlib.suppress(TieredBufError, KeyboardInterrupt):
        producer.close(timeout=timeout)


def _span(first: int, count: int) -> str:
    return f"#{first + 1}" if count == 1 else f"#{first + 1}..#{first + count}"


def cmd_produce(args: argparse.Namespace, out: TextIO) -> int:
    missing = [f for f in args.files if f != "-" and not os.path.isfile(f)]
    if missing:  # before anything is produced: half an input is worse than none
        raise ConfigError(
            f"input file {missing[0]!r} does not exist (or is not a file)"
            + (f", nor {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    if args.format == "json":
        records: Iterable[bytes] = _json_records(args.files)
    elif args.format == "lines":
        records = _lines(args.files)
    else:
        records = _checked_lines(args.files)
    meta = args.metadata.encode()
    producer: RecordProducer
    wait: float | None
    close_timeout: float | None = None
    if is_service_url(args.url):
        producer = _service_producer(args, meta)
        wait = close_timeout = args.timeout.total_seconds()  # the client's own deadlines
    else:
        buf = open_buffer(args)
        # --timeout is how long the store may keep failing with nothing getting through
        # (the producer's give_up_after): a healthy store, however slow, never starts it
        retry = RetryConfig(give_up_after=args.timeout)
        if args.staging:
            producer = buf.producer(staging_dir=args.staging, retry=retry)
            wait = args.timeout.total_seconds()  # at a full stage (its cap)
        else:
            producer = buf.producer(flush_interval=args.flush_interval, retry=retry)
            wait = None  # a full producer buffer gives up once the store failed --timeout
    calls: list[tuple[WriteHandle, int, int]] = []  # handle, first record index, count
    n = 0
    error: TieredBufError | None = None
    interrupted = False
    try:
        for chunk in _chunks(records, args.batch):
            calls.append((producer.produce(chunk, metadata=meta, timeout=wait), n, len(chunk)))
            n += len(chunk)
        producer.close(timeout=close_timeout)
    except KeyboardInterrupt:
        # no close(): a join that Ctrl-C interrupted leaves CPython 3.11 believing a live
        # thread stopped (bpo-45274's fix), so the next join could wait on it forever;
        # the command reports what is not confirmed stored and the process exits at once
        interrupted = True
    except ConfigError:
        _close_quietly(producer, 0)
        raise
    except TieredBufError as e:  # --timeout ran out, or a permanent store error
        error = e
        _close_quietly(producer, 0)
    return _report(args, out, calls, n, error, interrupted)


_STORE_FLAGS = ("endpoint", "region", "allow_http", "instance_metadata", "skip_signature")


def _service_producer(args: argparse.Namespace, meta: bytes) -> RecordProducer:
    """``tieredbuf produce http(s)://host:port[,host2:port2]``: through the service
    (tieredbuf/client), REMOTE answers only; the flags that choose a store or stage do
    not apply."""
    given = [f"--{f.replace('_', '-')}" for f in _STORE_FLAGS if getattr(args, f, None)]
    if args.staging:
        given.append("--staging")
    if given:
        raise ConfigError(
            f"{', '.join(given)} do(es) not apply to a service URL: the service at "
            f"{args.url} chooses the store and stages the records itself"
        )
    try:
        header_metadata(meta)
    except ValueError as e:
        raise ConfigError(f"--metadata: {e}") from None
    return tieredbuf.service_producer(
        args.url,
        flush_interval=args.flush_interval,
        token_file=args.token_file,
        ca_file=args.ca_file,
    )


def _report(
    args: argparse.Namespace,
    out: TextIO,
    calls: list[tuple[WriteHandle, int, int]],
    n: int,
    error: TieredBufError | None,
    interrupted: bool,
) -> int:
    seqs: set[int] = set()
    lost: list[tuple[int, int]] = []
    staged = maybe = 0
    service = is_service_url(args.url)
    for h, first, count in calls:
        failure: TieredBufError | None = None
        try:
            r = h.result()
        except TieredBufError as e:
            r, failure = None, e
        if r is not None:
            if r.sequence is not None:
                seqs.add(r.sequence)
        elif service and (
            h.watcher.level is not None or getattr(failure, "may_have_landed", False)
        ):
            maybe += count  # the service may have it (staged there, or an unknown outcome)
        elif h.watcher.level is not None:  # LOCAL: fsynced in the stage
            staged += count
        else:
            lost.append((first, count))
    if not (lost or staged or maybe or error or interrupted):
        order = sorted(seqs)
        span = f"sequences {order[0]}..{order[-1]}" if order else "nothing"
        print(
            f"produced {n} {plural(n, 'record')} in {len(calls)} "
            f"{plural(len(calls), 'call')} -> {span}",
            file=out,
        )
        return EXIT_OK
    if interrupted:
        cause = "interrupted"
    elif isinstance(error, (FlushTimeoutError, BackpressureError)) and is_service_url(args.url):
        last = str(error).split("last failure: ", 1)
        cause = f"the service still failed after --timeout {fmt_duration(args.timeout)}" + (
            f" ({one_line(Exception(last[1]))})" if len(last) > 1 else ""
        )
    elif isinstance(error, (FlushTimeoutError, BackpressureError)):
        last = str(error).split("last store error: ", 1)
        cause = f"the store still failed after --timeout {fmt_duration(args.timeout)}" + (
            f" ({one_line(Exception(last[1]))})" if len(last) > 1 else ""
        )
    else:
        cause = f"{type(error).__name__}: {one_line(error)}" if error else "failed"
    parts = []
    unstored = sum(c for _, c in lost)
    if unstored:
        first, last_i = lost[0][0], lost[-1][0] + lost[-1][1]
        how = "not confirmed stored" if interrupted else "not stored and dropped"
        parts.append(
            f"{unstored} of {n} {plural(n, 'record')} {how} "
            f"(input records {_span(first, last_i - first)})"
        )
    if maybe:
        parts.append(
            f"{maybe} {plural(maybe, 'record')} not confirmed: the service may have stored "
            f"them (once at most)"
        )
    if staged:
        parts.append(
            f"{staged} {plural(staged, 'record')} still staged in {args.staging} "
            f"(safe on disk; 'tieredbuf drain {args.staging} {args.url}' exports "
            f"them)"
        )
    if error is not None and isinstance(error, BackpressureError):
        parts.append(f"input not read past record #{n}")
    stored = sum(c for (h, _, c) in calls) - unstored - staged - maybe
    if seqs:
        order = sorted(seqs)
        parts.append(f"{stored} stored (sequences {order[0]}..{order[-1]})")
    else:
        parts.append("none stored")
    print(redact(f"tieredbuf: {cause}: {'; '.join(parts)}"), file=sys.stderr)
    return EXIT_INTERRUPTED if interrupted else EXIT_FAILED


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
    print(
        f"produced {total} records in {time.perf_counter() - t0:.2f}s; "
        "the stage is empty after close()",
        file=out,
    )
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
    print(
        f"consumed {got} records, acked and dequeued; queue depth now "
        f"{buf.snapshot().footer.entry_count}",
        file=out,
    )
    return EXIT_OK if got == total else EXIT_FAILED


def _stage_roots(root: Path) -> list[Path]:
    """``root`` itself, or its ``worker-<i>`` folders when it is a ``tieredbuf serve`` stage."""
    workers = sorted(p for p in root.glob("worker-*") if p.is_dir()) if root.is_dir() else []
    return workers or [root]


def cmd_drain(args: argparse.Namespace, out: TextIO) -> int:
    from tieredbuf.errors import DiskFullError, StageBufferMismatchError, StageLockedError
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
        print(
            f"tieredbuf: no producer stage under {stage_dir} (a stage is a directory "
            f"holding {'stage.lock'}, wal/ and segments/)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    buf = open_buffer(args)
    timeout = args.timeout.total_seconds() if args.timeout is not None else None
    busy = lost = wrong = 0
    for root, pid in stages:
        what = f"{root / pid} ({describe(read_binding(root / pid))})"
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
            except DiskFullError as e:  # recovery and sealing write: the disk needs room
                raise DiskFullError(
                    f"{pid}: the stage's disk is full ({one_line(e)}); nothing was lost or "
                    f"changed: free space there, or copy the stage to a disk with room and "
                    f"drain the copy (from any machine): cp -a {root} /other/disk/ && "
                    f"tieredbuf drain /other/disk/{root.name} {args.url}",
                    e.errno,
                    e.path,
                ) from e
        replayed, segs = stats.get("replayed_entries", 0), stats.get("segments_exported", 0)
        nbytes = stats.get("bytes_exported", 0)
        print(
            f"{pid}: drained {what} into {canonical_url(buf.url)}: "
            f"replayed {replayed} WAL {plural(replayed, 'entry')}, exported {segs} "
            f"{plural(segs, 'segment')} ({nbytes} {plural(nbytes, 'byte')}); stage empty",
            file=out,
        )
        if stats.get("quarantined"):
            lost += 1
            print(
                f"tieredbuf: StagedDataLossError: {pid}: corrupt "
                f"{plural(len(stats['quarantined']), 'segment')} quarantined, "
                f"not exported, their records lost: {', '.join(stats['quarantined'])}",
                file=sys.stderr,
            )
    if lost:
        return EXIT_FAILED
    if wrong:
        return EXIT_USAGE
    return EXIT_PARTIAL if busy else EXIT_OK
