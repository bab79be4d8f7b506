"""Structured Streaming reads of the ``tieredbuf`` source.

Offsets are ``{"sequence": next, "buffer": "<buffer id>", "from": start, "consumer":
name}``: ``sequence`` is where the micro-batch ends (exclusive), ``buffer`` the id of
the buffer it was read from (root section 6; absent for roots that have none yet),
``from`` where the micro-batch started and ``consumer`` the subscriber it acks as
(absent without the option).  Spark keeps them in its offset log, so:

* ``startingOffsets`` / ``startingTimestamp`` only choose where the *first*
  micro-batch starts; the position they resolved to is stored with that batch (its
  ``from``), so a re-run after a restart reads the same range, and after that every
  record is delivered, whatever its ingestion time (late records included: Kafka's
  semantics).  No time filter is applied to streaming micro-batches.
* Nothing before the requested start is delivered: a ``startingOffsets`` past the
  tail is an error (never clamped to the tail), and a ``startingTimestamp`` later
  than every record waits: the initial offset carries it (``PENDING_TS``) and each
  trigger looks again for the first object holding a record ingested at or after it.
* A checkpoint whose offsets name another buffer id (the buffer was deleted and
  created again), or a buffer whose next sequence is below the checkpoint's offset,
  fails the query: its positions mean nothing here (the Kafka source fails on offset
  regressions the same way).
* A checkpoint restarted under another ``consumer`` (or none) while its old
  subscriber is still registered fails, naming it and ``tieredbuf subscribers
  remove``: the old one would hold the head back forever.
* A start below the first sequence the buffer keeps (dequeued, or unlinked by
  retention) fails the query, or with ``failOnDataLoss=false`` is skipped; the
  skipped sequences are logged and counted in the progress's ``latestOffset``
  (``lostSequences``): pyspark 4.3's Python source has no custom-metrics hook.

Each trigger reads the root once (one GET) and lists only the objects of its
micro-batch through the tree (:mod:`tieredbuf.spark.plan`): its cost does not grow
with the backlog.  An idle query costs almost nothing: Spark asks for the latest
offset every few milliseconds while nothing arrives; once a trigger found nothing
new, the source answers from the root's 22-byte footer (one ranged GET: its next
sequence and epoch) and, after each such answer, without any request for a backoff
that doubles from ``IDLE_BACKOFF_S`` to the ``idlePollMaxMs`` option (0.1 s to 2 s by
default: at most 0.5 requests/s idle; new data is seen within 2 s; a lower cap sees it
sooner for more idle requests, 1 / cap a second).  With ``consumer`` the query is
a named subscriber of the buffer (:mod:`tieredbuf.spark.consumer_mode`), fenced per
name: Spark calls ``commit(end)`` only after the micro-batch ending at ``end`` is in
its commit log -- in fact one micro-batch late, when it plans the next one -- so
nothing is acked while Spark may still need it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxFiles,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

import tieredbuf
from tieredbuf.errors import (
    BufferNotFoundError,
    ConfigError,
    DataLossError,
    ObjectNotFoundError,
)
from tieredbuf.format import manifest as fm
from tieredbuf.queue.manifest_queue import Snapshot
from tieredbuf.spark import options as opt
from tieredbuf.spark import plan
from tieredbuf.spark.consumer_mode import QueueConsumer
from tieredbuf.spark.executor import ObjectPartition, arrow_schema, read_partition, shared_buffer

log = logging.getLogger(__name__)

IDLE_BACKOFF_S = 0.1
"""The first pause after a footer read found nothing new."""
IDLE_BACKOFF_MAX_S = opt.IDLE_POLL_MAX_MS / 1000
"""The default longest pause (``idlePollMaxMs``): an idle query sends at most one small
GET per this long."""

CONSUMER = "consumer"
"""The subscriber a query's offsets were read and acked as (its ``consumer`` option)."""

PENDING_TS = "startingTimestamp"
"""In the initial offset only: no record ingested at or after this time (ms) existed
when the query started; the first micro-batch starts at the first object holding one."""


