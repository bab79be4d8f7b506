"""The stateless producer (RFC 0001): batch in memory, flush to the store, append.

produce() buffers the call in the open batch.  A flusher thread cuts the batch
when it is ``flush_interval`` old, past ``flush_size_bytes``, or holding half of a
backpressure budget (so two batches can be in flight), and hands it to
a small upload pool; an appender thread takes every uploaded batch that is
ready, in order, and appends them all in one CAS (group commit).  One
producer's batches keep their order.  Backpressure: produce() blocks while
``max_buffered_inputs`` calls or ``max_buffered_bytes`` bytes are not yet durable.

Appends are paced across producers (:mod:`tieredbuf.queue.pacing`): with N writers
active on the buffer, each appends at most every ``N / manifest_writes_per_s``
seconds.  While a batch could not be appended before the next slot anyway, the
flusher keeps it open -- cutting it about one upload time before the slot -- so
one data object and one CAS carry what arrived in the interval, and the upload
overlaps the wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import MAX_UPLOADS_IN_FLIGHT, ProducerConfig
from tieredbuf.errors import BackpressureError, ClosedError, FlushTimeoutError
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem
from tieredbuf.produce.handles import Durability, DurabilityWatcher, WriteHandle, WriteOutcome
from tieredbuf.produce.publish import Pending, Publisher
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.queue.pacing import REGROUP_WAIT_S, AppendPacer
from tieredbuf.runtime.forks import ForkGuard, stop_at_exit
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import Store, manifest_writes_per_s

log = logging.getLogger(__name__)



def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


@dataclass
class _OpenBatch:
    records: list[bytes] = field(default_factory=list)
    metadata: list[MetadataItem] = field(default_factory=list)
    watchers: list[DurabilityWatcher] = field(default_factory=list)
    size: int = 0
    opened: float = 0.0


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
        self.producer_id = producer_id or f"p-{ULID()}"
        self.stats = Stats()
        self._stop = threading.Event()
        stop_at_exit(self._stop)
        self._publisher = Publisher(
            store, queue, self.producer_id, retry=self.config.retry,
            gc_grace_period=self.config.gc_grace_period, stop=self._stop, stats=self.stats,
        )
        rate = self.config.manifest_writes_per_s
        self._pacer = AppendPacer(queue, self.producer_id,
                                  manifest_writes_per_s(store) if rate is None else rate)
        self._publisher.optimistic = self._pacer.optimistic
        self._publisher.between_attempts = self._wait_turn
        self._upload_s = 0.0
        """Recent upload time (EWMA, seconds): how long before a slot to cut a batch."""
        self._urgent = 0
        """flush()/close() calls with a timeout: append at once, not at the pacer's slot."""
        self._flush_waiters = 0
        self._cond = threading.Condition()
        self._open = _OpenBatch()
        self._buffered_inputs = 0
        self._buffered_bytes = 0
        self._next_pseq = 1
        self._closing = False
        self._closed = False
        self._flush_now = False
        self._error: BaseException | None = None
        self._flusher_done = False
        self._pool = ThreadPoolExecutor(MAX_UPLOADS_IN_FLIGHT, thread_name_prefix="tb-upload")
        self._inflight: deque[tuple[Pending, Future[None], _OpenBatch]] = deque()
        self._flusher = threading.Thread(target=self._flush_loop, name="tb-flusher", daemon=True)
        self._appender = threading.Thread(target=self._append_loop, name="tb-append", daemon=True)
        self._flusher.start()
        self._appender.start()

    # --- public API ----------------------------------------------------------

    def produce(
        self, entries: object, metadata: bytes = b"", *, timeout: float | None = None
    ) -> WriteHandle:
        """Buffer ``entries`` (a list of byte records) with one ``metadata`` payload.

        Blocks under backpressure; with ``timeout`` raises BackpressureError instead of
        waiting longer.
        """
        records = as_records(entries)
        meta = bytes(metadata)
        size = sum(len(r) + 4 for r in records) + len(meta) + 16
        cfg = self.config
        handle = WriteHandle()
        with self._cond:
            self._check_open()
            ok = self._cond.wait_for(
                lambda: self._closing
                or self._error is not None
                or (
                    self._buffered_inputs < cfg.max_buffered_inputs
                    and (self._buffered_bytes == 0
                         or self._buffered_bytes + size <= cfg.max_buffered_bytes)
                ),
                timeout,
            )
            self._check_open()
            if not ok:
                self.stats.incr("backpressure_timeouts")
                raise BackpressureError(
                    f"producer buffer full ({self._buffered_inputs} calls, "
                    f"{self._buffered_bytes} bytes) for {timeout} s"
                )
            b = self._open
            if not b.records and not b.metadata:
                b.opened = time.monotonic()
            b.metadata.append(
                MetadataItem(len(b.records), time.time_ns() // 1_000_000, meta)
            )
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
        """Flush the open batch now and wait until everything buffered is REMOTE.

        Without ``timeout`` the append still waits for this producer's slot (at most one
        pacing interval, :mod:`tieredbuf.queue.pacing`); with one it goes at once.
        Raises the store error that stopped the producer (a permanent one: credentials,
        access, bucket), or FlushTimeoutError saying what is not REMOTE yet (the
        producer keeps retrying it)."""
        self._guard.check()
        with self._cond:
            self._flush_now = True
            urgent = int(timeout is not None)
            self._urgent += urgent
            self._flush_waiters += 1
            self._cond.notify_all()
            try:
                ok = self._cond.wait_for(
                    lambda: self._buffered_inputs == 0 or self._error is not None, timeout
                )
            finally:
                self._urgent -= urgent
                self._flush_waiters -= 1
            if self._error is not None:
                raise self._error
            if not ok:
                raise FlushTimeoutError(
                    f"flush() ran out of time after {timeout} s: {self._pending()} not REMOTE "
                    f"yet, held in this process's memory and still retried{self._why()}"
                )

    @property
    def manifest_writes_per_s(self) -> float:
        """The manifest write budget this producer paces its appends at: its config's,
        else the store's (1 on Cloudflare R2, else 5)."""
        return self._pacer.writes_per_s

    def close(self, timeout: float | None = None) -> None:
        """Flush everything, wait until it is in the queue, stop the threads.

        As for :meth:`flush`, the last append waits for this producer's pacing slot
        unless a ``timeout`` is given.

        With ``timeout``: when it runs out, what is not REMOTE is dropped -- a stateless
        producer holds it in memory only -- its handles fail, and FlushTimeoutError says
        how much.  Raises the store error that stopped the producer, if one did."""
        self._guard.check()
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._urgent += int(timeout is not None)
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._flusher.join(_left(deadline))
        self._appender.join(_left(deadline))
        if self._appender.is_alive():
            with self._cond:
                err = FlushTimeoutError(
                    f"close() ran out of time after {timeout} s: {self._pending()} not REMOTE; "
                    f"a stateless producer holds them in memory only, so they are dropped "
                    f"and their handles fail (an append already in flight may still land: "
                    f"its handle says so){self._why()}"
                )
            self._die(err)
            self._stop.set()  # uploads stop retrying
            self._pool.shutdown(wait=False, cancel_futures=True)
            with self._cond:
                self._closed = True
            raise err
        self._pool.shutdown(wait=True)
        with self._cond:
            self._closed = True
        if self._error is not None:
            raise self._error

    def _pending(self) -> str:
        """Under the lock: what is not REMOTE yet, in words."""
        return f"{self._buffered_inputs} produce() call(s) ({self._buffered_bytes} bytes)"

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
        # no append before the pacer's next free slot: gather until about one upload
        # before it (a batch already in flight takes the next slot, this one the one after)
        slot = self._pacer.due_in(ahead=1 if self._inflight else 0)
        return max(due, slot - self._upload_s)

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
            p = Pending(body, keys.BATCH_SUFFIX, tuple(batch.metadata), pseq)
            fut = self._pool.submit(self._upload, p)
            with self._cond:
                self._inflight.append((p, fut, batch))
                self._cond.notify_all()

    def _wait_turn(self) -> None:
        """After a lost CAS (on the appender thread): wait for this writer's slot."""
        def wait(seconds: float) -> None:
            self._cond.notify_all()  # the flusher times its next cut from this wait
            self._cond.wait(seconds)

        with self._cond:
            self._pacer.wait_turn(lambda: bool(self._urgent) or self._error is not None, wait)

    def _upload(self, p: Pending) -> None:
        started = time.monotonic()
        self._publisher.upload(p)
        took = time.monotonic() - started
        self._upload_s = took if not self._upload_s else 0.8 * self._upload_s + 0.2 * took

    def _append_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: bool(self._inflight) or self._flusher_done
                )
                if not self._inflight:
                    return
            head = self._inflight[0][1]
            try:
                head.result()
                self._pacer.probe()  # a first append: learn the writers before its slot
            except BaseException as e:
                self._die(e)
                return
            with self._cond:
                # this writer's slot (group commit across producers); uploads go on
                while not (self._urgent or self._error is not None):
                    # a flush or close takes its turn: closing together is a CAS storm
                    left = self._pacer.due_in(turn=self._closing or self._flush_waiters > 0)
                    if left <= 0:
                        break
                    self._cond.wait(left)
                group = []
                while self._inflight and self._inflight[0][1].done():
                    group.append(self._inflight.popleft())
            def more(group: list[Any] = group) -> list[Pending]:
                """After a lost CAS and the wait for this writer's turn: the batches
                uploaded meanwhile join the retry (one append for all of them)."""
                extra = self._uploaded_meanwhile()
                group.extend(extra)
                return [p for p, _, _ in extra]

            try:
                for _, fut, _b in group:
                    fut.result()
                seqs = self._publisher.append([p for p, _, _ in group], more)
            except BaseException as e:
                self._die(e, [b for _, _, b in group])
                return
            self._pacer.appended()
            with self._cond:
                self._cond.notify_all()  # the flusher times its next cut from this append
            self.stats.incr("batches_flushed", len(group))
            released_inputs = released_bytes = 0
            for (p, _, b), seq in zip(group, seqs, strict=True):
                outcome = WriteOutcome(seq, p.location, Durability.REMOTE)
                for w in b.watchers:
                    w.reach(Durability.REMOTE, outcome)
                released_inputs += len(b.watchers)
                released_bytes += b.size
            with self._cond:
                self._buffered_inputs -= released_inputs
                self._buffered_bytes -= released_bytes
                self._cond.notify_all()

    def _uploaded_meanwhile(self) -> list[tuple[Pending, Future[None], _OpenBatch]]:
        """On the appender thread (the only one taking from ``_inflight``): the batches
        cut since, in order, once uploaded.  One still uploading was cut about one upload
        before this turn: it is waited for, up to twice the recent upload time."""
        extra: list[tuple[Pending, Future[None], _OpenBatch]] = []
        while True:
            with self._cond:
                if not self._inflight:
                    return extra
                head = self._inflight[0][1]
            if not head.done():
                futures_wait([head], timeout=max(REGROUP_WAIT_S, 2 * self._upload_s))
            with self._cond:
                if not (head.done() and head.exception() is None):
                    return extra  # failed or slow: the next append deals with it
                extra.append(self._inflight.popleft())

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
