"""``tieredbuf consume``: read the queue and print it, or write it to files.

Two ways to read, chosen by ``--no-ack``:

* acking (the default): the buffer's fenced consumer.  It bumps the epoch (an older
  consumer is fenced), acks each batch once its output is written -- flushed to stdout,
  or fsynced when it goes to ``--out`` -- and dequeues the acked ones.
* ``--no-ack``: a plain reader (``buf.reader()``).  It never bumps an epoch, never acks
  and never writes to the buffer: it can run beside a live consumer or Spark stream.
  ``--from SEQ|earliest|latest`` picks where it starts.

``--follow`` keeps reading as entries land, until Ctrl-C.  It uses the consumer's long
poll (``next_batch(timeout=...)``) where the consumer has one; otherwise it polls
with a backoff that doubles from 50 ms to ``--poll-max`` (default 1 s) while the
queue is idle, and resets when an entry arrives.

Output: a ``.batch`` object's records one per line (``--json``: one JSON object per
record: sequence, index, ingestion_time_ms, metadata, value); a ``.qseg`` object's Arrow
bundles as one JSON object per row.  ``--out DIR`` writes each data object as it is;
``--out FILE.arrow`` (Arrow IPC file) or ``--out FILE.parquet`` writes rows.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import decimal
import inspect
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO, cast

import tieredbuf
from tieredbuf import keys
from tieredbuf.cli._common import (
    Progress,
    open_buffer,
    parse_duration,
    plural,
    require_buffer,
    store_args,
    writing,
)
from tieredbuf.consume.consumer import ConsumedBatch
from tieredbuf.errors import ConfigError, OutputClosedError, OutputError, TieredBufError
from tieredbuf.format.manifest import MetadataItem
from tieredbuf.runtime.fsutil import fsync_dir
from tieredbuf.runtime.signals import SignalEvent, Stop

if TYPE_CHECKING:
    import pyarrow as pa

ARROW_SUFFIXES = (".arrow", ".arrows", ".ipc", ".feather")
PARQUET_SUFFIXES = (".parquet", ".pq")
POLL_MIN = 0.05
"""First wait of --follow's idle backoff (seconds); doubles up to --poll-max."""


class OutputSchemaError(TieredBufError):
    """Rows for one --out file changed schema: an Arrow or Parquet file holds one."""


def _text(b: bytes, key: str) -> dict[str, str]:
    try:
        return {key: b.decode("utf-8")}
    except UnicodeDecodeError:
        return {f"{key}_base64": base64.b64encode(b).decode("ascii")}


def _json_default(v: object) -> object:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(v).decode("ascii")}
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):
        return str(v)
    return str(v)


def _item_for(md: tuple[MetadataItem, ...], index: int) -> MetadataItem | None:
    found = None
    for m in md:
        if m.start_index <= index:
            found = m
        else:
            break
    return found


def record_rows(b: ConsumedBatch) -> list[dict[str, Any]]:
    """One dict per record of a ``.batch`` object (the --json layout)."""
    rows = []
    for i, value in enumerate(b.entries):
        m = _item_for(b.metadata, i)
        row: dict[str, Any] = {
            "sequence": b.sequence,
            "index": i,
            "ingestion_time_ms": None if m is None else m.ingestion_time_ms,
        }
        row.update(_text(m.payload if m else b"", "metadata"))
        row.update(_text(value, "value"))
        rows.append(row)
    return rows


def bundle_rows(b: ConsumedBatch) -> list[dict[str, Any]]:
    """One dict per row of each slot of each bundle of a ``.qseg`` object."""
    from tieredbuf.format.segment import decode_segment

    rows: list[dict[str, Any]] = []
    for bi, bundle in enumerate(decode_segment(b.data, obj=b.location)):
        t = None if bundle.ingestion_ts_nanos is None else bundle.ingestion_ts_nanos // 1_000_000
        for slot in sorted(bundle.slots):
            for r, values in enumerate(bundle.slots[slot].to_pylist()):
                rows.append(
                    {
                        "sequence": b.sequence,
                        "bundle": bi,
                        "slot": slot,
                        "row": r,
                        "ingestion_time_ms": t,
                        "value": values,
                    }
                )
    return rows


