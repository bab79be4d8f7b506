"""The fenced consumer (RFC 0001) with read-ahead.

``initialize()`` bumps the manifest epoch, fencing every older consumer (I4).
Every queue operation (next_batch, ack, flush) first checks the epoch, with a
22-byte ranged GET of the footer when no fresher read is at hand, so a fenced
consumer fails with FencedError and nothing it does lands.  Data objects are
fetched ``read_ahead`` entries ahead on a thread pool, so draining a backlog is
not one blocking GET round trip per batch.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import ConsumerConfig
from tieredbuf.errors import (
    AckOrderError,
    ClosedError,
    DataLossError,
    FencedError,
    NotInitializedError,
    ObjectNotFoundError,
)
from tieredbuf.forks import ForkGuard
from tieredbuf.format.batch import decode_batch
from tieredbuf.format.manifest import ManifestEntry, MetadataItem
from tieredbuf.queue.backoff import Stats
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.store.base import Store

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

WINDOW = 1024
"""Entries decoded per refresh of the manifest."""


@dataclass(frozen=True, slots=True)
class ConsumedBatch:
    """One queue entry and its data (RFC 0001's ConsumedBatch)."""

    sequence: int
    location: str
    metadata: tuple[MetadataItem, ...]
    data: bytes = field(repr=False)

    @property
    def entries(self) -> list[bytes]:
        """The records of a ``.batch`` object."""
        if not self.location.endswith(keys.BATCH_SUFFIX):
            raise TypeError(f"{self.location} holds Arrow bundles: use bundles()")
        return decode_batch(self.data, obj=self.location)

    def bundles(self, slots: list[int] | None = None) -> list[dict[int, pa.RecordBatch]]:
        """The Arrow bundles of a ``.qseg`` object (only ``slots`` if given)."""
        from tieredbuf.format.segment import decode_segment

        if not self.location.endswith(keys.SEGMENT_SUFFIX):
            raise TypeError(f"{self.location} holds records: use entries")
        return [dict(b.slots) for b in decode_segment(self.data, obj=self.location, slots=slots)]


def fetch_object(store: Store, entry: ManifestEntry) -> bytes:
    """GET an entry's data object; a missing one is data loss, never a silent skip."""
    try:
        return store.get(entry.location).data
    except ObjectNotFoundError as e:
        raise DataLossError(
            f"data object {entry.location} of sequence {entry.sequence} is missing from the "
            "store (deleted by hand, or by GC after a grace-period violation)"
        ) from e


class Consumer:
    """A single fenced consumer; use from one thread."""

    def __init__(
        self, store: Store, queue: ManifestQueue, config: ConsumerConfig | None = None
    ) -> None:
        self.store = store
        self.queue = queue
        self.config = config or ConsumerConfig()
        self.consumer_id = f"c-{ULID()}"
        self.stats = Stats()
        self.epoch: int | None = None
        self._cursor = 0
        self._acked = -1
        self._acks_since_dequeue = 0
        self._entries: dict[int, ManifestEntry] = {}
        self._first = 0
        self._prefetch: dict[int, Future[bytes]] = {}
        self._pool = ThreadPoolExecutor(
            max(1, self.config.read_ahead), thread_name_prefix="tb-readahead"
        )
        self._guard = ForkGuard("consumer")  # its read-ahead threads do not survive fork()
        self._closed = False

    # --- lifecycle -------------------------------------------------------------

    def initialize(self, last_acked_sequence: int | None = None) -> None:
        """Bump the epoch (fencing older consumers) and position the cursor.

        ``None`` starts at the earliest entry in the queue; ``seq`` resumes after ``seq``.
        """
        self._check_not_closed()
        self.epoch = self.queue.initialize(f"{self.consumer_id}/{ULID()}")
        self._refresh()
        if last_acked_sequence is None:
            self._cursor = self._first
        else:
            if last_acked_sequence < 0:
                raise ValueError(f"last_acked_sequence must be >= 0, got {last_acked_sequence}")
            self._cursor = last_acked_sequence + 1
        self._acked = self._cursor - 1
        self._acks_since_dequeue = 0
        self._cancel_prefetch()

    def close(self) -> None:
        self._closed = True
        self._cancel_prefetch()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reading ---------------------------------------------------------------

    def _epoch(self) -> int:
        self._check_not_closed()
        if self.epoch is None:
            raise NotInitializedError("call initialize() before using the consumer")
        return self.epoch

    def _check_not_closed(self) -> None:
        self._guard.check()
        if self._closed:
            raise ClosedError("consumer is closed")

    def _refresh(self) -> None:
        """Re-read the root (also checks the epoch) and the entries from the cursor on.

        Only a window is decoded (the group holding the cursor and what follows, up to
        ``WINDOW`` entries), so a long backlog costs one group GET per window.
        """
        snap = self.queue.read()
        if self.epoch is not None and snap.footer.epoch != self.epoch:
            raise FencedError(self.epoch, snap.footer.epoch)
        start = max(self._cursor, snap.head)
        window = max(WINDOW, self.config.read_ahead + 1)
        self._entries = {e.sequence: e for e in itertools.islice(snap.iter_from(start), window)}
        self._first = snap.footer.first_sequence
        self.stats.incr("manifest_refreshes")

    def next_batch(self) -> ConsumedBatch | None:
        """The entry after the last one returned, with its data; None if none is queued."""
        epoch = self._epoch()
        if self._cursor in self._entries:
            self.queue.check_epoch(epoch)
        else:
            self._refresh()
        seq = self._cursor
        if seq < self._first:
            raise DataLossError(
                f"sequence {seq} was already dequeued (the queue starts at {self._first})"
            )
        entry = self._entries.get(seq)
        if entry is None:
            return None
        fut = self._prefetch.pop(seq, None)
        data = fut.result() if fut is not None else fetch_object(self.store, entry)
        self._cursor = seq + 1
        self._entries.pop(seq, None)
        self._schedule_prefetch()
        self.stats.incr("batches_read")
        return ConsumedBatch(entry.sequence, entry.location, entry.metadata, data)

    def _schedule_prefetch(self) -> None:
        for s in range(self._cursor, self._cursor + self.config.read_ahead):
            e = self._entries.get(s)
            if e is None:
                break
            if s not in self._prefetch:
                self._prefetch[s] = self._pool.submit(fetch_object, self.store, e)

    def _cancel_prefetch(self) -> None:
        for f in self._prefetch.values():
            f.cancel()
        self._prefetch.clear()

    # --- acknowledging ---------------------------------------------------------

    @property
    def last_acked_sequence(self) -> int | None:
        return self._acked if self._acked >= 0 else None

    def ack(self, sequence: int) -> None:
        """Confirm ``sequence`` is processed; acks must be in order, one after another."""
        epoch = self._epoch()
        expected = self._acked + 1
        if sequence != expected:
            raise AckOrderError(f"ack({sequence}) out of order: the next ack must be {expected}")
        if sequence >= self._cursor:
            raise AckOrderError(
                f"ack({sequence}) for a batch not yet read (next read {self._cursor})"
            )
        self.queue.check_epoch(epoch)
        self._acked = sequence
        self._acks_since_dequeue += 1
        self.stats.incr("acks")
        if self._acks_since_dequeue >= self.config.dequeue_every:
            self._dequeue(epoch)

    def flush(self) -> None:
        """Dequeue every acked entry now (also verifies this consumer is not fenced)."""
        self._dequeue(self._epoch())

    def _dequeue(self, epoch: int) -> None:
        self.queue.dequeue(self._acked, epoch)
        self._acks_since_dequeue = 0
        self.stats.incr("dequeues")
