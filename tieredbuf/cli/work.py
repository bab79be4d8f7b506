"""``tieredbuf work URL QUEUE -- CMD [ARG ...]``: a job runner over a shared work queue.

Each claimed entry runs ``CMD`` once, with the entry's records on stdin (one per line;
an Arrow bundle object as one JSON object per row) and ``TIEREDBUF_SEQUENCE``,
``TIEREDBUF_LOCATION``, ``TIEREDBUF_RECORDS``, ``TIEREDBUF_QUEUE`` and ``TIEREDBUF_URL`` in
its environment.  Its exit status decides:

* 0: the entry is acked (done, never delivered again);
* a ``--reject-exit`` code: it is rejected, with the exit status and the last line CMD
  wrote to stderr as the reason -- a dead letter, listed by ``tieredbuf subscribers URL``
  and kept until ``tieredbuf subscribers redrive URL QUEUE`` sends it back (or drops it);
* anything else (or killed by a signal): it is handed back (deferred) and redelivered,
  to this runner or another one, after a delay that doubles with each delivery
  (``--redelivery-delay``, 1 s; at most ``--redelivery-delay-max``, 5 min), until
  ``--max-deliveries`` rejects it.

CMD runs in a process group of its own (:mod:`tieredbuf.cli.jobproc`).  While it runs,
its lease is extended every third of ``--lease`` (SQS's ChangeMessageVisibility), so a
long command keeps its entry.  CMD and its whole group are stopped (SIGTERM, then
SIGKILL) only at ``--max-run``, or when the lease cannot be kept (another worker took
the entry, or the extensions failed until the lease's margin): never left to run beside
another worker's copy.  When CMD exits, what it left running in its group is killed; if
the runner itself dies, the group's shim kills the group.  A runner that dies holding a
lease delays that entry by at most ``--lease``; then any runner gets it.  Processing is
at-least-once; every entry is acked exactly once (docs/subscribers.md).

Without ``--follow`` the runner stops when nothing is claimable or waiting for its
redelivery delay; with it, it waits for entries (a long poll: the root's 22-byte footer
read with a backoff up to ``--poll-max``) until Ctrl-C or SIGTERM, which let the
running commands finish, hand back what is held, and exit (130 after Ctrl-C); a second
Ctrl-C or SIGTERM stops the running commands at once.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TextIO

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
from tieredbuf.cli.jobproc import Job
from tieredbuf.consume.consumer import ConsumedBatch
from tieredbuf.errors import ConfigError, LeaseExpiredError, TieredBufError
from tieredbuf.runtime.signals import SignalEvent

STOP_GRACE_S = 5.0
"""After SIGTERM to its process group, how long a stopped CMD gets before SIGKILL (less
when its lease would not last that long)."""
HEARTBEAT = 1 / 3
"""A running CMD's lease is extended every this fraction of ``--lease``."""


