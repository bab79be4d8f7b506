"""Data objects for readers: one GET, or parallel ranged GETs for large ones, read ahead,
and every object checked against what the manifest recorded before it is handed out.

**Checked, in one place.**  Every reader -- a consumer, a named subscriber, a worker, the
Spark source, the CLI, ``Buffer.read_object`` -- gets data objects from here, and
:func:`check_object` runs on each before its bytes leave: the size the manifest tree
recorded for the entry (when it recorded one) must be the size found, the CRC32 its
writer kept beside a ``.batch`` in the store's metadata (``KeepsChecksums``, when the
store gave one back) must match its bytes, and so must a ``.qseg`` object's trailer
CRC32.  Anything else is :class:`DamagedObjectError` (a ``CorruptError``) naming the
object and what was recorded and found: a replaced, cut, extended or changed object is
never served, not even with a warning (I10).  A zstd ``.batch`` also carries zstd's
content checksum, checked when its records are decoded, before any is returned.

**Read ahead, within a budget.**  A reader at S3's round trips (20-30 ms a GET) that
fetched one object after another would read about 40 entries a second whatever the
bandwidth: :class:`ReadAhead` keeps the next entries' GETs in flight on a thread pool,
bounded by a number of entries and by bytes (the sizes the manifest tree records for each
entry).  An object is started ahead only when it fits in what the budget has left: what
read-ahead holds never passes ``max_bytes``, and an object larger than the whole budget is
fetched only when the reader asks for it.  Read-ahead is what keeps several GET streams
busy: one stream is limited by its connection (S3: about 90 MB/s).  When the byte budget
holds fewer than :data:`STREAMS` objects of an entry's size (or read-ahead is off), that
object is fetched as :data:`RANGE_PART`-byte ranges in parallel instead, as S3's
performance guide recommends.  The parts are read straight into one buffer of the
object's size (``ReadsInto``: no copy of a part is held on the way), and each part's
response says the object's size (a store that cannot tell is asked with one HEAD): a
size other than the recorded one fails the read.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tieredbuf import keys
from tieredbuf.errors import DamagedObjectError, MissingObjectError, ObjectNotFoundError
from tieredbuf.format.crc import crc32
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.format.segment import check_crc
from tieredbuf.runtime.buffers import finish, fresh_bytes
from tieredbuf.store.base import Store, Stored, copy_range, reads_into

RANGE_PART = 8 << 20
"""Bytes per ranged GET of a large object (S3's guide: 8-16 MB)."""
STREAMS = 4
"""GET streams a reader keeps busy: whole objects read ahead when the byte budget holds
this many, else ranged parts of each (objects of at least two parts)."""


def _missing(entry: ManifestEntry) -> MissingObjectError:
    return MissingObjectError(
        f"data object {entry.location} of sequence {entry.sequence} is missing from the "
        "store (deleted by hand, or by GC after a grace-period violation)",
        entry.location,
        entry.sequence,
    )


def size_mismatch(entry: ManifestEntry, recorded: int, found: int) -> DamagedObjectError:
    """The error for an object of another size than the manifest recorded."""
    how = "cut short" if found < recorded else "extended"
    return DamagedObjectError(
        entry.location,
        entry.sequence,
        min(recorded, found),
        f"the object is {found} bytes, the manifest recorded {recorded} ({how}, or replaced "
        "behind the buffer's back): not served",
        recorded,
        found,
    )


def check_object(
    entry: ManifestEntry, size: int, data: bytes | memoryview, kept: int | None = None
) -> None:
    """Raise unless ``data`` is the object the manifest recorded for ``entry``: its
    recorded ``size`` (0: none recorded, e.g. an entry an RFC 0001 writer appended); the
    CRC32 its writer ``kept`` beside it in the store's metadata, if any (a ``.batch``:
    ``KeepsChecksums``); for a ``.qseg``, the CRC32 in its trailer (CorruptError)."""
    found = len(data)
    if size and found != size:
        raise size_mismatch(entry, size, found)
    if kept is not None and (actual := crc32(data, 0)) != kept:
        raise DamagedObjectError(
            entry.location,
            entry.sequence,
            0,
            f"its CRC32 is {actual:08x}, its writer kept {kept:08x} beside it (changed "
            "behind the buffer's back): not served",
            size or found,
            found,
        )
    if entry.location.endswith(keys.SEGMENT_SUFFIX):
        check_crc(data, entry.location)


def fetch_object(store: Store, entry: ManifestEntry, size: int) -> bytes:
    """GET an entry's data object and check it (:func:`check_object`) against ``size``,
    the size the manifest recorded, and the checksum kept beside it; a missing one is
    data loss, never a silent skip."""
    try:
        got = store.get(entry.location)
    except ObjectNotFoundError as e:
        raise _missing(entry) from e
    check_object(entry, size, got.data, got.crc32)
    return got.data


def _ranges(size: int, part: int) -> list[tuple[int, int]]:
    return [(a, min(a + part, size)) for a in range(0, size, part)]


@dataclass(slots=True)
class _Pending:
    """One object being fetched: a single GET, or ranged parts read into ``out`` (through
    ``view``), each returning what its response said of the object (size, checksum;
    None: the store cannot tell, and ``head`` asks the size)."""

    store: Store
    entry: ManifestEntry
    size: int
    parts: list[Future[Any]]
    head: Future[int] | None = None
    out: bytes | bytearray | None = field(default=None, repr=False)
    view: memoryview | None = field(default=None, repr=False)

    def cancel(self) -> None:
        for f in self.parts:
            f.cancel()
        if self.head is not None:
            self.head.cancel()

    def result(self) -> bytes:
        try:
            if self.out is None:
                got: bytes = self.parts[0].result()
                return got
            said: list[Stored] = [s for f in self.parts if (s := f.result()) is not None]
            if self.head is not None:
                said.append(Stored(self.head.result()))
            if not said:  # a wrapper over a store that cannot tell: ask
                said.append(Stored(self.store.head(self.entry.location).size))
            for n in {s.size for s in said}:
                if n != self.size:
                    raise size_mismatch(self.entry, self.size, n)
            kept = {s.crc32 for s in said}
            if len(kept) > 1:  # parts of two versions of the object
                raise DamagedObjectError(
                    self.entry.location,
                    self.entry.sequence,
                    0,
                    "its ranged parts came with different checksums (replaced while read)",
                    self.size,
                    self.size,
                )
        except ObjectNotFoundError as e:
            self.cancel()
            raise _missing(self.entry) from e
        except BaseException:
            self.cancel()
            raise
        assert self.view is not None
        data = finish(self.out, self.view)
        self.out = self.view = None
        check_object(self.entry, self.size, data, kept.pop())
        return data


class ReadAhead:
    """Fetches entries' data ahead of a reader, in its order, on ``pool``.

    At most ``entries`` objects are in flight or fetched and not yet taken, and another is
    started only when, with it, they hold at most ``max_bytes`` (by recorded sizes; 0 for
    an unknown size).  So read-ahead holds at most ``max_bytes``, beside the object being
    served.  Not thread-safe: one reader thread calls it.
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
        whole = self.max_bytes // size if size else self.entries  # within the budget
        return size >= 2 * self.part and min(self.entries, whole) < self.streams

    def _start(self, entry: ManifestEntry, size: int) -> _Pending:
        if not self.ranged(size):
            get = self.pool.submit(fetch_object, self.store, entry, size)
            return _Pending(self.store, entry, size, [get])
        out, view = fresh_bytes(size)
        loc, store = entry.location, self.store
        held = (out, view)  # a running part keeps ``out`` alive while it writes into it

        def part(a: int, b: int) -> Stored | None:
            return copy_range(store, loc, a, held[1][a:b])

        parts = [self.pool.submit(part, a, b) for a, b in _ranges(size, self.part)]
        head = None
        if not reads_into(store):  # the parts will not tell the object's size
            head = self.pool.submit(lambda: store.head(loc).size)
        return _Pending(store, entry, size, parts, head, out, view)

    def want(self, upcoming: Iterable[tuple[ManifestEntry, int]]) -> None:
        """Start fetching ``upcoming`` (the reader's next entries with their sizes, in
        order) as far as the bounds allow; those already started are kept."""
        for n, (entry, size) in enumerate(upcoming):
            if n >= self.entries:
                return
            if entry.sequence in self._pending:
                continue
            if self._bytes + size > self.max_bytes:
                return
            self._pending[entry.sequence] = self._start(entry, size)
            self._bytes += size

    def take(self, entry: ManifestEntry, size: int) -> bytes:
        """``entry``'s data, checked (:func:`check_object`): fetched ahead, or now (ranged
        when large)."""
        p = self._pending.pop(entry.sequence, None)
        if p is None:
            p = self._start(entry, size)
        else:
            self._bytes -= p.size
        return p.result()

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

    def pending(self) -> list[Future[Any]]:
        """Every fetch in flight (tests wait on them)."""
        return [f for p in self._pending.values() for f in p.parts]
