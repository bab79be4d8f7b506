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
import contextlib
import datetime as dt
import inspect
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO, cast

import tieredbuf
from tieredbuf.cli._common import (
    Progress,
    open_buffer,
    parse_duration,
    plural,
    require_buffer,
    store_args,
)
from tieredbuf.cli.sinks import ArrowFileSink, make_sink
from tieredbuf.consume.consumer import ConsumedBatch
from tieredbuf.errors import ConfigError, OutputClosedError, OutputError
from tieredbuf.runtime.signals import SignalEvent, Stop

POLL_MIN = 0.05
"""First wait of --follow's idle backoff (seconds); doubles up to --poll-max."""


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
