"""Data objects for readers: one GET, or parallel ranged GETs for large ones, read ahead.

A reader at S3's round trips (20-30 ms a GET) that fetched one object after another
would read about 40 entries a second whatever the bandwidth: :class:`ReadAhead` keeps
the next entries' GETs in flight on a thread pool, bounded by a number of entries and
by bytes (the sizes the manifest tree records for each entry), so draining a backlog
costs one round trip per ``entries`` objects and large entries do not pile up in
memory.  Read-ahead is what keeps several GET streams busy: one stream is limited by
its connection (S3: about 90 MB/s).  When the byte budget holds fewer than
:data:`STREAMS` objects of an entry's size (or read-ahead is off), that object is
fetched as :data:`RANGE_PART`-byte ranges in parallel instead, as S3's performance
guide recommends, with one HEAD beside them: a size that does not match what the tree
recorded is read again with one plain GET (never trusted to cut the object short).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from tieredbuf.errors import MissingObjectError, ObjectNotFoundError
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.store.base import Store

log = logging.getLogger(__name__)

RANGE_PART = 8 << 20
"""Bytes per ranged GET of a large object (S3's guide: 8-16 MB)."""
STREAMS = 4
"""GET streams a reader keeps busy: whole objects read ahead when the byte budget holds
this many, else ranged parts of each (objects of at least two parts)."""


def _missing(entry: ManifestEntry, e: ObjectNotFoundError) -> MissingObjectError:
    return MissingObjectError(
        f"data object {entry.location} of sequence {entry.sequence} is missing from the "
        "store (deleted by hand, or by GC after a grace-period violation)",
        entry.location,
        entry.sequence,
    )


def fetch_object(store: Store, entry: ManifestEntry) -> bytes:
    """GET an entry's data object; a missing one is data loss, never a silent skip."""
    try:
        return store.get(entry.location).data
    except ObjectNotFoundError as e:
        raise _missing(entry, e) from e


def _ranges(size: int, part: int) -> list[tuple[int, int]]:
    return [(a, min(a + part, size)) for a in range(0, size, part)]


@dataclass(slots=True)
class _Pending:
    """One object being fetched: a single GET, or its ranged parts and a HEAD."""

    entry: ManifestEntry
    size: int
    parts: list[Future[bytes]]
    head: Future[int] | None = None

    def cancel(self) -> None:
        for f in self.parts:
            f.cancel()
        if self.head is not None:
            self.head.cancel()

    def result(self, store: Store) -> bytes:
        try:
            if self.head is None:
                return self.parts[0].result()
            actual = self.head.result()
            if actual == self.size:
                chunks = [f.result() for f in self.parts]
                if sum(len(c) for c in chunks) == actual:
                    return b"".join(chunks)
        except ObjectNotFoundError as e:
            raise _missing(self.entry, e) from e
        self.cancel()
        log.warning(
            "data object %s is %d bytes, the manifest recorded %d: read whole",
            self.entry.location,
            actual,
            self.size,
        )
        return fetch_object(store, self.entry)


class ReadAhead:
    """Fetches entries' data ahead of a reader, in its order, on ``pool``.

    At most ``entries`` objects are in flight or fetched and not yet taken, and another is
    started only while those hold less than ``max_bytes`` (by recorded sizes; 0 for an
    unknown size): at most ``max_bytes`` plus one object.  Not thread-safe: one reader
    thread calls it.
    """

    def __init__(
        self,
        store: Store,
        pool: ThreadPoolExecutor,
        entries: int,
        max_bytes: int,
        *,
        part: int = RANGE_PART,
        streams: int = STREAMS,
    ) -> None:
        self.store = store
        self.pool = pool
        self.entries = entries
        self.max_bytes = max_bytes
        self.part = part
        self.streams = streams
        self._pending: dict[int, _Pending] = {}
        self._bytes = 0

    def ranged(self, size: int) -> bool:
        """True when an object of ``size`` bytes is fetched in ranged parts: it has at least
        two, and read-ahead cannot keep ``streams`` whole objects of its size in flight."""
        whole = -(-self.max_bytes // size) if size else self.entries  # under the budget
        return size >= 2 * self.part and min(self.entries, whole) < self.streams

    def _start(self, entry: ManifestEntry, size: int) -> _Pending:
        loc = entry.location
        if not self.ranged(size):
            return _Pending(entry, size, [self.pool.submit(fetch_object, self.store, entry)])
        get_range: Callable[[str, int, int], bytes] = self.store.get_range
        parts = [self.pool.submit(get_range, loc, a, b) for a, b in _ranges(size, self.part)]
        head = self.pool.submit(lambda: self.store.head(loc).size)
        return _Pending(entry, size, parts, head)

    def want(self, upcoming: Iterable[tuple[ManifestEntry, int]]) -> None:
        """Start fetching ``upcoming`` (the reader's next entries with their sizes, in
        order) as far as the bounds allow; those already started are kept."""
        for n, (entry, size) in enumerate(upcoming):
            if n >= self.entries:
                return
            if entry.sequence in self._pending:
                continue
            if self._pending and self._bytes >= self.max_bytes:
                return
            self._pending[entry.sequence] = self._start(entry, size)
            self._bytes += size

    def take(self, entry: ManifestEntry, size: int) -> bytes:
        """``entry``'s data: fetched ahead, or now (ranged when large)."""
        p = self._pending.pop(entry.sequence, None)
        if p is None:
            p = self._start(entry, size)
        else:
            self._bytes -= p.size
        return p.result(self.store)

    def cancel(self) -> None:
        """Drop everything fetched ahead (the reader moved elsewhere)."""
        for p in self._pending.values():
            p.cancel()
        self._pending.clear()
        self._bytes = 0

    def drop(self, sequence: int) -> None:
        p = self._pending.pop(sequence, None)
        if p is not None:
            p.cancel()
            self._bytes -= p.size

    def __contains__(self, sequence: int) -> bool:
        return sequence in self._pending

    def pending(self) -> list[Future[bytes]]:
        """Every fetch in flight (tests wait on them)."""
        return [f for p in self._pending.values() for f in p.parts]