def split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``work ... -- CMD ARG ...``: the arguments before ``--``, and the command after it
    (None for other commands, or without ``--``)."""
    if argv[:1] == ["work"] and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, None


def _stdin_of(b: ConsumedBatch) -> bytes:
    """The entry as CMD reads it: records one per line, or bundle rows as JSON lines."""
    from tieredbuf.cli.sinks import bundle_rows, is_bundles

    if is_bundles(b):
        return b"".join(json.dumps(r, default=str).encode() + b"\n" for r in bundle_rows(b))
    return b"".join(r + b"\n" for r in b.entries)


class _Runner:
    """Shared by the worker threads: the options, the counts, the output lock, the jobs
    running (killed if the runner leaves with them still running)."""

    def __init__(self, args: argparse.Namespace, buf: tieredbuf.Buffer, stop: SignalEvent):
        self.args, self.buf, self.stop = args, buf, stop
        self.lease: timedelta = args.lease
        self.lease_s = self.lease.total_seconds()
        self.margin = min(self.lease_s / 4, 5.0)
        self.beat = self.lease_s * HEARTBEAT
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.error: BaseException | None = None
        self.handled = 0
        self.workers: list[Any] = []
        self.jobs: set[Job] = set()

    def say(self, text: str) -> None:
        with self.lock:
            print(f"work: {text}", file=sys.stderr, flush=True)

    def write_err(self, line: bytes) -> None:
        with self.lock:
            sys.stderr.buffer.write(line)
            sys.stderr.flush()

    def take_turn(self) -> bool:
        """One more entry may be handled (``--limit``)."""
        with self.lock:
            if self.args.limit and self.handled >= self.args.limit:
                return False
            self.handled += 1
            return True

    def give_back_turn(self) -> None:
        with self.lock:
            self.handled -= 1

    def wake(self) -> None:
        """Stop waiting for entries (Ctrl-C, SIGTERM): every worker's claim returns."""
        with self.lock:
            workers = list(self.workers)
        for w in workers:
            w.wake()

    def kill_jobs(self) -> None:
        with self.lock:
            jobs = list(self.jobs)
        for j in jobs:
            j.kill()

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
            redelivery_delay=a.redelivery_delay,
            redelivery_delay_max=max(a.redelivery_delay_max, a.redelivery_delay),
            idle_poll_max=a.poll_max,
        )
        with self.lock:
            self.workers.append(w)
        try:
            w.initialize(a.start)
            while not self.stop.is_set():
                if not self.take_turn():
                    self.stop.set()
                    break
                try:
                    b = self.next_entry(w)
                except LeaseExpiredError as e:  # an earlier ack, applied late
                    self.give_back_turn()
                    self.lapsed(e.sequences)
                    continue
                if b is None:
                    self.give_back_turn()
                    if a.follow or (w.waiting_s() is not None and not self.stop.is_set()):
                        continue  # entries wait for their redelivery delay: wait for them
                    break
                self.handle(w, b)
        except BaseException as e:
            with self.lock:
                self.error = self.error or e
            self.stop.set()
            self.wake()
        finally:
            try:
                w.close()  # applies buffered acks, hands back what it still holds
            except LeaseExpiredError as e:
                self.lapsed(e.sequences)

    def next_entry(self, w: Any) -> ConsumedBatch | None:
        """The next entry: with ``--follow`` a long poll (1 s at a time, so a stop is seen);
        without it, at once -- or, when entries wait for their redelivery delay, once the
        first of them is due."""
        if self.args.follow:
            return w.claim(timeout=1.0)  # type: ignore[no-any-return]
        b = w.claim()
        if b is None and (due := w.waiting_s()) is not None:
            b = w.claim(timeout=due + 1.0)
        return b  # type: ignore[no-any-return]

    def lapsed(self, seqs: Sequence[int]) -> None:
        self.counts["lapsed"] += len(seqs)
        self.say(
            f"sequence {', '.join(map(str, seqs))}: the lease lapsed and another worker "
            f"took the entry; this result changed nothing"
        )

    def handle(self, w: Any, b: ConsumedBatch) -> None:
        a = self.args
        env = {
            **os.environ,
            "TIEREDBUF_SEQUENCE": str(b.sequence),
            "TIEREDBUF_LOCATION": b.location,
            "TIEREDBUF_QUEUE": a.queue,
            "TIEREDBUF_URL": a.url,
            "TIEREDBUF_RECORDS": str(_count(b)),
        }
        t0 = time.monotonic()
        extended = self.counts["extended"]
        code, tail, why = self.run(w, b.sequence, _stdin_of(b), env)
        took = f"{time.monotonic() - t0:.1f} s"
        if self.counts["extended"] > extended and self.args.concurrency == 1:
            took += f", lease extended {self.counts['extended'] - extended} times"
        seq = b.sequence
        try:
            if why == "lost":
                self.counts["lapsed"] += 1
                self.say(
                    f"sequence {seq}: the lease could not be extended (another worker took "
                    f"the entry): stopped with its process group after {took}"
                )
            elif code == 0:
                w.ack(seq)
                self.counts["acked"] += 1
                self.say(f"sequence {seq}: exit 0 -> acked ({took})")
            elif code is not None and code in (a.reject_exit or ()):
                reason = f"exit {code}" + (f": {tail}" if tail else "")
                w.reject(seq, reason=reason.encode()[:1024])
                self.counts["rejected"] += 1
                self.say(f"sequence {seq}: {reason} -> rejected ({took})")
            else:
                w.defer(seq)
                self.counts["handed back"] += 1
                if why == "max-run":
                    what = f"ran past --max-run {fmt_duration(a.max_run)}: stopped"
                elif why == "lease":
                    what = "its lease could not be kept (store errors): stopped"
                else:
                    what = (
                        f"exit {code}"
                        if code is not None and code >= 0
                        else f"killed by signal {-(code or 0)}"
                    )
                due = w.waiting_s()
                after = f" in {due:.1f} s" if due else ""
                self.say(f"sequence {seq}: {what} -> handed back for redelivery{after} ({took})")
        except LeaseExpiredError as e:
            self.lapsed(e.sequences)

    def run(
        self, w: Any, seq: int, data: bytes, env: dict[str, str]
    ) -> tuple[int | None, str, str | None]:
        """Run CMD for entry ``seq`` until it exits, extending the lease every third of it
        while it runs.  Stopped (with its whole process group) at ``--max-run``, or when
        the lease cannot be kept: another worker took it (``lost``), or the extensions
        kept failing until the margin (``lease``).  Its exit status (None: stopped), the
        last line it wrote to stderr, and why it was stopped."""
        job = Job(self.args.cmd, data, env, self.write_err)
        with self.lock:
            self.jobs.add(job)
        try:
            return self._supervise(w, seq, job)
        finally:
            with self.lock:
                self.jobs.discard(job)

    def _supervise(self, w: Any, seq: int, job: Job) -> tuple[int | None, str, str | None]:
        t0 = time.monotonic()
        end = t0 + self.args.max_run.total_seconds() if self.args.max_run else None
        beat_at = t0 + self.beat
        why: str | None = None
        while True:
            until = beat_at if end is None else min(beat_at, end)
            if job.wait(until):
                break
            now = time.monotonic()
            left_s = (w.expires_ms(seq) - w.clock_ms()) / 1000
            if end is not None and now >= end:
                why = "max-run"
                job.stop(grace=min(STOP_GRACE_S, max(0.0, left_s - self.margin / 2)))
                break
            try:
                w.extend(seq, self.lease)
                self.counts["extended"] += 1
                beat_at = time.monotonic() + self.beat
            except LeaseExpiredError:
                why = "lost"
                job.stop(grace=0.0)
                break
            except TieredBufError as e:
                if left_s <= self.margin:
                    why = "lease"
                    job.stop(grace=max(0.0, left_s - self.margin / 2))
                    break
                self.say(f"sequence {seq}: extending the lease failed ({e}); trying again")
                beat_at = time.monotonic() + min(self.beat, 0.5)
        code, tail = job.finish()
        return code, tail, why


