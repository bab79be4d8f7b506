"""Helpers for the subscriber and worker tests."""

from __future__ import annotations

from typing import Any

import tieredbuf
from tieredbuf import keys


def fill(buf: tieredbuf.Buffer, n: int, start: int = 0) -> None:
    """``n`` entries of one record each (``r<i>``), one append each."""
    with buf.producer(flush_interval=__import__("datetime").timedelta(0)) as p:
        for i in range(start, start + n):
            p.produce([b"r%d" % i], metadata=b"m").wait(timeout=30)


def drain(c: Any, limit: int | None = None, ack: bool = True) -> list[int]:
    """next_batch / ack until caught up (or ``limit`` entries); the sequences read."""
    got: list[int] = []
    while limit is None or len(got) < limit:
        b = c.next_batch()
        if b is None:
            break
        assert b.entries == [b"r%d" % b.sequence]
        got.append(b.sequence)
        if ack:
            c.ack(b.sequence)
    return got


def seed(buf: tieredbuf.Buffer, n: int, start: int = 0) -> None:
    """``n`` entries like :func:`fill`'s (``r<i>``), their objects PUT and appended in one
    CAS, without a producer (no pacing: fast for long backlogs)."""
    import time

    from ulid import ULID

    from tieredbuf.format.batch import encode_batch
    from tieredbuf.format.manifest import MetadataItem, NewEntry

    new = []
    for i in range(start, start + n):
        key, body = keys.data_key(ULID()), encode_batch([b"r%d" % i])
        buf.store.put(key, body, mode="create")
        new.append(NewEntry(key, (MetadataItem(0, time.time_ns() // 10**6, b"m"),), len(body)))
    buf.queue.append(new, f"seed-{start}", n)