def _seq(offset: dict[str, Any]) -> int:
    return int(offset["sequence"])


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("tieredbuf")``.

    Spark also builds (and pickles to executors) a copy of this reader only to call
    :meth:`read`; so nothing happens in ``__init__``: the buffer is opened and the
    consumer initialized on first use by the driver's offset calls.
    """

    def __init__(self, ro: opt.ReadOptions, schema: StructType) -> None:
        self.ro = ro
        self.schema = schema
        self._snap: Snapshot | None = None
        self._target: int | None = None
        self._consumer: QueueConsumer | None = None
        self.lost_sequences = 0
        """Sequences skipped because they were gone (failOnDataLoss=false)."""
        self._lost_through = -1
        self._idle = False
        self._idle_backoff = 0.0
        self._idle_until = 0.0
        self._idle_next = -1
        self._renamed_from: str | None = None
        """The checkpoint's consumer name, checked to be no longer registered."""
        """The root's next sequence when the query went idle (what a footer read compares
        against: nothing new while it is the same)."""

    def __getstate__(self) -> dict[str, Any]:
        return {"ro": self.ro, "schema": self.schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["ro"], state["schema"])  # type: ignore[misc]

    # --- driver side -----------------------------------------------------------------

    def _buf(self) -> tieredbuf.Buffer:
        return shared_buffer(self.ro.url, self.ro.store)

    def _queue_consumer(self) -> QueueConsumer | None:
        if self.ro.consumer is not None and self._consumer is None:
            self._consumer = QueueConsumer(self._buf(), self.ro.consumer)
        return self._consumer

    def _read(self) -> Snapshot:
        """One root read (BufferNotFoundError where there is none); fenced in consumer
        mode."""
        consumer = self._queue_consumer()
        if consumer is not None:
            consumer.start()  # before the read: never fence ourselves with our own bump
        snap = plan.read_snapshot(self._buf())
        if consumer is not None:
            consumer.check(snap)
        self._snap = snap
        return snap

    def _offset(self, snap: Snapshot, seq: int, start: int | None = None) -> dict[str, Any]:
        off: dict[str, Any] = {"sequence": opt.check_long(seq)}
        if snap.buffer_id is not None:
            off["buffer"] = snap.buffer_id
        if start is not None:
            off["from"] = start
        if self.ro.consumer is not None:
            off[CONSUMER] = self.ro.consumer
        return off

    def _same_consumer(self, off: dict[str, Any]) -> None:
        """Fail when the checkpoint was run as another subscriber that is still
        registered: it would hold the buffer's head back forever (before anything is
        registered or acked under the new name)."""
        old = off.get(CONSUMER)
        if old is None or old == self.ro.consumer or old == self._renamed_from:
            return
        snap = plan.read_snapshot(self._buf())
        if old in snap.registry:
            now = f"consumer={self.ro.consumer}" if self.ro.consumer else "no consumer"
            raise ConfigError(
                f"this checkpoint was run as subscriber {old!r} of {self.ro.url} (option "
                f"consumer={old}), which is still registered and holds the buffer's head "
                f"back; restarted with {now} it would stay registered, and the buffer "
                f"would grow without bound.  Restart with consumer={old}, or remove the "
                f"old subscriber first: tieredbuf subscribers remove {self.ro.url} {old}"
            )
        log.warning(
            "tieredbuf: the checkpoint of subscriber %r (no longer registered) goes on "
            "with consumer=%s",
            old,
            self.ro.consumer,
        )
        self._renamed_from = old

    def _same_buffer(self, off: dict[str, Any], snap: Snapshot) -> None:
        """Fail when the checkpoint's offset cannot belong to this buffer."""
        bid = off.get("buffer")
        if bid is not None and snap.buffer_id != bid:
            raise DataLossError(
                f"the checkpoint's offsets are of buffer {bid}, but the buffer at "
                f"{self.ro.url} is {snap.buffer_id or 'an older-format one'} (deleted and "
                "created again?): its sequences are not the checkpoint's; start a new "
                "checkpoint"
            )
        if _seq(off) > snap.root.next_seq:
            raise DataLossError(
                f"the checkpoint's offset {_seq(off)} is past the end of the buffer at "
                f"{self.ro.url} (next sequence {snap.root.next_seq}): the buffer was "
                "recreated or rolled back; start a new checkpoint"
            )

    def _floor(self, start: int, snap: Snapshot) -> int:
        """``start``, or the first kept sequence when it is gone (failOnDataLoss=false:
        counted once in this run's progress, and in consumer mode in the subscriber's
        own ``lost`` count)."""
        first = plan.lost_floor(start, snap.low, self.ro)
        if first > start:
            new = max(0, first - max(start, self._lost_through + 1))
            self.lost_sequences += new
            self._lost_through = max(self._lost_through, first - 1)
            consumer = self._queue_consumer()
            if consumer is not None:
                consumer.skipped(start, first)
        return first

    def _check_start(self, snap: Snapshot) -> None:
        """Refuse a start the options ask for that this buffer cannot give: an offsets
        JSON of another buffer, a sequence past the tail (clamping it to the tail would
        deliver the sequences before it)."""
        plan.check_bound_buffers(snap, self.ro)
        nxt = snap.root.next_seq
        if isinstance(self.ro.starting, int) and self.ro.starting > nxt:
            start = self.ro.starting
            raise ConfigError(
                f"startingOffsets {start} is past the end of the buffer at {self.ro.url} "
                f"(its next sequence is {nxt}): nothing before {start} may be delivered, and "
                f"{start} does not exist yet; start at the tail with startingOffsets=latest "
                f"(or {nxt}), or once sequence {start} exists"
            )

    def initialOffset(self) -> dict[str, Any]:
        consumer = self._queue_consumer()
        if consumer is not None:
            # options refused before anything is registered: a subscriber left behind by
            # a query that never ran would hold the head back
            self._check_start(plan.read_snapshot(self._buf()))
            # a new subscriber starts where startingOffsets says
            consumer.start(latest=self.ro.starting == opt.LATEST)
        snap = self._read()
        self._check_start(snap)
        if self.ro.starting_ts is not None:
            start = plan.time_start(snap, self.ro.starting_ts, self.ro)
        elif consumer is not None and self.ro.starting is None:
            # a new checkpoint of a subscriber resumes at its position (a Kafka consumer
            # group's committed offset); an explicit startingOffsets wins
            start = self._floor(consumer.start(), snap)
        else:
            start = self._floor(plan.resolve_bound(self.ro.starting, snap, opt.EARLIEST), snap)
        nxt = snap.root.next_seq
        if start > nxt:  # a subscriber's position past the tail: never clamp it
            raise DataLossError(
                f"the stream on {self.ro.url} would start at sequence {start}, past the "
                f"buffer's next sequence {nxt} (rolled back?); nothing is delivered"
            )
        if self.ro.starting_ts is not None and start >= nxt:
            # no record ingested at or after startingTimestamp yet: wait for the first
            # object holding one (latestOffset), never start at the tail, which would
            # deliver what is appended meanwhile with older ingestion times
            log.info(
                "tieredbuf stream on %s waits for a record ingested at or after %d",
                self.ro.url,
                self.ro.starting_ts,
            )
            off = self._offset(snap, nxt)
            off[PENDING_TS] = self.ro.starting_ts
            return off
        log.info("tieredbuf stream on %s starts at sequence %d", self.ro.url, start)
        return self._offset(snap, start)

    def prepareForTriggerAvailableNow(self) -> None:
        # the tail only: the subscriber is registered (and fenced) by the first offset
        # call, after the checkpoint's offsets were checked against it (_same_consumer)
        self._target = plan.read_snapshot(self._buf()).root.next_seq

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.ro.max_offsets is not None:
            return ReadMaxFiles(self.ro.max_offsets)
        if self.ro.max_bytes is not None:
            return ReadMaxBytes(self.ro.max_bytes)
        return ReadAllAvailable()

    def _nothing_new(self, start: dict[str, Any]) -> bool:
        """Idle (the last trigger found nothing new): True while the backoff runs, with
        no request, then from the root's 22-byte footer (fenced in consumer mode).  New
        entries, or a buffer behind the offset, go to a full read."""
        if self._target is not None or not self._idle:
            return False  # availableNow runs to a fixed end; a busy query reads the root
        now = time.monotonic()
        if now < self._idle_until:
            return True
        buf = self._buf()
        try:
            tail = buf.store.get_suffix(buf.queue.key, fm.FOOTER_SIZE)
        except ObjectNotFoundError:
            raise BufferNotFoundError(buf.url, "it was deleted under a running query") from None
        footer = fm.parse_footer(tail, obj=buf.queue.key)
        if self._consumer is not None:
            self._consumer.check_footer_epoch(footer.epoch)
        if footer.next_sequence != self._idle_next:
            self._idle, self._idle_backoff = False, 0.0
            return False
        self._pause(now, footer.next_sequence)
        return True

    def _pause(self, now: float, next_seq: int) -> None:
        self._idle, self._idle_next = True, next_seq
        cap = (self.ro.idle_poll_max_ms or opt.IDLE_POLL_MAX_MS) / 1000
        self._idle_backoff = min(cap, max(IDLE_BACKOFF_S, 2 * self._idle_backoff))
        self._idle_until = now + self._idle_backoff

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        self._same_consumer(start)
        if self._nothing_new(start):
            return start
        snap = self._read()
        self._same_buffer(start, snap)
        s = frm = self._floor(_seq(start), snap)
        nxt = snap.root.next_seq
        pending = start.get(PENDING_TS)
        if pending is not None:
            # waiting for the first record ingested at or after startingTimestamp: the
            # objects appended meanwhile that hold only older records are never delivered
            s = frm = max(s, plan.time_start(snap, int(pending), self.ro))
        else:
            frm = _seq(start)
        end = nxt if self._target is None else min(nxt, self._target)
        if end <= s:
            if nxt <= _seq(start) or pending is not None:
                self._pause(time.monotonic(), nxt)  # idle: footer reads from now on
            return start
        self._idle = False
        end = self._admit(snap, s, end, limit)
        if end <= _seq(start):
            return start
        return self._offset(snap, end, frm)

    def _admit(self, snap: Snapshot, s: int, end: int, limit: ReadLimit) -> int:
        """End of a micro-batch from ``s``: within ``limit`` and, unless Spark asks for
        everything (``ReadAllAvailable``: Trigger.Once), within *both* of our limits --
        pyspark has no composite read limit, so Spark is handed one (the object count
        when set) and the other is applied here, as Delta's two limits both bound."""
        if isinstance(limit, ReadAllAvailable):
            return end
        max_files = self.ro.max_offsets
        max_bytes = self.ro.max_bytes
        if isinstance(limit, ReadMaxFiles):
            max_files = min(limit.max_files, max_files or limit.max_files)
        elif isinstance(limit, ReadMaxRows):
            # not a limit this source sets (it cannot count rows without reading them);
            # an object holds at least one row, so this many objects is an upper bound
            end = min(end, s + limit.max_rows)
        elif isinstance(limit, ReadMaxBytes):
            max_bytes = min(limit.max_bytes, max_bytes or limit.max_bytes)
        if max_files is not None:
            end = min(end, s + max_files)
        if max_bytes is not None:
            end = plan.admit_bytes(self._buf().store, snap, s, end, max_bytes)
        return end

    def reportLatestOffset(self) -> dict[str, Any] | None:
        snap = self._snap if self._snap is not None else self._read()
        off = self._offset(snap, snap.root.next_seq)
        off["lostSequences"] = self.lost_sequences
        return off

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        self._same_consumer(end)
        s, e = int(end.get("from", _seq(start))), _seq(end)
        if e <= s:
            return []
        snap = self._snap
        if snap is None or e > snap.root.next_seq:
            snap = self._read()
        self._same_buffer(end, snap)
        first = self._floor(s, snap)
        sized, lost, snap = plan.collect_fresh(self._buf(), snap, first, e, self.ro)
        if lost:
            self._floor(first, snap)
        return plan.object_partitions(self._buf().store, sized, self.ro)

    def commit(self, end: dict[str, Any]) -> None:
        """Spark is done with everything before ``end``: in consumer mode, ack it as the
        subscriber (fenced by its epoch)."""
        self._same_consumer(end)
        consumer = self._queue_consumer()
        if consumer is not None and _seq(end) > 0:
            consumer.commit(_seq(end) - 1)

    def stop(self) -> None:
        if self._consumer is not None:
            self._consumer.close()

    # --- executor side -----------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, ObjectPartition):
            return iter(())  # Spark's stand-in InputPartition(None) for an empty plan
        return read_partition(self.ro, arrow_schema(self.schema), partition)