def is_bundles(b: ConsumedBatch) -> bool:
    return b.location.endswith(keys.SEGMENT_SUFFIX)


class Sink(Protocol):
    def write(self, b: ConsumedBatch) -> int: ...
    def commit(self) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


class StdoutSink:
    """Records as lines (or JSON), bundles as JSON rows; ``commit`` flushes stdout."""

    def __init__(self, out: TextIO, as_json: bool) -> None:
        self.out, self.as_json = out, as_json

    def write(self, b: ConsumedBatch) -> int:
        if is_bundles(b):
            rows = bundle_rows(b)
        elif self.as_json:
            rows = record_rows(b)
        else:
            recs = b.entries
            self.out.write("".join(r.decode("utf-8", "backslashreplace") + "\n" for r in recs))
            return len(recs)
        self.out.write("".join(json.dumps(r, default=_json_default) + "\n" for r in rows))
        return len(rows)

    def commit(self) -> None:
        self.out.flush()

    def close(self) -> None:
        self.out.flush()

    def abort(self) -> None:
        with contextlib.suppress(OutputError):  # what was written goes out; nothing more
            self.out.flush()


class DirSink:
    """Each data object as ``DIR/<sequence>.batch|.qseg``, fsynced before its ack."""

    def __init__(self, outdir: Path) -> None:
        self.dir = outdir
        with writing(outdir):
            outdir.mkdir(parents=True, exist_ok=True)

    def write(self, b: ConsumedBatch) -> int:
        suffix = keys.SEGMENT_SUFFIX if is_bundles(b) else keys.BATCH_SUFFIX
        path = self.dir / f"{b.sequence:020d}{suffix}"
        try:
            with writing(path), open(path, "wb") as f:
                f.write(b.data)
                f.flush()
                os.fsync(f.fileno())
        except OutputError:
            path.unlink(missing_ok=True)  # no object cut short under its name
            raise
        return 0 if is_bundles(b) else len(b.entries)

    def commit(self) -> None:
        with writing(self.dir):
            fsync_dir(self.dir)

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass  # each file is complete (fsynced) before its ack; unacked ones are read again


