"""A producer process for the ack-evidence torture test (tests/test_ack_torture.py).

``python ack_torture_worker.py URL NAME MODE STAGE SKEW_MS SEED BROWNOUT_P BROWNOUT_S
DAMAGE_P`` produces records ``NAME:i`` one call at a time, a few milliseconds apart, as
a stateless (``direct``) or staged (``staged``, STAGE its staging directory) producer,
and prints, each as one whole line:

* ``LOCAL NAME:i`` when a staged write is LOCAL (fdatasynced);
* ``REMOTE NAME:i SEQ LOCATION`` when a write is REMOTE, with the outcome it was given;
* ``FAIL NAME:i ERROR`` when a write failed (never acknowledged);
* ``BROWNOUT KEY`` when one of its data uploads is held ``BROWNOUT_S`` seconds before it
  lands (a throttled upload retried under the same ULID), ``DAMAGED KEY`` when one of
  its announcements lands damaged (a byte of its body flipped, its key form dropped).

Its clock runs ``SKEW_MS`` off (``time.time`` and ``time.time_ns`` are shifted for the
whole process: ULIDs, leases, announcements).  SIGTERM: stop producing, close (export
everything, wait), print ``CLOSED`` and exit 0.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any


def _skew(ms: int) -> None:
    if not ms:
        return
    real_time, real_ns = time.time, time.time_ns
    time.time = lambda: real_time() + ms / 1000  # type: ignore[assignment]
    time.time_ns = lambda: real_ns() + ms * 1_000_000  # type: ignore[assignment]


_out = threading.Lock()


def say(line: str) -> None:
    """One whole line on stdout (a SIGKILL never leaves half of one)."""
    with _out:
        os.write(1, (line + "\n").encode())


class TortureStore:
    """Forwards to a store; holds some data uploads back (brownouts) and damages some
    announcements, at the given odds."""

    def __init__(
        self, inner: Any, rng: random.Random, brownout: tuple[float, float], damage: float
    ) -> None:
        self._inner = inner
        self._rng = rng
        self._lock = threading.Lock()
        self.brownout_p, self.brownout_s = brownout
        self.damage_p = damage

    def _roll(self, p: float) -> bool:
        with self._lock:
            return self._rng.random() < p

    def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> str:
        from tieredbuf import keys

        if key.startswith(keys.DATA_PREFIX) and self._roll(self.brownout_p):
            say(f"BROWNOUT {key}")
            threading.Event().wait(self.brownout_s)  # the throttled upload, not sync
        elif key.startswith(keys.PENDING_PREFIX) and self._roll(self.damage_p):
            parsed = keys.parse_pending_key(key)
            if parsed is not None:
                key = keys.pending_key(*parsed, "")
                raw = bytearray(data)
                raw[len(raw) // 2] ^= 0xFF
                data = bytes(raw)
                say(f"DAMAGED {key}")
        etag: str = self._inner.put(key, data, mode=mode)
        return etag

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def main() -> None:
    url, name, mode, stage = sys.argv[1:5]
    skew_ms, seed = int(sys.argv[5]), int(sys.argv[6])
    brownout = (float(sys.argv[7]), float(sys.argv[8]))
    damage = float(sys.argv[9])
    _skew(skew_ms)

    import tieredbuf
    from tieredbuf.store import open_store

    store = TortureStore(open_store(url), random.Random(seed), brownout, damage)
    buf = tieredbuf.Buffer(store)  # type: ignore[arg-type]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if mode == "staged":
        p: Any = buf.producer(stage, max_open_duration=timedelta(milliseconds=200))
    else:
        p = buf.producer(flush_interval=timedelta(milliseconds=20))
    say(f"STARTED {name} {p.producer_id}")
    inflight = threading.BoundedSemaphore(200)

    def follow(rec: str, h: Any) -> None:
        def local() -> None:
            if (h.watcher.level or 0) >= tieredbuf.Durability.LOCAL:
                say(f"LOCAL {rec}")

        def remote() -> None:
            inflight.release()
            try:
                out = h.result()
            except Exception as e:
                say(f"FAIL {rec} {type(e).__name__}")
                return
            if out is None:
                say(f"FAIL {rec} NotRemote")
            else:
                say(f"REMOTE {rec} {out.sequence} {out.location}")

        if mode == "staged":
            h.watcher.when(tieredbuf.Durability.LOCAL, local)
        h.watcher.when(tieredbuf.Durability.REMOTE, remote)

    i = 0
    while not stop.is_set():
        if not inflight.acquire(timeout=0.5):
            continue
        rec = f"{name}:{i}"
        i += 1
        try:
            h = p.produce([rec.encode()], timeout=30)
        except Exception as e:
            inflight.release()
            say(f"FAIL {rec} {type(e).__name__}")
            continue
        follow(rec, h)
        stop.wait(0.01)
    try:
        p.close(timeout=120)
        say("CLOSED")
    except Exception as e:
        say(f"CLOSEFAIL {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
