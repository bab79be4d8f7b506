"""Subscriber and worker processes for the multi-process tests.

    python subscriber_proc.py consume URL OPTS NAME OUT DELAY_MS STOP
    python subscriber_proc.py work URL OPTS NAME DELAY_MS STOP [HOLD_AFTER]

``consume``: a named subscriber; after each flush that lands it appends the flushed
sequences to OUT (one per line), so OUT holds what this instance committed.  Exits 0
once its position reaches the total written to STOP, 3 with "FENCED" when a newer
instance fenced it.  ``work``: a worker of a shared subscriber; prints "CLAIMED s",
"PROCESSING s", "APPLIED s..." (acks and rejects its CAS applied) on stdout; rejects
every sequence with s % 17 == 5.  Exits when nothing is claimable and STOP says done;
with HOLD_AFTER, hangs at its HOLD_AFTER-th PROCESSING line (leases held) until it is
killed; the acks before it may be buffered, or applied by a refill running ahead on the
worker's CAS thread, whose APPLIED line the kill can cut off.

Lines are written whole under a lock: ``on_applied`` runs on the CAS thread, and print()
writes its arguments one by one, so two threads' lines could interleave ("APPLIEDCLAIMED
20 ...") and a parser would miss what the mangled line said.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import tieredbuf
from tieredbuf.errors import FencedError, LeaseExpiredError

_say_lock = threading.Lock()


def _say(*parts: object) -> None:
    line = " ".join(str(x) for x in parts) + "\n"
    with _say_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def _total(stop: Path) -> int | None:
    try:
        return int(stop.read_text())
    except (FileNotFoundError, ValueError):
        return None


def consume(url: str, opts: dict, name: str, out: Path, delay_ms: int, stop: Path) -> int:  # type: ignore[type-arg]
    buf = tieredbuf.open(url, **opts)
    c = buf.consumer(name, dequeue_every=1 << 30, read_ahead=2)
    pending: list[int] = []
    try:
        c.initialize()
        _say("READY", c.subscription.position)
        with out.open("a") as f:
            while True:
                b = c.next_batch()
                if b is None:
                    if pending:
                        c.flush()
                        f.write("".join(f"{s}\n" for s in pending))
                        f.flush()
                        pending = []
                    total = _total(stop)
                    if total is not None and c.subscription.position >= total:
                        c.close()
                        return 0
                    time.sleep(0.01)  # polling for new entries, not synchronisation
                    continue
                time.sleep(delay_ms / 1000)  # the subscriber's own processing speed
                pending.append(b.sequence)
                c.ack(b.sequence)
                if len(pending) >= 5:
                    c.flush()
                    f.write("".join(f"{s}\n" for s in pending))
                    f.flush()
                    pending = []
    except FencedError as e:
        _say("FENCED", e)
        return 3


def work(
    url: str, opts: dict, name: str, delay_ms: int, stop: Path, hold_after: int | None = None
) -> int:  # type: ignore[type-arg]
    buf = tieredbuf.open(url, **opts)
    w = buf.worker(name, lease=timedelta(seconds=2), claim_batch=4)
    w.on_applied = lambda seqs: _say("APPLIED", *seqs)
    processed = 0
    while True:
        try:
            b = w.claim()
        except LeaseExpiredError as e:
            _say("EXPIRED", *e.sequences)
            continue
        if b is None:
            total = _total(stop)
            # claim() applied this worker's buffered acks already
            if total is not None and w.subscription.reload().position >= total:
                w.close()
                return 0
            time.sleep(0.01)  # nothing claimable now (the rest leased to others)
            continue
        _say("CLAIMED", b.sequence)
        _say("PROCESSING", b.sequence)
        processed += 1
        if processed == hold_after:  # hangs holding its leases (see the docstring)
            threading.Event().wait()  # until the test kills it
        time.sleep(delay_ms / 1000)  # the work itself
        try:
            if b.sequence % 17 == 5:
                w.reject(b.sequence, reason=f"poison {b.sequence}".encode())
            else:
                w.ack(b.sequence)
        except LeaseExpiredError as e:
            _say("EXPIRED", *e.sequences)


def main() -> int:
    mode, url, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if mode == "consume":
        name, out, delay, stop = sys.argv[4], Path(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
        return consume(url, opts, name, out, delay, Path(stop))
    name, delay, stop = sys.argv[4], int(sys.argv[5]), sys.argv[6]
    hold_after = int(sys.argv[7]) if len(sys.argv) > 7 else None
    return work(url, opts, name, delay, Path(stop), hold_after)


if __name__ == "__main__":
    sys.exit(main())
