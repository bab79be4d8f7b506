"""The stateless producer (RFC 0001): batch in memory, flush to the store, append.

produce() buffers the call in the open batch.  A flusher thread cuts the batch
when it is ``flush_interval`` old, past ``flush_size_bytes``, or holding half of a
backpressure budget (so two batches can be in flight), and hands it to
a small upload pool; an appender thread takes every uploaded batch that is
ready, in order, and hands them to the buffer's fan-in hub
(:mod:`tieredbuf.produce.fanin`), which appends what every writer of the buffer has
uploaded in one commit per interval (``1 / manifest_writes_per_s``).  One producer's
batches keep their order.  A handle is REMOTE once the commit holding its batch
landed.  Backpressure: produce() blocks while ``max_buffered_inputs`` calls or
``max_buffered_bytes`` bytes are not yet durable.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import MAX_UPLOADS_IN_FLIGHT, ProducerConfig
from tieredbuf.errors import (
    BackpressureError,
    ClosedError,
    FlushTimeoutError,
    RemoteUnconfirmedError,
)
from tieredbuf.format import idem
from tieredbuf.format.announce import Announced
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.crc import crc32
from tieredbuf.format.manifest import MetadataItem
from tieredbuf.produce.fanin import hub_for
from tieredbuf.produce.handles import (
    Durability,
    DurabilityWatcher,
    GiveUp,
    RemoteOutcome,
    WriteHandle,
)
from tieredbuf.produce.publish import Pending, Publisher
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.runtime.forks import ForkGuard, stop_at_exit
from tieredbuf.runtime.retry import StallWatch
from tieredbuf.runtime.stats import Stats, ewma
from tieredbuf.store.base import Store, manifest_writes_per_s

log = logging.getLogger(__name__)


_LEAD_S = 0.005
"""Encoding a batch and handing it to the hub, on top of its upload."""


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _out_of_time(deadline: float | None, watch: StallWatch) -> bool:
    return (deadline is not None and time.monotonic() >= deadline) or watch.stalled()


def _slice(deadline: float | None, watch: StallWatch) -> float:
    left = _left(deadline)
    return watch.next_check() if left is None else min(left, watch.next_check())


@dataclass
class _OpenBatch:
    records: list[bytes] = field(default_factory=list)
    metadata: list[MetadataItem] = field(default_factory=list)
    watchers: list[DurabilityWatcher] = field(default_factory=list)
    size: int = 0
    opened: float = 0.0


def keyed_metadata(
    records: list[bytes], metadata: bytes, key: str | None, fingerprint: bytes | None
) -> bytes:
    """A call's metadata payload, with its idempotency key's tag in front when it has one
    (:mod:`tieredbuf.format.idem`; the fingerprint, unless given, of its records and
    metadata)."""
    if key is None:
        if fingerprint is not None:
            raise ValueError("a fingerprint goes with an idempotency key")
        return metadata
    return idem.tag(key, fingerprint or idem.fingerprint(records, metadata), metadata)


def as_records(entries: object) -> list[bytes]:
    if isinstance(entries, (bytes, bytearray, memoryview, str)):
        raise TypeError("produce() takes a list of byte records, not a single bytes/str")
    try:
        items: list[Any] = list(entries)  # type: ignore[call-overload]
    except TypeError as e:
        raise TypeError(f"produce() takes a list of byte records: {e}") from e
    if all(type(r) is bytes for r in items):  # the common case: no per-record copy call
        return items
    for i, r in enumerate(items):
        if not isinstance(r, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"produce() records must be bytes-like; record {i} is {type(r).__name__}"
            )
    return [bytes(r) for r in items]


class Producer:
    """Stateless (direct) producer; thread-safe."""

    def __init__(
        self,
        store: Store,
        queue: ManifestQueue,
        config: ProducerConfig | None = None,
        *,
        producer_id: str | None = None,
    ) -> None:
        self.config = config or ProducerConfig()
        self._guard = ForkGuard("producer")
        self._give_up = GiveUp(lambda: self._watch(None), self._wait_gave_up)
        self.producer_id = producer_id or f"p-{ULID()}"
        self.stats = Stats()
        self._stop = threading.Event()
        stop_at_exit(self._stop)
        self._publisher = Publisher(
            store, self.producer_id, retry=self.config.retry, stop=self._stop, stats=self.stats
        )
        rate = self.config.manifest_writes_per_s
        self._rate = manifest_writes_per_s(store) if rate is None else rate
        self._hub = hub_for(store, queue)
        self._hub_token = self._hub.attach(self._rate, self.config.gc_grace_period)
        self._cond = threading.Condition()
        self._open = _OpenBatch()
        self._buffered_inputs = 0
        self._buffered_bytes = 0
        self._released = 0
        """produce() calls that became REMOTE so far (progress, for a close's deadline)."""
        self._next_pseq = 1
        self._closing = False
        self._closed = False
        self._flush_now = False
        self._error: BaseException | None = None
        self._flusher_done = False
        self._lead_s = 0.0
        """How long before the hub's cut-off a batch is cut (an upload, EWMA)."""
        self._slot_cut: float | None = None
        """The hub turn a batch was last cut for (one cut per turn)."""
        self._pool = ThreadPoolExecutor(MAX_UPLOADS_IN_FLIGHT, thread_name_prefix="tb-upload")
        self._inflight: deque[tuple[Pending, Future[None], _OpenBatch]] = deque()
        self._committing = 0
        """Groups handed to the fan-in hub and not done yet."""
        self._submitted: dict[int, Pending] = {}
        """Their batches by producer seq (the grace rule may upload one again)."""
        self._flusher = threading.Thread(target=self._flush_loop, name="tb-flusher", daemon=True)
        self._appender = threading.Thread(target=self._append_loop, name="tb-append", daemon=True)
        self._flusher.start()
        self._appender.start()

    # --- public API ----------------------------------------------------------

    def commit_health(self) -> str | None:
        """What keeps this producer's writes from their commits now (a committer whose
        clock is too far ahead, docs/architecture.md "Clocks"), or None."""
        return self._hub.health()

    def produce(
        self,
        entries: object,
        metadata: bytes = b"",
        *,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        fingerprint: bytes | None = None,
    ) -> WriteHandle:
        """Buffer ``entries`` (a list of byte records) with one ``metadata`` payload.

        Blocks under backpressure (the buffer is full until uploads free it); with
        ``timeout`` raises BackpressureError instead of waiting longer, and without one
        once the store has failed with nothing getting through for
        ``retry.give_up_after`` (a slow store that keeps moving is waited for).
        ``idempotency_key`` travels with the call into the queue (its tag in the
        metadata item, :mod:`tieredbuf.format.idem`), where a retry of the call can be
        told from a new one (the service's ``Idempotency-Key``).
        """
        records = as_records(entries)
        meta = keyed_metadata(records, bytes(metadata), idempotency_key, fingerprint)
        size = sum(len(r) + 4 for r in records) + len(meta) + 16
        cfg = self.config
        handle = WriteHandle(DurabilityWatcher(give_up=self._give_up))
        with self._cond:
            self._check_open()

            def room() -> bool:
                return (
                    self._closing
                    or self._error is not None
                    or (
                        self._buffered_inputs < cfg.max_buffered_inputs
                        and (
                            self._buffered_bytes == 0
                            or self._buffered_bytes + size <= cfg.max_buffered_bytes
                        )
                    )
                )

            ok = room()
            if not ok:  # backpressure: the watch only then (produce() is the hot path)
                deadline = None if timeout is None else time.monotonic() + timeout
                ok = self._wait_for(room, deadline, self._watch(timeout))
            self._check_open()
            if not ok:
                self.stats.incr("backpressure_timeouts")
                raise BackpressureError(
                    f"producer buffer full ({self._buffered_inputs} calls, "
                    f"{self._buffered_bytes} bytes): produce() "
                    f"{self._gave_up(timeout)}{self._why()}"
                )
            b = self._open
            if not b.records and not b.metadata:
                b.opened = time.monotonic()
            b.metadata.append(MetadataItem(len(b.records), time.time_ns() // 1_000_000, meta))
            b.records.extend(records)
            b.watchers.append(handle.watcher)
            b.size += size
            self._buffered_inputs += 1
            self._buffered_bytes += size
            self.stats.incr("records_in", len(records))
            self.stats.incr("bytes_in", size)
            if len(b.watchers) == 1 or self._pressing(b):
                self._cond.notify_all()  # start the interval timer, or cut now
        return handle

    def flush(self, timeout: float | None = None) -> None:
        """Flush the open batch now and wait until everything buffered is REMOTE (in the
        buffer's next commit, :mod:`tieredbuf.produce.fanin`).

        Raises the store error that stopped the producer (a permanent one: credentials,
        access, bucket), or FlushTimeoutError saying what is not REMOTE yet (the
        producer keeps retrying it) when ``timeout`` runs out -- or, without one, once the
        store has failed with nothing getting through for ``retry.give_up_after``."""
        self._guard.check()
        deadline = None if timeout is None else time.monotonic() + timeout
        watch = self._watch(timeout)
        with self._cond:
            self._flush_now = True
            self._cond.notify_all()
            ok = self._wait_for(
                lambda: self._buffered_inputs == 0 or self._error is not None, deadline, watch
            )
            if self._error is not None:
                raise self._error
            if not ok:
                raise FlushTimeoutError(
                    f"flush() {self._gave_up(timeout)}: {self._pending()} not REMOTE "
                    f"yet, held in this process's memory and still retried{self._why()}"
                )

    @property
    def manifest_writes_per_s(self) -> float:
        """The commit budget this producer asks of the buffer's fan-in hub: its config's,
        else the store's (1 on Cloudflare R2, else 5)."""
        return self._rate

    def close(self, timeout: float | None = None) -> None:
        """Flush everything, wait until it is in the queue, stop the threads.

        It gives up when ``timeout`` runs out or, without one, once the store has failed
        with nothing getting through for ``retry.give_up_after`` (30 s by default, as a
        direct call; None: wait until it works).  What is not REMOTE then is dropped -- a
        stateless producer holds it in memory only -- its handles fail, and
        FlushTimeoutError says how much.  Raises the store error that stopped the
        producer, if one did."""
        self._guard.check()
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        watch = self._watch(timeout)
        for thread in (self._flusher, self._appender):
            while thread.is_alive() and not _out_of_time(deadline, watch):
                thread.join(_slice(deadline, watch))
        with self._cond:  # and what the hub still has of ours
            self._wait_for(
                lambda: self._committing == 0 or self._error is not None, deadline, watch
            )
            stuck = self._appender.is_alive() or self._committing > 0
        if stuck:
            with self._cond:
                err = FlushTimeoutError(
                    f"close() {self._gave_up(timeout)}: {self._pending()} not REMOTE; "
                    f"a stateless producer holds them in memory only, so they are dropped "
                    f"and their handles fail (an append already in flight may still land: "
                    f"its handle says so){self._why()}"
                )
            self._die(err)
            self._stop.set()  # uploads stop retrying
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._hub.withdraw(self.producer_id)  # the hub stops waiting for them
            self._hub.detach(self._hub_token, timeout=0)
            with self._cond:
                self._closed = True
            raise err
        self._pool.shutdown(wait=True)
        left = _left(deadline)  # the lease is handed on within the close's own deadline
        self._hub.detach(self._hub_token, timeout=10.0 if left is None else left)
        with self._cond:
            self._closed = True
        if self._error is not None:
            raise self._error

    def _watch(self, timeout: float | None) -> StallWatch:
        """A wait's own deadline when the caller gave none: the store failed and nothing
        got through for ``retry.give_up_after`` (uploads, and the hub's commits)."""
        limit = self.config.retry.give_up_after
        return StallWatch(
            None if timeout is not None or limit is None else limit.total_seconds(),
            progress=lambda: self._released + self.stats.get("objects_uploaded"),
            failures=lambda: (
                self.stats.get("upload_retries")
                + self.stats.get("store_permanent_errors")
                + self._hub.stats.get("hub_retries")
            ),
        )

    def _wait_for(self, ready: Any, deadline: float | None, watch: StallWatch) -> bool:
        """Under the lock: wait until ``ready()``, the deadline, or a stalled store."""
        while not ready():
            if _out_of_time(deadline, watch):
                return False
            self._cond.wait(_slice(deadline, watch))
        return True

    def _gave_up(self, timeout: float | None) -> str:
        if timeout is not None:
            return f"ran out of time after {timeout} s"
        limit = self.config.retry.give_up_after
        secs = 0.0 if limit is None else limit.total_seconds()
        return (
            f"gave up: the store kept failing for {secs:g} s with nothing getting through "
            "(RetryConfig.give_up_after; pass timeout= to wait longer)"
        )

    def _pending(self) -> str:
        """Under the lock: what is not REMOTE yet, in words."""
        return f"{self._buffered_inputs} produce() call(s) ({self._buffered_bytes} bytes)"

    def _wait_gave_up(self, durability: Durability) -> BaseException:
        """What a write's wait without timeout raises once the store stalled."""
        return FlushTimeoutError(
            f"write not {durability.name}: {self._gave_up(None)}; it is held in this "
            f"process's memory and still retried{self._why()}"
        )

    def _why(self) -> str:
        last = self._publisher.last_error
        return f"; last store error: {last}" if last is not None else ""

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- background ----------------------------------------------------------

    def _check_open(self) -> None:
        self._guard.check()
        if self._closing or self._closed:
            raise ClosedError("producer is closed")
        if self._error is not None:
            raise self._error

    def _due(self) -> float | None:
        """Seconds until the open batch must be flushed (<= 0: now), None if empty."""
        b = self._open
        if not b.watchers:
            return None
        if self._closing or self._flush_now or self._pressing(b):
            return 0.0
        due = b.opened + self.config.flush_interval.total_seconds() - time.monotonic()
        # When this process holds the lease, its hub's next turn takes what is handed over
        # by its cut-off: cut the batch in time for it, never later than the timer, once a
        # turn (a turn running late would have every batch opened meanwhile cut at once),
        # and not when it is too late to make it (then the timer decides).
        cutoff = self._hub.cutoff_in()
        if cutoff is None or cutoff[1] == self._slot_cut:
            return due
        slot, turn = cutoff
        cut = max(0.0, slot - self._lead_s)
        if (slot == 0 or slot > self._lead_s / 2) and cut < due:
            if cut == 0:  # the turn's cut (a batch the timer cut before it does not count)
                self._slot_cut = turn
            return cut
        return due

    def _pressing(self, b: _OpenBatch) -> bool:
        """Cut now: the batch is full, or holds half of a backpressure budget.

        Waiting for the timer with half the budget in one batch would leave produce()
        blocked on a single batch in flight; cutting at half keeps two in flight.
        """
        cfg = self.config
        return (
            b.size >= cfg.flush_size_bytes
            or len(b.watchers) * 2 >= cfg.max_buffered_inputs
            or b.size * 2 >= cfg.max_buffered_bytes
        )

    def _flush_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    due = self._due()
                    if due is not None and due <= 0:
                        break
                    if due is None and self._closing:
                        self._flusher_done = True
                        self._cond.notify_all()
                        return
                    if due is None:
                        self._flush_now = False
                    self._cond.wait(due)
                batch, self._open = self._open, _OpenBatch()
                self._flush_now = False
                pseq = self._next_pseq
                self._next_pseq += 1
            body = encode_batch(batch.records, self.config.batch_compression)
            p = Pending(body, keys.BATCH_SUFFIX, tuple(batch.metadata), pseq, crc32=crc32(body, 0))
            fut = self._pool.submit(self._upload, p)
            with self._cond:
                self._inflight.append((p, fut, batch))
                self._cond.notify_all()

    def _upload(self, p: Pending) -> None:
        started = time.monotonic()
        self._publisher.upload(p)
        took = time.monotonic() - started + _LEAD_S  # an upload, and a few ms to hand it over
        self._lead_s = ewma(self._lead_s, took)

    def _append_loop(self) -> None:
        """Hand every uploaded batch, in order, to the fan-in hub (not waiting for its
        commit: the next batches upload and follow meanwhile)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._inflight) or self._flusher_done)
                if not self._inflight:
                    return
            head = self._inflight[0][1]
            try:
                head.result()
            except BaseException as e:
                self._die(e)
                return
            with self._cond:
                group = []
                while self._inflight and self._inflight[0][1].done():
                    group.append(self._inflight.popleft())
                self._committing += 1
                for p, _, _ in group:
                    self._submitted[p.producer_seq] = p
            for _, fut, _b in group:
                if fut.exception() is not None:
                    self._die(
                        fut.exception() or RuntimeError("upload failed"), [b for _, _, b in group]
                    )
                    return
            entries = [
                Announced(p.producer_seq, p.location, p.size, p.metadata) for p, _, _ in group
            ]
            self._hub.submit(
                self.producer_id, entries, functools.partial(self._committed, group), self._reupload
            )
            self.stats.incr("batches_flushed", len(group))

    def _committed(
        self,
        group: list[tuple[Pending, Future[None], _OpenBatch]],
        seqs: list[tuple[int, str]] | None,
        err: BaseException | None,
    ) -> None:
        """On the hub's thread: the group's entries were found in the queue (each one's
        sequence and data object), or it failed.  A write that cannot be confirmed fails
        its own handles only; any other failure stops the producer."""
        with self._cond:
            self._committing -= 1
            for p, _, _ in group:
                self._submitted.pop(p.producer_seq, None)
            self._cond.notify_all()
        if isinstance(err, RemoteUnconfirmedError):
            for _, _, b in group:
                for w in b.watchers:
                    w.fail(err)
            self._release(group)
            return
        if err is not None or seqs is None:
            self._die(err or RuntimeError("commit failed"), [b for _, _, b in group])
            return
        for (_, _, b), (seq, location) in zip(group, seqs, strict=True):
            outcome = RemoteOutcome(seq, location)
            for w in b.watchers:
                w.reach(Durability.REMOTE, outcome)
        self._release(group)

    def _release(self, group: list[tuple[Pending, Future[None], _OpenBatch]]) -> None:
        """The group's batches no longer count against the backpressure budget."""
        with self._cond:
            released_inputs = sum(len(b.watchers) for _, _, b in group)
            self._released += released_inputs
            self._buffered_inputs -= released_inputs
            self._buffered_bytes -= sum(b.size for _, _, b in group)
            self._cond.notify_all()

    def _reupload(self, entries: Sequence[Announced]) -> list[Announced]:
        """The GC grace rule (on the hub's thread): these batches waited past half the
        grace period; upload them again under fresh keys."""
        with self._cond:
            mine = dict(self._submitted)
        out = []
        for e in entries:
            p = mine.get(e.producer_seq)
            if p is None:
                out.append(e)
                continue
            self._publisher.upload(p)
            self.stats.incr("reuploads_for_grace")
            out.append(Announced(e.producer_seq, p.location, p.size, e.metadata))
        return out

    def _die(self, error: BaseException, batches: list[_OpenBatch] | None = None) -> None:
        log.error("producer %s failed: %s", self.producer_id, error, extra={"tb_raised": True})
        with self._cond:
            if self._error is None:  # the first cause wins (a timeout, then its fallout)
                self._error = error
            failed = list(batches or []) + [b for _, _, b in self._inflight] + [self._open]
            self._inflight.clear()
            self._open = _OpenBatch()
            for b in failed:
                for w in b.watchers:
                    w.fail(error)
            self._cond.notify_all()
