"""``tieredbuf work URL QUEUE -- CMD [ARG ...]``: a job runner over a shared work queue.

Each claimed entry runs ``CMD`` once, with the entry's records on stdin (one per line;
an Arrow bundle object as one JSON object per row) and ``TIEREDBUF_SEQUENCE``,
``TIEREDBUF_LOCATION``, ``TIEREDBUF_RECORDS``, ``TIEREDBUF_QUEUE`` and ``TIEREDBUF_URL`` in
its environment.  Its exit status decides:

* 0: the entry is acked (done, never delivered again);
* a ``--reject-exit`` code: it is rejected, with the exit status and the last line CMD
  wrote to stderr as the reason (``tieredbuf subscribers URL`` lists it), never
  redelivered;
* anything else (or killed by a signal): it is handed back (deferred) and redelivered,
  to this runner or another one, until ``--max-deliveries`` rejects it.

A CMD still running when its lease is about to lapse is stopped (SIGTERM, then SIGKILL)
and the entry handed back: another worker could otherwise take it while it runs.  A
runner that dies holding leases (``kill -9``, a lost machine) delays those entries by at
most ``--lease``; then any runner gets them.  Processing is at-least-once; every entry
is acked exactly once (docs/subscribers.md).

Without ``--follow`` the runner stops when nothing is claimable; with it, it waits for
entries (polling with a backoff up to ``--poll-max``) until Ctrl-C or SIGTERM, which let
the running commands finish, hand back what is held, and exit (130 after Ctrl-C).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import IO, Any, TextIO

import tieredbuf
from tieredbuf.cli._common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PARTIAL,
    fmt_duration,
    open_buffer,
    parse_duration,
    store_args,
    timeout_arg,
)
from tieredbuf.consume.consumer import ConsumedBatch
from tieredbuf.errors import ConfigError, LeaseExpiredError
from tieredbuf.runtime.signals import SignalEvent

POLL_MIN = 0.05
STOP_GRACE_S = 5.0
"""After SIGTERM, how long a CMD stopped at its lease's end gets before SIGKILL."""


