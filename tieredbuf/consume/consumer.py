"""The fenced consumer (RFC 0001) with read-ahead, for any subscriber.

``buf.consumer()`` is subscriber "default": RFC 0001's consumer, resident in the
root.  ``initialize()`` bumps the manifest epoch, fencing every older default
consumer (I4); next_batch, ack and flush first check the epoch, with a 22-byte
ranged GET of the footer when no fresher read is at hand, so a fenced consumer
fails with FencedError and nothing it does lands.

``buf.consumer(subscriber="etl")`` is a named subscriber (see
:mod:`tieredbuf.queue.subscription`): its epoch and position live in its own progress
object, so it fences only older instances of "etl".  next_batch checks that epoch
(one small GET; idling at the tail, at most once per ``publish_interval``); an ack
costs no request; every ``dequeue_every`` acks and on flush()
one CAS of the progress object (fenced by its epoch) writes the position, and the
position is published into the root lazily.

Every subscriber reads from its own position with the tree's lookups (a window of
entries at a time, never the whole backlog).  A position that retention already
unlinked raises DataLossError naming the lost range, or with ``on_lost="skip"``
is skipped and counted.  Data objects are fetched ``read_ahead`` entries ahead on
a thread pool, so draining a backlog is not one blocking GET round trip per batch.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import DEFAULT_IDLE_POLL_MAX, ConsumerConfig
from tieredbuf.errors import (
    AckOrderError,
    ClosedError,
    DataLossError,
    FencedError,
    MissingObjectError,
    NotInitializedError,
    ObjectNotFoundError,
)
from tieredbuf.format import registry as freg
from tieredbuf.format.batch import decode_batch
from tieredbuf.format.manifest import Footer, ManifestEntry, MetadataItem
from tieredbuf.queue.longpoll import IDLE_BACKOFF_S, FooterPoll
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot
from tieredbuf.queue.subscription import Subscription, open_subscription
from tieredbuf.runtime.forks import ForkGuard
from tieredbuf.runtime.pools import started_pool
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import Store

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

IDLE_POLL_MAX_S = DEFAULT_IDLE_POLL_MAX.total_seconds()
"""The default longest pause between footer reads of an idle ``next_batch(timeout=...)``
(``ConsumerConfig.idle_poll_max``): 0.4 requests/s, so any 10 s holds at most 5 (the
goal: <= 0.5/s)."""

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
        raise MissingObjectError(
            f"data object {entry.location} of sequence {entry.sequence} is missing from the "
            "store (deleted by hand, or by GC after a grace-period violation)",
            entry.location, entry.sequence,
        ) from e


class Consumer:
    """A fenced consumer of one subscriber; use from one thread."""

    def __init__(
        self, store: Store, queue: ManifestQueue, config: ConsumerConfig | None = None,
        subscriber: str = freg.DEFAULT,
    ) -> None:
        self.store = store
        self.queue = queue
        self.config = config or ConsumerConfig()
        self.consumer_id = f"c-{ULID()}"
        self.subscription: Subscription = open_subscription(
            queue, subscriber, owner=self.consumer_id,
            publish_interval_ms=self.config.publish_interval // timedelta(milliseconds=1))
        self.subscriber = subscriber
        self.stats = Stats()
        self.epoch: int | None = None
        self._cursor = 0
        self._acked = -1
        self._acks_since_dequeue = 0
        self._entries: dict[int, ManifestEntry] = {}
        self._low = 0
        self._tail = 0
        self._checked_ms = 0
        idle_max = self.config.idle_poll_max.total_seconds()
        self._poll = FooterPoll(
            queue.read_footer, first_s=min(IDLE_BACKOFF_S, idle_max), max_s=idle_max
        )
        self._footer: Footer | None = None  # a footer the long poll just read
        self._gaps: dict[int, int] = {}
        self._prefetch: dict[int, Future[bytes]] = {}
        self._pool = started_pool(max(1, self.config.read_ahead), "tb-readahead")
        self._guard = ForkGuard("consumer")  # its read-ahead threads do not survive fork()
        self._closed = False

    # --- lifecycle -------------------------------------------------------------

    def initialize(self, last_acked_sequence: int | None = None, start: str = "earliest") -> None:
        """Register the subscriber if new, bump its epoch (fencing older instances of this
        subscriber only) and position the cursor.

        ``None`` resumes where the subscriber is (a new subscriber starts at the earliest
        entry the buffer still holds, or at the tail with ``start="latest"``); ``seq``
        resumes after ``seq``.  No buffer at the URL raises BufferNotFoundError.
        """
        self._check_not_closed()
        if last_acked_sequence is not None and last_acked_sequence < 0:
            raise ValueError(f"last_acked_sequence must be >= 0, got {last_acked_sequence}")
        self._cancel_prefetch()
        self._entries = {}
        self._poll.reset()
        self._footer = None
        self._cursor = self.subscription.initialize(last_acked_sequence, start)
        self.epoch = self.subscription.epoch
        self._acked = self._cursor - 1
        self._acks_since_dequeue = 0
        self._gaps = {}
        self._refresh()

    def close(self) -> None:
        """Stop; a named subscriber also writes its acks and publishes its position (a
        fenced or removed instance has nothing to write: that is logged, not raised)."""
        if not self._closed and self.epoch is not None and not self.subscription.is_default:
            try:
                self.subscription.close()
            except FencedError as e:
                log.info("close of a fenced consumer wrote nothing: %s", e)
        self._closed = True
        self._poll.wake()
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

    def _check(self, snap: Snapshot | None = None) -> None:
        """Raise FencedError if a newer instance of this subscriber took over."""
        sub = self.subscription
        if not sub.is_default:
            sub.check()
            if snap is not None:
                sub.observe(snap)
        elif snap is None:
            self.queue.check_epoch(self._epoch())
        elif snap.footer.epoch != self.epoch:
            raise FencedError(self._epoch(), snap.footer.epoch)

    def _refresh(self) -> None:
        """Re-read the root (also checks the epoch) and the entries from the cursor on.

        Only a window is decoded (the group holding the cursor and what follows, up to
        ``WINDOW`` entries), so a long backlog costs one group GET per window.
        """
        snap = self.queue.read()
        self._footer = None  # older than this read
        self._check(snap)
        start = max(self._cursor, snap.low)
        window = max(WINDOW, self.config.read_ahead + 1)
        self._entries = {e.sequence: e for e in itertools.islice(snap.iter_from(start), window)}
        self._low = snap.low
        self._tail = snap.root.next_seq
        self.stats.incr("manifest_refreshes")

    def _nothing_new(self) -> bool:
        """At the tail: one 22-byte footer GET says whether anything was appended since the
        last root read (the default consumer's epoch check comes with it).  A named
        subscriber idling at the tail checks its own epoch at most once per
        ``publish_interval`` (an idle fenced instance has nothing to land)."""
        if self._cursor < self._tail:
            return False
        footer, self._footer = self._footer, None
        if footer is None:
            footer = self.queue.read_footer()
        if self.subscription.is_default and footer.epoch != self.epoch:
            raise FencedError(self._epoch(), footer.epoch)
        if footer.next_sequence > self._tail:
            return False
        if not self.subscription.is_default:
            now = self.subscription.clock_ms()
            if now - self._checked_ms >= self.subscription.publish_interval_ms:
                self._checked_ms = now
                self._check()
        self.stats.incr("idle_polls")
        return True

    def _lost(self) -> None:
        """The cursor is before the first retained sequence: retention (or a dequeue by
        hand) unlinked what this subscriber had not read.  Raise, or skip and count."""
        first, last = self._cursor, self._low - 1
        if self.config.on_lost != "skip":
            raise DataLossError(
                f"subscriber {self.subscriber!r}: sequences {first}..{last} were unlinked "
                f"before it read them (retention, or dequeued); the buffer now starts at "
                f"{self._low}.  initialize(last_acked_sequence={last}) or on_lost='skip' "
                "moves on")
        n = self._low - self._cursor
        log.warning("subscriber %r skips sequences %d..%d: unlinked before it read them",
                    self.subscriber, first, last)
        self.stats.incr("lost_sequences", n)
        self.subscription.lost += n
        self._cursor = self._low
        self._gaps[first] = last  # acks step over the skipped range
        self._ack_gaps()

    def next_batch(self, timeout: float | None = None) -> ConsumedBatch | None:
        """The entry after the last one returned, with its data; None if none is queued.

        ``timeout`` (seconds): at the tail, wait up to this long for an entry (a long
        poll, :mod:`tieredbuf.queue.longpoll`): the root's 22-byte footer is read
        0.1 s after the consumer went idle, then with a backoff doubling to
        ``idle_poll_max`` (2.5 s), so an idle consumer calling
        ``next_batch(timeout=...)`` in a loop sends at most one small GET per
        ``idle_poll_max`` (the backoff carries over from call to call) and sees a new
        entry within it.  The default consumer learns of a newer epoch from the
        same footer (FencedError); a named subscriber checks its epoch when an entry
        arrives (its acks land only through its fenced progress CAS).  Without a
        timeout, one check (at the tail: one footer GET) and no wait.
        """
        if timeout is None or timeout <= 0:
            return self._next_batch()
        deadline = time.monotonic() + timeout
        while True:
            if not self._poll.idle or self._cursor < self._tail:
                batch = self._next_batch()
                if batch is not None or self._cursor < self._tail:
                    self._poll.reset()
                    return batch
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            epoch = self.epoch if self.subscription.is_default else None
            footer = self._poll.wait(self._tail, remaining, epoch=epoch)
            if footer is None:
                self._check_not_closed()
                return None
            self._footer = footer  # something moved: the next check needs no second GET

    def _next_batch(self) -> ConsumedBatch | None:
        self._epoch()
        if self._cursor in self._entries:
            self._check()
        elif self._nothing_new():
            return None
        else:
            self._refresh()
        while True:
            if self._cursor < self._low:
                self._lost()
                if self._cursor not in self._entries:
                    self._refresh()
            seq = self._cursor
            entry = self._entries.get(seq)
            if entry is None:
                return None
            fut = self._prefetch.pop(seq, None)
            try:
                data = fut.result() if fut is not None else fetch_object(self.store, entry)
                break
            except MissingObjectError:
                # the window may predate a retention pass whose unlinked objects GC has
                # since reaped: that is retention's loss (told, or skipped), judged from a
                # fresh root; an object the root still links is missing for another reason
                self._cancel_prefetch()
                self._refresh()
                if self._cursor >= self._low:
                    raise
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
        if self.subscription.is_default:
            self.queue.check_epoch(epoch)  # RFC 0001: every queue operation checks the epoch
        self._acked = sequence
        self._ack_gaps()
        self.subscription.ack_through(self._acked)
        self._acks_since_dequeue += 1
        self.stats.incr("acks")
        if self._acks_since_dequeue >= self.config.dequeue_every:
            self._dequeue(publish=False)

    def _ack_gaps(self) -> None:
        while self._acked + 1 in self._gaps:
            self._acked = self._gaps.pop(self._acked + 1)
            self.subscription.ack_through(self._acked)

    def flush(self) -> None:
        """Write every ack now: the default consumer dequeues; a named subscriber writes its
        progress object and publishes its position into the root.  Also verifies this
        instance is not fenced."""
        self._epoch()
        if not self.subscription.is_default and self.subscription.written == self._acked + 1:
            self._check()
        self._dequeue(publish=True)

    def _dequeue(self, publish: bool) -> None:
        self.subscription.flush(publish=publish)
        self._acks_since_dequeue = 0
        self.stats.incr("dequeues")
