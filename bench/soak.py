"""Soak: staged producers, a consumer, a continuous reader, retention and GC together for
a bounded time; fails if a resource grows after warm-up (I8: bounded resources).

Everything runs in this one process against one buffer (``file://`` in a temp
directory by default, or ``memory://``):

* ``--producers`` staged producers (one staging directory each), each producing
  ``--rate`` records/s of ``--record-bytes`` (10 records per call), keeping at most
  ``WINDOW`` calls in flight (it waits for the oldest one's LOCAL ack beyond that);
* a consumer that reads, acks and dequeues everything (``dequeue_every`` 100);
* a continuous reader (``buf.reader``) that follows the queue and reads every data
  object (``on_lost="clamp"``: retention may unlink history before it gets there);
* retention (``max_age`` 20 s, stored in the root), so acked history is unlinked;
* GC every 5 s with a 10 s grace period (the buffer's, set in its root), so unlinked
  objects are deleted;
* ``SUBSCRIBERS`` (a callable per thread, started like the reader): by default a named
  subscriber ``soak-etl`` (its own progress object; ``on_lost="skip"``, since retention
  may unlink what it has not reached) and two workers of the shared work queue
  ``soak-jobs`` (leases of 30 s; acks out of order). The test suite appends a leaky
  one to prove the rule catches it.

A sampler records, every ``--sample`` seconds: RSS (VmRSS), open file descriptors
(/proc/self/fd), threads (/proc/self/status, native threads included), the stages'
disk bytes (files under the staging directories) and, for information, the store's
bytes, the consumer's lag and the records produced / consumed / read.

**The rule.**  The first ``--warmup`` seconds (default: a fifth of the run, at least
10 s) are ignored.  The samples after it are split into an earlier and a later half;
a resource *grows* if the later half's maximum exceeds the earlier half's maximum by
more than its tolerance: threads +2, open fds +8, RSS +10 % (at least 32 MiB), stage
disk bytes +25 % (at least 16 MiB; segments and WAL files come and go in steps of up
to a few MiB).  A steady sawtooth passes; a leak, which keeps raising the peaks, fails.
Any error in a worker thread, or a consumer or reader that makes no progress in the
later half, fails the run too.  Exit status 0 = pass, 1 = something grew or failed.

Prints the figures and writes ``bench/results/<--json>.json``.  Run it under
``flock /tmp/tieredbuf-bench.lock`` (it reports the load average); the test suite runs
a 30 s version (tests/test_soak.py, ``slow``).

    python bench/soak.py [--duration 600] [--store file|memory] [--producers 2] ...
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tieredbuf
from bench._common import print_table, write_json
from tieredbuf import gc
from tieredbuf.errors import BackpressureError, DataLossError

WINDOW = 64
"""produce() calls a producer keeps in flight before it waits for the oldest LOCAL ack."""
RECORDS_PER_CALL = 10
GC_GRACE = timedelta(seconds=10)
TOLERANCE = {
    "threads": ("abs", 2),
    "open_fds": ("abs", 8),
    "rss_bytes": ("rel", 0.10, 32 << 20),
    "stage_disk_bytes": ("rel", 0.25, 16 << 20),
}
Subscriber = Callable[[tieredbuf.Buffer, threading.Event, dict[str, int]], None]


def named_subscriber(
    buf: tieredbuf.Buffer, stop: threading.Event, counters: dict[str, int]
) -> None:
    c = buf.consumer(subscriber="soak-etl", on_lost="skip", dequeue_every=100)
    c.initialize()
    try:
        while not stop.is_set():
            b = c.next_batch()
            if b is None:
                stop.wait(0.05)
                continue
            counters["subscriber_read"] += len(b.entries)
            c.ack(b.sequence)
        c.flush()
    finally:
        c.close()


def shared_worker(buf: tieredbuf.Buffer, stop: threading.Event, counters: dict[str, int]) -> None:
    w = buf.worker("soak-jobs", lease=timedelta(seconds=30), on_lost="skip")
    try:
        while not stop.is_set():
            b = w.claim()
            if b is None:
                stop.wait(0.05)
                continue
            counters["worker_acked"] += len(b.entries)
            w.ack(b.sequence)
    finally:
        w.close()


SUBSCRIBERS: list[Subscriber] = [named_subscriber, shared_worker, shared_worker]
"""Hook: each is run on its own thread as ``fn(buf, stop, counters)`` until ``stop`` is
set, like _reader below; it counts what it reads in ``counters`` and raises on error."""


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # deleted while we walked
                total += os.stat(os.path.join(root, name)).st_size
    return total


def _thread_names() -> dict[str, int]:
    """Python threads by name, numbers stripped (``tb-export_3`` counts as ``tb-export``)."""
    return dict(collections.Counter(t.name.rstrip("0123456789_-") for t in threading.enumerate()))


def _named_growth(early: list[dict[str, Any]], late: list[dict[str, Any]]) -> str:
    """Which named threads a failure is made of: each name's max count, early -> late."""

    def peak(samples: list[dict[str, Any]], name: str) -> int:
        return max(s["thread_names"].get(name, 0) for s in samples)

    names = {n for s in late for n in s["thread_names"]}
    grew = [
        f"{n} {peak(early, n)} -> {peak(late, n)}"
        for n in sorted(names)
        if peak(late, n) > peak(early, n)
    ]
    return f"; by name: {', '.join(grew)}" if grew else "; no Python thread grew (native)"


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.url = (
            f"file://{workdir}/buf" if args.store == "file" else f"memory://soak-{os.getpid()}"
        )
        self.buf = tieredbuf.open(self.url)
        self.stop = threading.Event()
        self.counters: dict[str, int] = collections.defaultdict(int)
        self.errors: list[str] = []
        self.samples: list[dict[str, Any]] = []
        self.stages = [workdir / f"stage-{i}" for i in range(args.producers)]

    # --- workers --------------------------------------------------------------------

    def _guard(self, name: str, fn: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                fn()
            except BaseException:
                self.errors.append(f"{name}: {traceback.format_exc()}")
                self.stop.set()

        t = threading.Thread(target=run, name=f"soak-{name}", daemon=True)
        t.start()
        return t

    def _producer(self, i: int) -> None:
        # small segments and WAL files: their sawtooth is short against the run
        p = self.buf.producer(
            staging_dir=self.stages[i],
            target_size=1 << 20,
            rotation_target=4 << 20,
            max_open_duration=timedelta(milliseconds=200),
        )
        rec = b"r" * self.args.record_bytes
        interval = RECORDS_PER_CALL / self.args.rate
        inflight: collections.deque[Any] = collections.deque()
        next_at = time.monotonic()
        try:
            while not self.stop.is_set():
                try:
                    inflight.append(p.produce([rec] * RECORDS_PER_CALL, timeout=1.0))
                except BackpressureError:
                    self.counters["backpressure"] += 1
                    continue
                self.counters["produced"] += RECORDS_PER_CALL
                while len(inflight) > WINDOW:
                    inflight.popleft().wait(tieredbuf.Durability.LOCAL, timeout=60)
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    self.stop.wait(delay)
                else:
                    next_at = time.monotonic()  # behind: do not burst to catch up
            while inflight:
                inflight.popleft().wait(tieredbuf.Durability.LOCAL, timeout=60)
        finally:
            p.close(timeout=120)

    def _consumer(self) -> None:
        c = self.buf.consumer()
        c.initialize()
        try:
            while not self.stop.is_set():
                b = c.next_batch()
                if b is None:
                    self.stop.wait(0.05)
                    continue
                self.counters["consumed"] += len(b.entries)
                c.ack(b.sequence)
            c.flush()
        finally:
            c.close()

    def _reader(self) -> None:
        r = self.buf.reader(on_lost="clamp")
        while not self.stop.is_set():
            entries = r.poll(256)
            if not entries:
                self.stop.wait(0.05)
                continue
            for e in entries:
                try:
                    self.buf.read_object(e)
                except DataLossError:  # unlinked by retention and reaped before we got here
                    self.counters["reader_missed"] += 1
                    continue
                self.counters["read_entries"] += 1
        self.counters["reader_clamped"] = r.lost

    def _gc(self) -> None:
        while not self.stop.wait(5.0):
            report = gc.run_once(self.buf)
            self.counters["gc_deleted"] += report.deleted + report.groups_deleted
            self.counters["gc_passes"] += 1

    # --- sampling -------------------------------------------------------------------

    def _sample(self, t0: float) -> None:
        snap = self.buf.snapshot()
        self.samples.append(
            {
                "t": round(time.monotonic() - t0, 2),
                "rss_bytes": _status("VmRSS") * 1024,
                "open_fds": len(os.listdir("/proc/self/fd")),
                "threads": _status("Threads"),
                "thread_names": _thread_names(),
                "stage_disk_bytes": sum(_dir_bytes(s) for s in self.stages),
                "store_bytes": _dir_bytes(self.workdir / "buf")
                if self.args.store == "file"
                else None,
                "queued_entries": snap.root.next_seq - snap.low,
                **{
                    k: self.counters[k]
                    for k in (
                        "produced",
                        "consumed",
                        "read_entries",
                        "subscriber_read",
                        "worker_acked",
                    )
                },
            }
        )

    # --- the run --------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.buf.set_retention(max_age=timedelta(seconds=20))
        # GC reads the grace period from the root (writers too); 10 s is far below what
        # a production buffer should use, and fine here: every writer is in this process
        # and links what it uploads within milliseconds
        self.buf.set_gc_grace_period(GC_GRACE, force=True)
        threads = [
            self._guard(f"producer-{i}", lambda i=i: self._producer(i))
            for i in range(self.args.producers)
        ]
        threads += [
            self._guard("consumer", self._consumer),
            self._guard("reader", self._reader),
            self._guard("gc", self._gc),
        ]
        threads += [
            self._guard(f"subscriber-{i}", lambda fn=fn: fn(self.buf, self.stop, self.counters))
            for i, fn in enumerate(SUBSCRIBERS)
        ]
        t0 = time.monotonic()
        end = t0 + self.args.duration
        while not self.stop.is_set() and time.monotonic() < end:
            self._sample(t0)
            self.stop.wait(min(self.args.sample, max(0.0, end - time.monotonic())))
        self.stop.set()
        for t in threads:
            t.join(timeout=180)
            if t.is_alive():
                self.errors.append(f"{t.name} did not stop")
        self.buf.close()
        return self.verdict()

    def verdict(self) -> dict[str, Any]:
        warm = (
            self.args.warmup if self.args.warmup is not None else max(10.0, self.args.duration / 5)
        )
        after = [s for s in self.samples if s["t"] >= warm]
        half = len(after) // 2
        early, late = after[:half], after[half:]
        growth: dict[str, Any] = {}
        failed = list(self.errors)
        if len(early) < 3 or len(late) < 3:
            failed.append(f"too few samples after warm-up ({len(after)})")
        else:
            for metric, tol in TOLERANCE.items():
                a = max(s[metric] for s in early)
                b = max(s[metric] for s in late)
                allowed = tol[1] if tol[0] == "abs" else max(a * tol[1], tol[2])
                grew = b - a > allowed
                growth[metric] = {"early_max": a, "late_max": b, "allowed": allowed, "grew": grew}
                if grew:
                    why = _named_growth(early, late) if metric == "threads" else ""
                    failed.append(
                        f"{metric} grew after warm-up: {a} -> {b} (allowed +{allowed}){why}"
                    )
            hooks = {
                "subscriber_read": named_subscriber in SUBSCRIBERS,
                "worker_acked": shared_worker in SUBSCRIBERS,
            }
            for metric in ("consumed", "read_entries", *(m for m, on in hooks.items() if on)):
                if late[-1][metric] <= late[0][metric]:
                    failed.append(f"no progress in {metric} in the later half")
        return {
            "config": {
                **vars(self.args),
                "url": self.url.split("://")[0] + "://",
                "warmup_s": warm,
                "tolerance": TOLERANCE,
                "subscribers": len(SUBSCRIBERS),
            },
            "loadavg": os.getloadavg(),
            "counters": dict(self.counters),
            "growth": growth,
            "failed": failed,
            "samples": self.samples,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    ap.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds ignored at the start (default: duration/5, at least 10)",
    )
    ap.add_argument("--sample", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--store", choices=["file", "memory"], default="file")
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--rate", type=float, default=2000.0, help="records/s per producer")
    ap.add_argument("--record-bytes", type=int, default=512)
    ap.add_argument("--json", default="soak", help="bench/results/<name>.json")
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="tieredbuf-soak-"))
    try:
        result = Soak(args, workdir).run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = [
        [m, g["early_max"], g["late_max"], g["allowed"], "GREW" if g["grew"] else "ok"]
        for m, g in result["growth"].items()
    ]
    print(
        f"soak {args.duration:.0f} s, {args.producers} producers x {args.rate:.0f} rec/s, "
        f"store {args.store}, load average {result['loadavg'][0]:.2f}"
    )
    print_table(["metric", "early max", "late max", "allowed +", "verdict"], rows)
    print("counters:", ", ".join(f"{k}={v}" for k, v in sorted(result["counters"].items())))
    path = write_json(args.json, result)
    print(f"wrote {path}")
    for f in result["failed"]:
        print("FAIL:", f.splitlines()[0] if "Traceback" not in f else f, file=sys.stderr)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