def split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``work ... -- CMD ARG ...``: the arguments before ``--``, and the command after it
    (None for other commands, or without ``--``)."""
    if argv[:1] == ["work"] and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, None


def _stdin_of(b: ConsumedBatch) -> bytes:
    """The entry as CMD reads it: records one per line, or bundle rows as JSON lines."""
    from tieredbuf.cli.consume import bundle_rows, is_bundles

    if is_bundles(b):
        return b"".join(json.dumps(r, default=str).encode() + b"\n" for r in bundle_rows(b))
    return b"".join(r + b"\n" for r in b.entries)


def _feed(pipe: IO[bytes] | None, data: bytes) -> None:
    if pipe is None:
        return
    with contextlib.suppress(BrokenPipeError, OSError):  # CMD need not read it all
        pipe.write(data)
    with contextlib.suppress(BrokenPipeError, OSError):
        pipe.close()


class _Runner:
    """Shared by the worker threads: the options, the counts, the output lock."""

    def __init__(self, args: argparse.Namespace, buf: tieredbuf.Buffer, stop: SignalEvent):
        self.args, self.buf, self.stop = args, buf, stop
        self.lease: timedelta = args.lease
        self.margin = min(self.lease.total_seconds() / 4, 5.0)
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.error: BaseException | None = None
        self.handled = 0

    def say(self, text: str) -> None:
        with self.lock:
            print(f"work: {text}", file=sys.stderr, flush=True)

    def take_turn(self) -> bool:
        """One more entry may be handled (``--limit``)."""
        with self.lock:
            if self.args.limit and self.handled >= self.args.limit:
                return False
            self.handled += 1
            return True

    def loop(self) -> None:
        a = self.args
        w = self.buf.worker(
            a.queue,
            lease=self.lease,
            claim_batch=1,
            max_claim_batch=1,
            refill_ahead=False,  # a lease covers one command: none starts before its claim
            read_ahead=1,
            max_deliveries=a.max_deliveries or None,
        )
        try:
            w.initialize(a.start)
            wait = POLL_MIN
            while not self.stop.is_set():
                if not self.take_turn():
                    self.stop.set()
                    break
                try:
                    b = w.claim()
                except LeaseExpiredError as e:  # an earlier ack, applied late
                    self.lapsed(e.sequences)
                    continue
                if b is None:
                    with self.lock:
                        self.handled -= 1
                    if not a.follow:
                        break
                    self.stop.wait(wait)  # Ctrl-C ends the wait at once
                    wait = min(a.poll_max.total_seconds(), wait * 2)
                    continue
                wait = POLL_MIN
                self.handle(w, b)
        except BaseException as e:
            with self.lock:
                self.error = self.error or e
            self.stop.set()
        finally:
            try:
                w.close()  # applies buffered acks, hands back what it still holds
            except LeaseExpiredError as e:
                self.lapsed(e.sequences)

    def lapsed(self, seqs: Sequence[int]) -> None:
        self.counts["lapsed"] += len(seqs)
        self.say(
            f"sequence {', '.join(map(str, seqs))}: the lease lapsed and another worker "
            f"took the entry; this result changed nothing (--lease "
            f"{fmt_duration(self.lease)} is too short for CMD?)"
        )

    def handle(self, w: Any, b: ConsumedBatch) -> None:
        a = self.args
        deadline = time.monotonic() + self.lease.total_seconds() - self.margin
        env = {
            **os.environ,
            "TIEREDBUF_SEQUENCE": str(b.sequence),
            "TIEREDBUF_LOCATION": b.location,
            "TIEREDBUF_QUEUE": a.queue,
            "TIEREDBUF_URL": a.url,
            "TIEREDBUF_RECORDS": str(_count(b)),
        }
        t0 = time.monotonic()
        code, tail = self.run(_stdin_of(b), env, deadline)
        took = f"{time.monotonic() - t0:.1f} s"
        try:
            if code == 0:
                w.ack(b.sequence)
                self.counts["acked"] += 1
                self.say(f"sequence {b.sequence}: exit 0 -> acked ({took})")
            elif code is not None and code in (a.reject_exit or ()):
                reason = f"exit {code}" + (f": {tail}" if tail else "")
                w.reject(b.sequence, reason=reason.encode()[:1024])
                self.counts["rejected"] += 1
                self.say(f"sequence {b.sequence}: {reason} -> rejected ({took})")
            else:
                w.defer(b.sequence)
                self.counts["handed back"] += 1
                why = (
                    f"still running {took} into its {fmt_duration(self.lease)} lease: "
                    f"stopped (raise --lease)"
                    if code is None
                    else f"exit {code}"
                )
                self.say(f"sequence {b.sequence}: {why} -> handed back for redelivery")
        except LeaseExpiredError as e:
            self.lapsed(e.sequences)

    def run(self, data: bytes, env: dict[str, str], deadline: float) -> tuple[int | None, str]:
        """Run CMD with ``data`` on stdin until it exits or ``deadline``; its exit status
        (None: stopped at the deadline) and the last line it wrote to stderr."""
        try:
            proc = subprocess.Popen(
                self.args.cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env
            )
        except OSError as e:
            raise ConfigError(f"cannot run {self.args.cmd[0]!r}: {e.strerror}") from None
        tail: collections.deque[bytes] = collections.deque(maxlen=1)

        def forward() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                with self.lock:
                    sys.stderr.buffer.write(line)
                    sys.stderr.flush()
                if line.strip():
                    tail.append(line.strip())

        threads = [
            threading.Thread(target=_feed, args=(proc.stdin, data), daemon=True),
            threading.Thread(target=forward, daemon=True),
        ]
        for t in threads:
            t.start()
        code: int | None
        try:
            code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_GRACE_S)
            code = None
        for t in threads:
            t.join(STOP_GRACE_S)  # a grandchild may hold stderr open: not forever
        last = tail[0].decode("utf-8", "replace") if tail else ""
        return code, last


def _count(b: ConsumedBatch) -> int:
    from tieredbuf.cli.consume import bundle_rows, is_bundles

    return len(bundle_rows(b)) if is_bundles(b) else len(b.entries)


def cmd_work(args: argparse.Namespace, out: TextIO) -> int:
    if not args.cmd:
        raise ConfigError(
            "give the command to run after --: tieredbuf work URL QUEUE -- CMD [ARG ...]"
        )
    if args.concurrency < 1:
        raise ConfigError(f"--concurrency must be at least 1, got {args.concurrency}")
    buf = open_buffer(args)
    if not buf.exists():
        raise tieredbuf.BufferNotFoundError(buf.url, "a worker never creates one")
    stop = SignalEvent()
    got: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and got:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        got.append(signum)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    runner = _Runner(args, buf, stop)
    threads = [
        threading.Thread(target=runner.loop, name=f"tb-work-{i}", daemon=True)
        for i in range(args.concurrency)
    ]
    try:
        with stop:
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.2)  # short joins: the signal handler runs in between
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    c = runner.counts
    summary = (
        ", ".join(f"{c[k]} {k}" for k in ("acked", "rejected", "handed back", "lapsed") if c[k])
        or "nothing to do"
    )
    print(f"work: {summary}" + ("; interrupted" if got else ""), file=sys.stderr)
    if runner.error is not None:
        raise runner.error
    if signal.SIGINT in got:
        return EXIT_INTERRUPTED
    return EXIT_PARTIAL if c["rejected"] or c["handed back"] or c["lapsed"] else EXIT_OK


def add_parser(sub: Any) -> None:
    wk = sub.add_parser(
        "work",
        help="run a command once per entry of a work queue (a job runner)",
        usage="tieredbuf work URL QUEUE [options] -- CMD [ARG ...]",
        description="Claim entries of the shared work queue QUEUE of the buffer at URL and "
        "run CMD once per entry, with its records on stdin (one per line).  Exit "
        "0 acks the entry; a --reject-exit code rejects it (never redelivered); "
        "any other exit hands it back for redelivery.  A CMD still running at "
        "the end of its lease is stopped and the entry handed back.  Without "
        "--follow it stops when nothing is claimable.  Exit status: 0 every CMD "
        "exited 0; 1 some entry was rejected or handed back; 130 Ctrl-C.",
    )
    wk.add_argument("url", help="the buffer (it must exist)")
    wk.add_argument("queue", help="the work queue: a shared subscriber name, created on first use")
    wk.add_argument(
        "--lease",
        type=parse_duration,
        default=timedelta(seconds=30),
        metavar="DURATION",
        help="how long an entry is this runner's: CMD must finish in it",
    )
    wk.add_argument(
        "--concurrency", type=int, default=1, metavar="N", help="run up to N commands at once"
    )
    wk.add_argument(
        "--reject-exit",
        type=int,
        action="append",
        metavar="CODE",
        help="an exit status that rejects the entry (repeatable; default: none, "
        "every failure is handed back)",
    )
    wk.add_argument(
        "--max-deliveries",
        type=int,
        default=5,
        metavar="N",
        help="reject an entry instead of delivering it an N+1-th time; 0: redeliver forever",
    )
    wk.add_argument(
        "--follow", action="store_true", help="keep waiting for entries until Ctrl-C or SIGTERM"
    )
    wk.add_argument(
        "--poll-max",
        type=parse_duration,
        default=timedelta(seconds=1),
        metavar="DURATION",
        help="--follow: longest wait between polls",
    )
    wk.add_argument(
        "--limit",
        type=int,
        default=0,
        metavar="N",
        help="stop after N entries (default 0: no limit)",
    )
    wk.add_argument(
        "--start",
        choices=("earliest", "latest"),
        default="earliest",
        help="where a new work queue starts",
    )
    timeout_arg(wk)
    store_args(wk)
    wk.set_defaults(fn=cmd_work, cmd=None)


__all__ = ["add_parser", "cmd_work", "split_command"]
