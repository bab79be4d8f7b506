"""Helpers for the subscriber and worker tests."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import tieredbuf
from tieredbuf import keys
from tieredbuf.store.base import GetResult, ObjectMeta, PutMode, Store


def kind(key: str) -> str:
    """root / progress / group / data / other: what a request touched."""
    if key == keys.MANIFEST_KEY:
        return "root"
    if key.startswith(keys.SUBSCRIBERS_PREFIX):
        return "progress"
    if key.startswith(keys.GROUPS_PREFIX):
        return "group"
    if key.startswith(keys.DATA_PREFIX):
        return "data"
    return "other"


class KeyCountingStore:
    """Counts requests per (operation, kind of key): exact request costs by object."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()

    @property
    def url(self) -> str:
        return self.inner.url

    def _c(self, op: str, key: str) -> None:
        with self._lock:
            self.counts[(op, kind(key))] += 1

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()

    def of(self, k: str) -> dict[str, int]:
        """Requests on one kind of key, by operation."""
        with self._lock:
            return {op: n for (op, kk), n in self.counts.items() if kk == k and n}

    def get(self, key: str) -> GetResult:
        self._c("get", key)
        return self.inner.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self._c("get_range", key)
        return self.inner.get_range(key, start, end)

    def get_suffix(self, key: str, length: int) -> bytes:
        self._c("get_suffix", key)
        return self.inner.get_suffix(key, length)

    def head(self, key: str) -> ObjectMeta:
        self._c("head", key)
        return self.inner.head(key)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        self._c("put", key)
        return self.inner.put(key, data, mode=mode)

    def put_multipart(self, key: str, chunks: Iterable[bytes | memoryview], *,
                      mode: PutMode = "create") -> str:
        self._c("put_multipart", key)
        return self.inner.put_multipart(key, chunks, mode=mode)

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        self._c("list", prefix)
        return self.inner.list(prefix)

    def delete_many(self, keys_: Sequence[str]) -> list[tuple[str, Exception]]:
        for k in keys_:
            self._c("delete", k)
        return self.inner.delete_many(keys_)

    def close(self) -> None:
        self.inner.close()


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