def _count(b: ConsumedBatch) -> int:
    from tieredbuf.cli.sinks import bundle_rows, is_bundles

    return len(bundle_rows(b)) if is_bundles(b) else len(b.entries)


def cmd_work(args: argparse.Namespace, out: TextIO) -> int:
    if not args.cmd:
        raise ConfigError(
            "give the command to run after --: tieredbuf work URL QUEUE -- CMD [ARG ...]"
        )
    if args.concurrency < 1:
        raise ConfigError(f"--concurrency must be at least 1, got {args.concurrency}")
    if shutil.which(args.cmd[0]) is None:  # before an entry is claimed (and charged) for it
        raise ConfigError(f"cannot run {args.cmd[0]!r}: not found")
    buf = open_buffer(args)
    if not buf.exists():
        raise tieredbuf.BufferNotFoundError(buf.url, "a worker never creates one")
    stop = SignalEvent()
    got: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        got.append(signum)  # the main loop acts on it (nothing here takes a lock)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    runner = _Runner(args, buf, stop)
    threads = [
        threading.Thread(target=runner.loop, name=f"tb-work-{i}", daemon=True)
        for i in range(args.concurrency)
    ]
    woken = killed = False
    try:
        with stop:
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.2)  # short joins: the signal handler runs in between
                    if stop.is_set() and not woken:
                        woken = True
                        runner.wake()  # claims waiting for entries return now
                    if len(got) > 1 and not killed:
                        killed = True  # a second Ctrl-C or SIGTERM: stop the commands now
                        runner.kill_jobs()
    finally:
        runner.kill_jobs()  # nothing of a command outlives the runner
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
        "0 acks the entry; a --reject-exit code rejects it (a dead letter, kept for "
        "`tieredbuf subscribers redrive`); any other exit hands it back for redelivery "
        "after a delay that doubles with each delivery.  While CMD runs its lease is "
        "extended every third of --lease; CMD and its whole process group are stopped "
        "only at --max-run or when the lease cannot be kept.  Without --follow it stops "
        "when nothing is claimable or waiting for redelivery.  Exit status: 0 every CMD "
        "exited 0; 1 some entry was rejected or handed back; 130 Ctrl-C.",
    )
    wk.add_argument("url", help="the buffer (it must exist)")
    wk.add_argument("queue", help="the work queue: a shared subscriber name, created on first use")
    wk.add_argument(
        "--lease",
        type=parse_duration,
        default=timedelta(seconds=30),
        metavar="DURATION",
        help="how long an entry is this runner's without a word from it: extended every "
        "third of it while CMD runs; a runner that dies leaves it to lapse, then another "
        "runner takes the entry (default 30s)",
    )
    wk.add_argument(
        "--max-run",
        type=parse_duration,
        default=None,
        metavar="DURATION",
        help="stop CMD (SIGTERM to its process group, SIGKILL 5 s later) and hand the entry "
        "back once it ran this long (default: no limit)",
    )
    wk.add_argument(
        "--redelivery-delay",
        type=parse_duration,
        default=timedelta(seconds=1),
        metavar="DURATION",
        help="a handed-back entry is claimable again this long after its first delivery, "
        "doubling with each further one (default 1s; 0: at once)",
    )
    wk.add_argument(
        "--redelivery-delay-max",
        type=parse_duration,
        default=timedelta(minutes=5),
        metavar="DURATION",
        help="the longest redelivery delay (default 5m)",
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
        default=timedelta(seconds=3),
        metavar="DURATION",
        help="--follow: longest pause between the 22-byte reads that look for new entries "
        "(default 3s: an idle runner sends at most 0.4 requests/s)",
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
