"""A worker process of the work-queue torture test (tests/work_torture.py).

    python work_torture_proc.py URL OPTS_JSON LOG MAX_DELIVERIES SEED GET_FAULTS DONE [THREADS]

Claims entries of the shared queue "jobs", works on each for a few milliseconds and
acks it: THREADS (1) workers of one buffer, each on a thread of its own (so they write
the progress object through one refill hub).  Its data GETs fail with probability
GET_FAULTS (a TransientStoreError: an error that outlived the store's retries).  Each
worker appends one line per event to its log (LOG for the first, ``LOG.<i>`` for the
others), each with one ``os.write`` on an O_APPEND descriptor (a kill cannot tear a
line):

    R seq          claim() returned seq (written right after it returned)
    M seq          a mark (the durable charge) is about to be written for seq
    A seq ...      a CAS applied these acks (on_applied)
    V seq left_ms  seq was handed out with less than the lease's margin left
    G location     an injected data GET fault
    E seq ...      LeaseExpiredError (a late ack refused)
    X error        another error from claim() or ack()

It exits 0 once the file DONE exists and the queue's position reached the count it
holds (every thread).  It runs on any tieredbuf version (the torture test checks the
code before a fix with it): a claim without ``timeout`` or a worker without ``on_mark``
is tolerated.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import tieredbuf
from tieredbuf import keys
from tieredbuf.errors import LeaseExpiredError, TieredBufError, TransientStoreError
from tieredbuf.store import open_store

LEASE = timedelta(seconds=2)
MARGIN_MS = min(LEASE // timedelta(milliseconds=1) // 4, 5000)
"""The worker's margin: an entry with less left is never handed out (docs/subscribers.md)."""
WORK_S = (0.005, 0.03)


class GetFaults:
    """A store whose data GETs fail now and then (seeded)."""

    def __init__(self, inner: Any, p: float, rng: random.Random, log: Any) -> None:
        self._inner, self._p, self._rng, self._log = inner, p, rng, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get(self, key: str) -> Any:
        if key.startswith(keys.DATA_PREFIX) and self._rng.random() < self._p:
            self._log(f"G {key}")
            raise TransientStoreError(f"injected GET fault on {key}")
        return self._inner.get(key)


def log_paths(log: str, threads: int) -> list[str]:
    """The logs of a process's workers (the first one's is LOG)."""
    return [log] + [f"{log}.{i}" for i in range(1, threads)]


def main() -> int:
    url, opts = sys.argv[1], json.loads(sys.argv[2])
    log_path, md, seed = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    get_faults, done = float(sys.argv[6]), Path(sys.argv[7])
    threads = int(sys.argv[8]) if len(sys.argv) > 8 else 1
    fds = [
        os.open(x, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for x in log_paths(log_path, threads)
    ]

    def store_log(line: str) -> None:  # data GETs run on read-ahead threads: the first log
        os.write(fds[0], (line + "\n").encode())

    store = GetFaults(open_store(url, **opts), get_faults, random.Random(seed + 1), store_log)
    buf = tieredbuf.Buffer(store)  # type: ignore[arg-type]
    codes: list[int] = []

    def run(i: int) -> None:
        codes.append(work(buf, fds[i], md, seed + 2 * i, done))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return 0 if codes == [0] * threads else 1


def work(buf: Any, fd: int, md: int, seed: int, done: Path) -> int:
    """One worker's loop (on its own thread), logging to ``fd``."""

    def log(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    rng = random.Random(seed)
    w = buf.worker("jobs", lease=LEASE, claim_batch=4, max_deliveries=md or None, read_ahead=4)
    w.on_applied = lambda seqs: log("A " + " ".join(map(str, seqs))) if seqs else None
    if hasattr(w, "on_mark"):
        w.on_mark = lambda seq: log(f"M {seq}")
    long_poll = "timeout" in inspect.signature(w.claim).parameters
    while True:
        try:
            b = w.claim(timeout=0.5) if long_poll else w.claim()
        except LeaseExpiredError as e:
            log("E " + " ".join(map(str, e.sequences)))
            continue
        except TransientStoreError:
            continue  # the injected GET fault (logged); the next claim() goes on
        except TieredBufError as e:
            log(f"X {type(e).__name__}: {e}".replace("\n", " "))
            time.sleep(0.05)  # a store error that outlived its retries: try again
            continue
        if b is None:
            if done.exists():
                total = int(done.read_text())
                if w.subscription.reload().position >= total:
                    w.close()
                    return 0
            if not long_poll:
                time.sleep(0.05)  # the old claim() does not wait
            continue
        log(f"R {b.sequence}")
        expires = (
            w.expires_ms(b.sequence)
            if hasattr(w, "expires_ms")
            else w._held[b.sequence].expires_ms  # the code before the fix
        )
        left = expires - w.clock_ms()
        if left < MARGIN_MS:
            log(f"V {b.sequence} {left}")
        time.sleep(rng.uniform(*WORK_S))
        try:
            w.ack(b.sequence)
        except LeaseExpiredError as e:
            log("E " + " ".join(map(str, e.sequences)))
        except TieredBufError as e:
            log(f"X {type(e).__name__}: {e}".replace("\n", " "))


if __name__ == "__main__":
    sys.exit(main())