class ArrowFileSink:
    """Rows into one Arrow IPC or Parquet file.

    Records become (sequence, index, ingestion_time, metadata, value) rows; bundle slot
    0 goes to the file as its batches are, slot ``k`` > 0 to ``<stem>.slot<k><suffix>``.
    A file holds one kind of row and one schema: records and slot-0 bundles in one
    buffer, or a slot whose schema changes, fail with OutputSchemaError (use ``--out
    DIR``).  Each file is written under ``<name>.partial`` and renamed to its name only
    once closed and fsynced, so a file under the final name is always complete; the
    acking consumer acks only after :meth:`commit`, at the end.  :meth:`abort` removes
    the partial files of a failed run.
    """

    def __init__(self, path: Path, parquet: bool) -> None:
        self.path, self.parquet = path, parquet
        self._writers: dict[Path, tuple[Any, pa.Schema, str]] = {}
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)

    def _target(self, slot: int) -> Path:
        if slot <= 0:
            return self.path
        return self.path.with_name(f"{self.path.stem}.slot{slot}{self.path.suffix}")

    @staticmethod
    def _partial(target: Path) -> Path:
        return target.with_name(target.name + ".partial")

    def _put(self, slot: int, batch: pa.RecordBatch, seq: int) -> None:
        import pyarrow as pa

        target = self._target(slot)
        what = "records" if slot < 0 else f"slot-{slot} bundles"
        got = self._writers.get(target)
        if got is None:
            with writing(target):
                if self.parquet:
                    import pyarrow.parquet as pq

                    w: Any = pq.ParquetWriter(self._partial(target), batch.schema)
                else:
                    w = pa.ipc.new_file(self._partial(target), batch.schema)
            got = self._writers[target] = (w, batch.schema, what)
        w, schema, holds = got
        if holds != what:
            raise OutputSchemaError(
                f"sequence {seq}: {what} and {holds} would share {target}; write to a "
                "directory (--out DIR) instead"
            )
        if not batch.schema.equals(schema):
            raise OutputSchemaError(
                f"sequence {seq}: its rows ({', '.join(batch.schema.names)}) do not match"
                f" the schema ({', '.join(schema.names)}) of {target}; write to a directory"
                " (--out DIR) instead"
            )
        with writing(target):
            w.write_batch(batch)

    def write(self, b: ConsumedBatch) -> int:
        import pyarrow as pa

        if is_bundles(b):
            from tieredbuf.format.segment import decode_segment

            n = 0
            for bundle in decode_segment(b.data, obj=b.location):
                for slot in sorted(bundle.slots):
                    self._put(slot, bundle.slots[slot], b.sequence)
                    n += bundle.slots[slot].num_rows
            return n
        rows = record_rows(b)
        recs = b.entries
        batch = pa.record_batch(
            {
                "sequence": pa.array([b.sequence] * len(recs), pa.uint64()),
                "index": pa.array(range(len(recs)), pa.uint32()),
                "ingestion_time": pa.array(
                    [r["ingestion_time_ms"] for r in rows], pa.timestamp("ms", tz="UTC")
                ),
                "metadata": pa.array([_metadata_of(b, i) for i in range(len(recs))], pa.binary()),
                "value": pa.array(recs, pa.binary()),
            }
        )
        self._put(-1, batch, b.sequence)
        return len(recs)

    def commit(self) -> None:
        """Close every file, fsync it, rename it to its name and fsync the folder: the rows
        are durable and every file under its final name is complete."""
        for target, (w, _, _) in self._writers.items():
            partial = self._partial(target)
            with writing(target):
                w.close()
                with open(partial, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(partial, target)
        if self._writers:
            with writing(self.path.parent):
                fsync_dir(self.path.parent)
        self._writers.clear()

    def close(self) -> None:
        self.commit()

    def abort(self) -> None:
        """A failed run: drop the partial files (nothing was acked)."""
        for target, (w, _, _) in self._writers.items():
            with contextlib.suppress(Exception):
                w.close()
            self._partial(target).unlink(missing_ok=True)
        self._writers.clear()


def _metadata_of(b: ConsumedBatch, i: int) -> bytes:
    m = _item_for(b.metadata, i)
    return b"" if m is None else m.payload


def make_sink(args: argparse.Namespace, out: TextIO) -> Sink:
    if not args.out:
        return StdoutSink(out, args.json)
    path = Path(args.out)
    suffix = path.suffix.lower()
    if suffix in ARROW_SUFFIXES or suffix in PARQUET_SUFFIXES:
        if args.follow and not args.no_ack:
            raise ConfigError(
                f"--follow with --out {args.out} would never ack (an Arrow or Parquet file "
                "is complete only when closed): use --out DIR, or --no-ack"
            )
        return ArrowFileSink(path, parquet=suffix in PARQUET_SUFFIXES)
    if suffix and not path.is_dir():
        raise ConfigError(
            f"--out {args.out}: {suffix} is not an output format; give a directory (one "
            f"file per data object), FILE.arrow ({', '.join(ARROW_SUFFIXES)}) or "
            f"FILE.parquet ({', '.join(PARQUET_SUFFIXES)}); for text, redirect stdout "
            "(--json for one JSON object per record)"
        )
    return DirSink(path)


class _Reader:
    """``--no-ack``: a plain reader; never fences, acks or writes."""

    def __init__(self, buf: tieredbuf.Buffer, start: str) -> None:
        self.buf = buf
        if start == "earliest":
            self.reader = buf.reader()
        elif start == "latest":
            self.reader = buf.reader(start_sequence=buf.snapshot().root.next_seq)
        else:
            self.reader = buf.reader(start_sequence=int(start))
        self._pending: list[Any] = []

    def next_batch(self) -> ConsumedBatch | None:
        if not self._pending:
            self._pending = self.reader.poll_sized()
            if not self._pending:
                return None
        e, size = self._pending.pop(0)
        return ConsumedBatch(e.sequence, e.location, e.metadata, self.buf.read_object(e, size))


def _sequence(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"bad sequence {text!r}: a number >= 0")
    return int(text)


def _start(text: str) -> str:
    if text in ("earliest", "latest") or text.isdigit():
        return text
    raise argparse.ArgumentTypeError(
        f"bad --from {text!r}: use a sequence number, earliest or latest"
    )


class _Follow:
    """Waits between empty polls: the consumer's long poll, or a doubling backoff."""

    def __init__(self, source: Any, poll_max: float) -> None:
        self.source = source
        self.poll_max = poll_max
        self.wait = POLL_MIN
        try:
            params = inspect.signature(source.next_batch).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        self.long_poll = "timeout" in params

    def next_batch(self, stop: Stop) -> ConsumedBatch | None:
        if self.long_poll:
            got: ConsumedBatch | None = self.source.next_batch(timeout=self.poll_max)
            return got
        got = self.source.next_batch()
        if got is not None:
            self.wait = POLL_MIN
            return got
        stop.wait(self.wait)  # Ctrl-C ends the wait at once
        self.wait = min(self.poll_max, self.wait * 2)
        return None


@contextlib.contextmanager
def _ctrl_c(stop: SignalEvent) -> Iterator[None]:
    """The first Ctrl-C sets ``stop`` (the current batch is finished, written and acked,
    then the summary prints); a second one raises KeyboardInterrupt at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_int(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    old = signal.signal(signal.SIGINT, on_int)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def cmd_consume(args: argparse.Namespace, out: TextIO) -> int:
    if args.start is not None and not args.no_ack:
        raise ConfigError(
            "--from needs --no-ack (the acking consumer resumes after its last ack: --after SEQ)"
        )
    if args.no_ack and args.subscriber != "default":
        raise ConfigError("--subscriber is for the acking consumer; --no-ack reads without one")
    if args.after is not None and args.no_ack:
        raise ConfigError("--after is for the acking consumer; with --no-ack use --from SEQ")
    buf: tieredbuf.Buffer = open_buffer(args)
    require_buffer(buf, create=args.create)
    sink = make_sink(args, out)
    consumer = None
    if args.no_ack:
        source: Any = _Reader(buf, args.start or "earliest")
    else:
        if args.after is not None:
            nxt = buf.snapshot().root.next_seq
            if args.after >= nxt:  # the consumer would skip entries not yet appended
                raise ConfigError(
                    f"--after {args.after} is past the queue's last sequence "
                    f"({nxt - 1 if nxt else 'none yet'}): resuming there would "
                    "skip what is appended next"
                )
        consumer = buf.consumer(subscriber=args.subscriber)
        consumer.initialize(args.after)
        source = consumer
    follow = _Follow(source, args.poll_max.total_seconds()) if args.follow else None
    batches = records = 0
    unacked: list[int] = []
    acked: int | None = None
    stop = SignalEvent()  # set by the Ctrl-C handler: a threading.Event may deadlock there
    forced = False
    failed: OutputError | None = None
    # records go to stdout: a progress line there would mix with them
    with (
        stop,
        Progress("consume", stream=sys.stderr if args.out else cast(TextIO, _NullTty())) as bar,
        _ctrl_c(stop),
    ):
        try:
            while not stop.is_set() and (args.max_batches is None or batches < args.max_batches):
                b = follow.next_batch(stop) if follow else source.next_batch()
                if b is None:
                    if follow:
                        continue
                    break
                # an entry is acked only once all of it reached the output (I10): stdout
                # took every byte (a pipe closed halfway fails here), or its file is
                # fsynced; an Arrow or Parquet file is acked once closed, at the end
                records += sink.write(b)
                batches += 1
                bar.update(1, f"seq {b.sequence}")
                if not isinstance(sink, ArrowFileSink):
                    sink.commit()
                if consumer is not None:
                    unacked.append(b.sequence)
                    if not isinstance(sink, ArrowFileSink):
                        for s in unacked:
                            consumer.ack(s)
                        acked, unacked = unacked[-1], []
        except KeyboardInterrupt:  # a second Ctrl-C
            forced = True
        except OutputError as e:  # a closed pipe, a full disk: what was written stays acked
            failed = e
        except BaseException:
            sink.abort()  # nothing unacked is left under a name a reader would open
            raise
        interrupted = forced or stop.is_set()
        if failed is None:
            try:
                sink.close()
            except OutputError as e:
                failed = e
        if failed is not None:
            sink.abort()
            unacked = []  # not all of it reached the output
        if consumer is not None:
            for s in unacked:  # written and closed (a file sink's rows are durable now)
                consumer.ack(s)
                acked = s
            consumer.flush()
            consumer.close()
    what = (
        "read (no ack)"
        if args.no_ack
        else ("nothing acked" if acked is None else f"acked through sequence {acked}")
    )
    summary = (
        f"consumed {batches} {plural(batches, 'batch')}, {records} {plural(records, 'record')}"
    )
    if failed is not None and not isinstance(failed, OutputClosedError):
        raise OutputError(f"{failed}; {summary}; {what}") from failed  # one line, exit 3
    if isinstance(failed, OutputClosedError):
        head = "output closed: "  # then the quiet exit of a closed pipe (141, as cat's)
    else:
        head = "interrupted: " if interrupted else ""
    print(f"{head}{summary}; {what}", file=sys.stderr)
    if failed is not None:
        raise failed
    if forced or (interrupted and not args.follow):
        return 130
    return 0


class _NullTty:
    def isatty(self) -> bool:
        return False

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


def add_parser(sub: Any) -> None:
    co = sub.add_parser(
        "consume",
        help="print or write the queue; acks unless --no-ack",
        description="Read the queue in order.  By default the buffer's fenced consumer: it "
        "fences any older consumer (Spark streams included), acks each batch once "
        "its output is written, and dequeues it.  --no-ack is a plain reader "
        "instead: it never fences, acks or writes, and can run beside a live "
        "consumer.",
        epilog="Exit codes: 0 done (or --follow stopped by Ctrl-C); 2 bad usage or no buffer "
        "at URL; 3 store or data failure (e.g. fenced by a newer consumer); 130 "
        "interrupted.",
    )
    co.add_argument("url")
    co.add_argument(
        "--no-ack",
        action="store_true",
        help="a plain reader: no epoch bump, no ack, no dequeue (does not disturb a live consumer)",
    )
    co.add_argument(
        "--from",
        dest="start",
        type=_start,
        metavar="SEQ|earliest|latest",
        help="--no-ack only: where to start (default earliest: the first retained sequence)",
    )
    co.add_argument(
        "--after",
        type=_sequence,
        metavar="SEQ",
        help="acking consumer: resume after this acked sequence (default: the queue's head)",
    )
    co.add_argument(
        "--subscriber",
        default="default",
        metavar="NAME",
        help="acking consumer: read and ack as this named subscriber (its own "
        "position; fences only older instances of NAME)",
    )
    co.add_argument(
        "--follow", action="store_true", help="keep reading as entries land, until Ctrl-C"
    )
    co.add_argument(
        "--poll-max",
        type=parse_duration,
        default=dt.timedelta(seconds=1),
        metavar="DURATION",
        help="--follow: longest wait between polls of an idle queue "
        "(default 1s; the backoff starts at 50ms)",
    )
    co.add_argument(
        "--json",
        action="store_true",
        help="records as JSON: sequence, index, ingestion_time_ms, metadata, value "
        "(value_base64 for bytes that are not UTF-8; bundles are always JSON rows).  "
        "Plain output is one line per record and not byte-faithful: bytes that are not "
        "UTF-8 print as \\xNN escapes and a record holding a newline prints as two "
        "lines; use --json (or --out DIR) for the exact bytes",
    )
    co.add_argument(
        "--out",
        metavar="DIR|FILE.arrow|FILE.parquet",
        help="DIR: each data object as DIR/<sequence>.batch|.qseg; FILE.arrow "
        "(Arrow IPC) or FILE.parquet: the rows (default: stdout)",
    )
    co.add_argument(
        "--max-batches", type=int, metavar="N", help="stop after N batches (default: no limit)"
    )
    co.add_argument(
        "--create",
        action="store_true",
        help="create an empty buffer at URL if there is none (default: exit 2)",
    )
    store_args(co)
    co.set_defaults(fn=cmd_consume)
