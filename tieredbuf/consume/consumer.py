"""The fenced consumer (RFC 0001) with read-ahead, for any subscriber.

``buf.consumer()`` is subscriber "default": RFC 0001's consumer, resident in the
root.  ``initialize()`` bumps the manifest epoch, fencing every older default
consumer (I4).  ``buf.consumer(subscriber="etl")`` is a named subscriber (see
:mod:`tieredbuf.queue.subscription`): its epoch and position live in its own progress
object, so it fences only older instances of "etl".

**Checks are amortised** (Kafka's consumer fetches many records per round trip; this
one serves many entries per check).  Whether this instance is still its subscriber's
current one is checked -- from the root for "default" (a root read, or its 22-byte
footer), from the progress object for a named subscriber (one small GET) -- when the
consumer reaches the end of the entries it knows (it reads the root then anyway), at
least every ``check_every`` entries and every ``check_interval`` while it serves
entries it already knows, and with every write: a default consumer's dequeue is a
root CAS at its own epoch, a named subscriber's flush a CAS of its progress object
fenced by the epoch there.  So nothing a fenced consumer writes lands (its acks,
flushes and dequeues fail with FencedError), and its reads stop within
``check_every`` entries or ``check_interval``, or at its next write (I4).  Once it
knows it is fenced, every call raises FencedError without a request.  An ack costs
no request: acks are written every ``dequeue_every`` acks and on flush() (a named
subscriber also on close(), and its position is published into the root lazily).

Every subscriber reads from its own position with the tree's lookups (a window of
entries at a time, never the whole backlog).  A position that retention already
unlinked raises DataLossError naming the lost range, or with ``on_lost="skip"``
is skipped and counted.  Data objects are fetched ahead (:mod:`tieredbuf.consume.fetch`:
``read_ahead`` objects and ``read_ahead_bytes`` at most, large ones in parallel ranged
GETs), so draining a backlog is not one blocking GET round trip per entry.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import DEFAULT_IDLE_POLL_MAX, ConsumerConfig
from tieredbuf.consume.fetch import ReadAhead
from tieredbuf.errors import (
    AckOrderError,
    ClosedError,
    DataLossError,
    FencedError,
    MissingObjectError,
    NotInitializedError,
)
from tieredbuf.format import idem
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

__all__ = ["ConsumedBatch", "Consumer"]

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

IDLE_POLL_MAX_S = DEFAULT_IDLE_POLL_MAX.total_seconds()
"""The default longest pause between footer reads of an idle ``next_batch(timeout=...)``
(``ConsumerConfig.idle_poll_max``): once the backoff reaches it, 0.4 requests/s (the
goal: <= 0.5/s); see :meth:`Consumer.next_batch` for the first seconds."""

WINDOW = 1024
"""Entries decoded per refresh of the manifest."""


@dataclass(frozen=True, slots=True)
class ConsumedBatch:
    """One queue entry and its data (RFC 0001's ConsumedBatch).  ``metadata`` holds each
    produce() call's payload as the call gave it: a call made with an idempotency key
    carries the key's tag in front of it in the manifest (:mod:`tieredbuf.format.idem`),
    taken off here."""

    sequence: int
    location: str
    metadata: tuple[MetadataItem, ...]
    data: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if any(m.payload.startswith(idem.MAGIC) for m in self.metadata):
            own = tuple(
                MetadataItem(m.start_index, m.ingestion_time_ms, idem.own(m.payload))
                for m in self.metadata
            )
            object.__setattr__(self, "metadata", own)

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


class Consumer:
    """A fenced consumer of one subscriber; use from one thread."""

    def __init__(
        self,
        store: Store,
        queue: ManifestQueue,
        config: ConsumerConfig | None = None,
        subscriber: str = freg.DEFAULT,
    ) -> None:
        self.store = store
        self.queue = queue
        self.config = config or ConsumerConfig()
        self.consumer_id = f"c-{ULID()}"
        self.subscription: Subscription = open_subscription(
            queue,
            subscriber,
            owner=self.consumer_id,
            publish_interval_ms=self.config.publish_interval // timedelta(milliseconds=1),
        )
        self.subscriber = subscriber
        self.stats = Stats()
        self.epoch: int | None = None
        self._cursor = 0
        self._acked = -1
        self._acks_since_dequeue = 0
        self._entries: dict[int, tuple[ManifestEntry, int]] = {}
        self._low = 0
        self._tail = 0
        self._served = 0  # entries served since the last check
        self._checked_ms = 0  # when a check (or a write) last showed this instance current
        self._check_ms = self.config.check_interval // timedelta(milliseconds=1)
        self._fenced: FencedError | None = None
        idle_max = self.config.idle_poll_max.total_seconds()
        self._poll = FooterPoll(
            queue.read_footer, first_s=min(IDLE_BACKOFF_S, idle_max), max_s=idle_max
        )
        self._footer: Footer | None = None  # a footer the long poll just read
        self._gaps: dict[int, int] = {}
        self._pool = started_pool(max(4, self.config.read_ahead), "tb-readahead")
        self._ahead = ReadAhead(
            store, self._pool, self.config.read_ahead, self.config.read_ahead_bytes
        )
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
        self._ahead.cancel()
        self._entries = {}
        self._poll.reset()
        self._footer = None
        self._fenced = None
        self._cursor = self.subscription.initialize(last_acked_sequence, start)
        self.epoch = self.subscription.epoch
        self._acked = self._cursor - 1
        self._acks_since_dequeue = 0
        self._gaps = {}
        self._refresh()

    def close(self) -> None:
        """Stop; a named subscriber also writes its acks and publishes its position (a
        fenced or removed instance has nothing to write: that is logged, not raised)."""
        if not self._closed and self.epoch is not None:
            try:
                if self._fenced is not None:
                    raise self._fenced
                self.subscription.close_reader()
            except FencedError as e:
                log.info("close of a fenced consumer wrote nothing: %s", e)
        self._closed = True
        self._poll.wake()
        self._ahead.cancel()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- checks ------------------------------------------------------------------

    def _epoch(self) -> int:
        self._check_not_closed()
        if self.epoch is None:
            raise NotInitializedError("call initialize() before using the consumer")
        if self._fenced is not None:
            raise self._fenced.with_traceback(None)
        return self.epoch

    def _check_not_closed(self) -> None:
        self._guard.check()
        if self._closed:
            raise ClosedError("consumer is closed")

    @contextlib.contextmanager
    def _fencing(self) -> Iterator[None]:
        """Remember a FencedError: every later call raises it again, with no request."""
        try:
            yield
        except FencedError as e:
            self._fenced = e
            self._ahead.cancel()
            raise

    def _current(self) -> None:
        """A check or a write just showed this instance current: the next check is due
        ``check_every`` entries or ``check_interval`` from now."""
        self._served = 0
        self._checked_ms = self.subscription.clock_ms()

    def _check(self, snap: Snapshot | None = None) -> None:
        """Raise FencedError if a newer instance of this subscriber took over."""
        self.subscription.check(snap)
        self._current()

    def _check_due(self) -> bool:
        return (
            self._served >= self.config.check_every
            or self.subscription.clock_ms() - self._checked_ms >= self._check_ms
        )

    # --- reading ---------------------------------------------------------------

    def _refresh(self) -> None:
        """Re-read the root (and check) and the entries from the cursor on.

        Only a window is decoded (the group holding the cursor and what follows, up to
        ``WINDOW`` entries), so a long backlog costs one group GET per window.
        """
        snap = self.queue.read()
        self._footer = None  # older than this read
        self._check(snap)
        start = max(self._cursor, snap.low)
        window = max(WINDOW, self.config.read_ahead + 1)
        got = itertools.islice(snap.iter_sized_from(start), window)
        self._entries = {e.sequence: (e, size) for e, size in got}
        self._low = snap.low
        self._tail = snap.root.next_seq
        self.stats.incr("manifest_refreshes")

    def _nothing_new(self) -> bool:
        """At the tail: one 22-byte footer GET says whether anything was appended since the
        last root read (the default consumer's epoch check comes with it).  A named
        subscriber idling at the tail checks its own epoch at most once per
        ``check_interval`` (an idle fenced instance has nothing to land)."""
        if self._cursor < self._tail:
            return False
        footer, self._footer = self._footer, None
        if footer is None:
            footer = self.queue.read_footer()
        if self.subscription.check_footer(footer.epoch):
            self._current()
        if footer.next_sequence > self._tail:
            return False
        if self._check_due():
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
                "moves on"
            )
        n = self._low - self._cursor
        log.warning(
            "subscriber %r skips sequences %d..%d: unlinked before it read them",
            self.subscriber,
            first,
            last,
        )
        self.stats.incr("lost_sequences", n)
        self.subscription.lost += n
        self._cursor = self._low
        self._gaps[first] = last  # acks step over the skipped range
        self._ack_gaps()

    def next_batch(self, timeout: float | None = None) -> ConsumedBatch | None:
        """The entry after the last one returned, with its data; None if none is queued.

        ``timeout`` (seconds): at the tail, wait up to this long for an entry (a long
        poll, :mod:`tieredbuf.queue.longpoll`).  An idle consumer calling
        ``next_batch(timeout=...)`` in a loop reads the root's 22-byte footer when it
        finds nothing, then 0.1 s later and with a backoff doubling to
        ``idle_poll_max`` (2.5 s), carried over from call to call: at 0, 0.1, 0.3, 0.7,
        1.5, 3.1 s, then every 2.5 s -- 8 small GETs in the first 10 s after it went
        idle, then 4 per 10 s (0.4/s; tests/test_longpoll.py counts them) -- and it
        sees a new entry within the current pause.  The default consumer learns of a
        newer epoch from the same footer (FencedError); a named subscriber checks its
        epoch when an entry arrives (its acks land only through its fenced progress
        CAS).  Without a
        timeout, no wait (at the tail: one footer GET).  Entries the consumer already
        knows are served with no request but their data GETs (fetched ahead), and one
        check every ``check_every`` entries or ``check_interval``.
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
            with self._fencing():
                footer = self._poll.wait(
                    self._tail, remaining, epoch=self.subscription.footer_epoch
                )
            if footer is None:
                self._check_not_closed()
                return None
            self._footer = footer  # something moved: the next check needs no second GET

    def _next_batch(self) -> ConsumedBatch | None:
        self._epoch()
        with self._fencing():
            if self._cursor in self._entries:
                if self._check_due():
                    self._check()
            elif self._nothing_new():
                return None
            else:
                self._refresh()
            return self._serve()

    def _serve(self) -> ConsumedBatch | None:
        while True:
            if self._cursor < self._low:
                self._lost()
                if self._cursor not in self._entries:
                    self._refresh()
            seq = self._cursor
            got = self._entries.get(seq)
            if got is None:
                return None
            entry, size = got
            self._ahead.want(self._upcoming(seq))
            try:
                data = self._ahead.take(entry, size)
                break
            except MissingObjectError:
                # the window may predate a retention pass whose unlinked objects GC has
                # since reaped: that is retention's loss (told, or skipped), judged from a
                # fresh root; an object the root still links is missing for another reason
                self._ahead.cancel()
                self._refresh()
                if self._cursor >= self._low:
                    raise
        self._cursor = seq + 1
        self._served += 1
        self._entries.pop(seq, None)
        self._ahead.want(self._upcoming(self._cursor))
        self.stats.incr("batches_read")
        return ConsumedBatch(entry.sequence, entry.location, entry.metadata, data)

    def _upcoming(self, start: int) -> Iterator[tuple[ManifestEntry, int]]:
        """The known entries from ``start`` on, in order, until the first gap."""
        s = start
        while (got := self._entries.get(s)) is not None:
            yield got
            s += 1

    # --- acknowledging ---------------------------------------------------------

    @property
    def last_acked_sequence(self) -> int | None:
        return self._acked if self._acked >= 0 else None

    def ack(self, sequence: int) -> None:
        """Confirm ``sequence`` is processed; acks must be in order, one after another.

        No request: every ``dequeue_every`` acks (and on flush()) they are written, by a
        write fenced at this instance's epoch (FencedError: nothing of it lands)."""
        self._epoch()
        expected = self._acked + 1
        if sequence != expected:
            raise AckOrderError(f"ack({sequence}) out of order: the next ack must be {expected}")
        if sequence >= self._cursor:
            raise AckOrderError(
                f"ack({sequence}) for a batch not yet read (next read {self._cursor})"
            )
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
        self._dequeue(publish=True, verify=True)

    def _dequeue(self, publish: bool, verify: bool = False) -> None:
        with self._fencing():
            if self.subscription.flush(publish=publish, verify=verify):
                self._current()
        self._acks_since_dequeue = 0
        self.stats.incr("dequeues")
