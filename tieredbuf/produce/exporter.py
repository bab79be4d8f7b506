"""The exporter: move sealed segments from a stage to the object store and the queue.

For every sealed segment, oldest first: read it, upload it as ``data/<ULID>.batch``
or ``.qseg`` (one create-if-absent PUT: obstore has no conditional multipart) as
soon as it is sealed (up to ``max_uploads_in_flight`` at a time), hand it to the
buffer's fan-in hub (:mod:`tieredbuf.produce.fanin`), which appends what every writer
has uploaded in one commit per interval, and only once that commit landed release it
from the stage (delete the local file).  Every segment of a stream whose upload is
done goes to the hub together, oldest first; uploads go on meanwhile, and an uploaded
segment's bytes are dropped from memory until its commit (read back from the stage
only if it must be uploaded again).  :meth:`Exporter.wake` (a prompt seal for a REMOTE
waiter) starts the upload at once; without it the exporter looks for new segments
every 10 ms (a look at the stage: no store request, so an idle exporter costs nothing).

A local-directory store (``file://``) on the stage's file system takes a segment as a
hard link of the sealed file (LocalDirStore.put_link, Stage.link_segment): the file is
durable and read-only once sealed, and the stage never recycles a file that has
another name, so the disk does not write its bytes a third time.  Another file system
(EXDEV) or one without hard links: the bytes are uploaded, from then on.

Exactly once across crashes (I2).  Each stream's segments are appended under the
producer id ``<stage producer id>.<stream>`` with the segment's last per-core
sequence + 1 as its append number.  Within one stream, segments seal one after another
and cover increasing sequences, and the stage never reuses a sequence (Quiver
#4024), so the numbers only grow: a segment that was appended but not released
before a crash is recognised by the manifest's watermark and released without a
second entry; a group regrouped after a restart appends only the segments whose
numbers the watermark does not cover yet.  A segment is never skipped.

Failures.  Transient store errors (connection refused, timeouts, 5xx) are retried
with jittered backoff, counted, and logged at most once per ``RetryLog`` interval.
A permanent one (credentials, access, a missing bucket) sets :attr:`Exporter.error`:
every handle waiting for REMOTE fails with it, ``drain()`` (close, flush) raises it,
and /healthz turns 500.  The data stays staged; the exporter keeps trying, slowly
(``failure_retry``, default 1 s doubling to 60 s), and clears the error once an export
succeeds again.
"""

from __future__ import annotations

import errno
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta

from tieredbuf import keys
from tieredbuf.config import (
    DEFAULT_GC_GRACE_PERIOD,
    MAX_UPLOADS_IN_FLIGHT,
    RetryConfig,
)
from tieredbuf.errors import (
    CorruptError,
    FlushTimeoutError,
    PermanentStoreError,
    ProducerIdReusedError,
    RemoteUnconfirmedError,
    StageBufferMismatchError,
    StagedDataLossError,
)
from tieredbuf.format.announce import Announced
from tieredbuf.produce.fanin import hub_for
from tieredbuf.produce.publish import Pending, Publisher
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.runtime import forks
from tieredbuf.runtime.pools import started_pool
from tieredbuf.runtime.retry import RetryLog, StallWatch, backoff_delay
from tieredbuf.runtime.stats import Stats, ewma
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.segment_check import verify
from tieredbuf.stage.stage import Stage
from tieredbuf.store.base import LinkingStore, Store
from tieredbuf.store.base import manifest_writes_per_s as store_budget

log = logging.getLogger(__name__)

STREAMS = keys.STREAMS
_NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP})
"""A hard link's errnos that say the store cannot take links from this stage at all."""
POLL_INTERVAL = 0.01
"""How often the exporter looks for newly sealed segments when idle (seconds)."""
FAILURE_RETRY = RetryConfig(initial_backoff=timedelta(seconds=1), max_backoff=timedelta(seconds=60))
"""Retries after a permanent store error: slow, capped (someone has to fix something)."""


def describe_stage(stage: Stage) -> str:
    """What is still staged and where, for a timeout's message."""
    segs = stage.sealed_segments()
    n_bytes = sum(s.size for s in segs)
    return (
        f"{len(segs)} sealed segment(s), {n_bytes} bytes, still staged (LOCAL, safe on disk) "
        f"in {stage.path}; `tieredbuf drain {stage.path.parent} URL` exports them once the "
        f"store works"
    )


@dataclass(frozen=True, slots=True)
class Exported:
    """A segment that reached the queue: its per-core sequence runs and the entry found
    for it in the manifest (I10)."""

    stream: str
    sequences: tuple[tuple[int, int], ...]
    sequence: int
    location: str


class Exporter:
    """A background thread draining one stage into one buffer."""

    def __init__(
        self,
        stage: Stage,
        store: Store,
        queue: ManifestQueue,
        *,
        retry: RetryConfig | None = None,
        gc_grace_period: timedelta = DEFAULT_GC_GRACE_PERIOD,
        max_uploads_in_flight: int = MAX_UPLOADS_IN_FLIGHT,
        on_exported: Callable[[Exported], None] | None = None,
        on_error: Callable[[BaseException | None], None] | None = None,
        failure_retry: RetryConfig = FAILURE_RETRY,
        on_lost: Callable[[str, StagedDataLossError], None] | None = None,
        manifest_writes_per_s: float | None = None,
        before_export: Callable[[], None] | None = None,
        on_unconfirmed: Callable[[str, tuple[tuple[int, int], ...], RemoteUnconfirmedError], None]
        | None = None,
    ) -> None:
        """``on_error(e)`` is called when a permanent error stops exports and
        ``on_error(None)`` when they work again; ``on_lost(stream, e)`` when a sealed
        segment fails its CRC check and is quarantined instead of exported.
        ``manifest_writes_per_s``: the buffer's commit budget (:mod:`tieredbuf.produce.fanin`;
        0: unpaced; None: the store's, :func:`tieredbuf.store.base.manifest_writes_per_s`).
        ``before_export()`` before new segments are uploaded (it checks the stage belongs
        to this buffer: StageBufferMismatchError stops exports like a permanent store
        error).  ``on_unconfirmed(stream, sequences, e)`` when a segment's append cannot
        be confirmed REMOTE (:meth:`_committed`)."""
        self.stage = stage
        stage.expect_reader()  # it reads each segment soon after its seal
        self.retry = retry or RetryConfig()
        self.failure_retry = failure_retry
        self.stats = Stats()
        self.retry_log = RetryLog(log)
        self._guard = forks.ForkGuard("staged producer / exporter")
        self._stop = threading.Event()
        forks.stop_at_exit(self._stop)
        self._publishers = {
            stream: Publisher(
                store,
                keys.stream_producer_id(stage.producer_id, stream),
                retry=self.retry,
                stop=self._stop,
                stats=self.stats,
                retry_log=self.retry_log,
            )
            for stream in STREAMS
        }
        self._rate = store_budget(store) if manifest_writes_per_s is None else manifest_writes_per_s
        self._hub = hub_for(store, queue)
        self._hub_token = self._hub.attach(self._rate, gc_grace_period)
        self._uploads: dict[str, _Upload] = {}
        """Sealed segments whose upload started (by segment ULID), until appended."""
        self._round = 0
        self._wake = threading.Event()
        self.upload_s = 0.0
        """Recent upload time of a segment (EWMA, seconds)."""
        self._linking = isinstance(getattr(store, "inner", store), LinkingStore)
        """Hand sealed segments to the store as hard links (until one is refused)."""
        self._on_exported = on_exported
        self._on_error = on_error
        self._on_lost = on_lost
        self._on_unconfirmed = on_unconfirmed
        self._before_export = before_export
        self._last_transient: BaseException | None = None
        self._pool = started_pool(max_uploads_in_flight, "tb-export")
        self._max_inflight = max_uploads_in_flight
        self._cond = threading.Condition()
        self._idle = True
        self._error: BaseException | None = None
        self._resubmit_at = 0.0
        """Segments the hub failed go to it again from then on (backed off)."""
        self._hub_failures = 0
        self._thread = threading.Thread(target=self._run, name="tb-exporter", daemon=True)
        self._thread.start()

    # --- control -----------------------------------------------------------------

    def stall_watch(self, timeout: float | None = None) -> StallWatch:
        """A wait's own deadline when the caller gave none: the store failed and nothing
        was exported for ``retry.give_up_after``."""
        limit = self.retry.give_up_after
        return StallWatch(
            None if timeout is not None or limit is None else limit.total_seconds(),
            progress=lambda: self.stats.get("segments_exported"),
            failures=lambda: (
                self.stats.get("store_transient_retries") + self._hub.stats.get("hub_retries")
            ),
        )

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every sealed segment of the stage is exported and released.

        Raises the permanent store error that stopped exports (the data stays staged),
        or FlushTimeoutError saying what is still staged and where: when ``timeout`` runs
        out, or without one once the store has failed with nothing exported for
        ``retry.give_up_after`` (30 s by default; None: wait until it works).
        """
        self._guard.check()
        self._wake.set()
        watch = self.stall_watch(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not (
                ok := self._error is not None or (self._idle and not self.stage.sealed_segments())
            ):
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or watch.stalled():
                    break
                self._cond.wait(watch.next_check() if left is None else min(left, 1.0))
        if self._error is not None:
            raise self._error
        if not ok:
            last = self.last_transient_error
            why = f" (last error: {last})" if last is not None else ""
            within = (
                f"within {timeout} s"
                if timeout is not None
                else f"while the store kept failing for {watch.limit:g} s with nothing "
                "exported (RetryConfig.give_up_after; pass timeout= to wait longer)"
            )
            raise FlushTimeoutError(
                f"the stage was not exported {within}{why}: {describe_stage(self.stage)}"
            )

    def next_append_in(self) -> float:
        """Seconds until the buffer's next commit may take what is uploaded now (0: now)."""
        return self._hub.next_commit_in()

    def commit_health(self) -> str | None:
        """What keeps exports from their commits now (the fan-in hub's health), or None."""
        return self._hub.health()

    def wake(self) -> None:
        """Look at the stage now (a segment was just sealed for a REMOTE waiter)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._guard.forked:
            return  # the thread and the pool did not survive the fork
        self._thread.join()
        self._pool.shutdown(wait=True)
        self._hub.detach(self._hub_token)

    @property
    def manifest_writes_per_s(self) -> float:
        """The commit budget the exporter asks of the buffer's fan-in hub: the one it was
        given, else the store's."""
        return self._rate

    @property
    def error(self) -> BaseException | None:
        """The permanent store error that stops exports now (None: exports work)."""
        return self._error

    @property
    def last_transient_error(self) -> BaseException | None:
        """The last transient failure being retried (None: healthy)."""
        if self._last_transient is not None:
            return self._last_transient
        return next((p.last_error for p in self._publishers.values() if p.last_error), None)

    # --- the loop ------------------------------------------------------------------

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            try:
                worked, wait = self._export_ready()
            except (PermanentStoreError, StageBufferMismatchError, ProducerIdReusedError) as e:
                if self._stop.is_set():
                    return
                self.stats.incr("export_permanent_failures")
                self._fail(e)
                delay = backoff_delay(self.failure_retry, attempt)
                self.retry_log.failed("export (permanent store error)", e, delay, raised=True)
                self._stop.wait(delay)
                attempt += 1
                continue
            except Exception as e:  # a failure here must never skip a segment: retry
                if self._stop.is_set():
                    return
                self.stats.incr("export_retries")
                self.stats.incr("store_transient_retries")
                self._last_transient = e
                delay = backoff_delay(
                    self.failure_retry if self._error is not None else self.retry, attempt
                )
                self.retry_log.failed("export", e, delay)
                self._stop.wait(delay)
                attempt += 1
                continue
            if attempt:
                self.retry_log.recovered("export")
                self.retry_log.recovered("export (permanent store error)")
            attempt = 0
            self._last_transient = None
            if self._error is not None and not self.stage.sealed_segments():
                self._recover()  # nothing is left to export (an export clears it too)
            if not worked:
                with self._cond:
                    self._idle = True
                    self._cond.notify_all()
            if wait > 0:
                self._wake.wait(wait)
            self._wake.clear()

    def _fail(
        self,
        e: PermanentStoreError | StageBufferMismatchError | ProducerIdReusedError | CorruptError,
    ) -> None:
        first = self._error is None
        if first:
            e.add_note(f"Nothing is lost: {describe_stage(self.stage)}.")
            log.error(
                "export stopped by a permanent store error (the data stays staged; "
                "retrying slowly): %s",
                e,
                extra={"tb_raised": True},
            )
        with self._cond:
            self._error = e
            self._cond.notify_all()
        if first and self._on_error is not None:
            self._on_error(e)

    def _recover(self) -> None:
        log.warning("exports work again; the store error is cleared: %s", self._error)
        with self._cond:
            self._error = None
            self._cond.notify_all()
        if self._on_error is not None:
            self._on_error(None)

    def _export_ready(self) -> tuple[bool, float]:
        """One pass: start uploads for new sealed segments, hand what is uploaded to the
        fan-in hub.  Returns (busy, seconds to wait before the next pass)."""
        sealed = self.stage.sealed_segments()
        if self._uploads:  # a segment drop_oldest deleted: its object is GC's orphan
            live = {s.ulid for s in sealed}
            for ulid in [
                u for u, up in self._uploads.items() if u not in live and up.future.done()
            ]:
                del self._uploads[ulid]
        if not sealed and not self._uploads:
            return False, POLL_INTERVAL
        if sealed and self._before_export is not None:
            try:
                self._before_export()
            except PermanentStoreError:
                self.stats.incr("store_permanent_errors")
                raise
        with self._cond:
            self._idle = False
        self._start_uploads(sealed)
        for stream in STREAMS:
            order = sorted((s for s in sealed if s.stream == stream), key=lambda s: s.last_sequence)
            # the uploads started from the oldest segment on: never a gap (I2, I3).  What
            # is with the hub already goes first; then every done upload in order
            ready: list[_Upload] = []
            with self._cond:
                for seg in order:
                    up = self._uploads.get(seg.ulid)
                    if up is None or (not up.submitted and not up.future.done()):
                        break
                    if not up.submitted:
                        ready.append(up)
            for up in ready:
                if up.future.exception() is not None:
                    with self._cond:
                        del self._uploads[up.segment.ulid]  # uploaded again next pass
                    up.future.result()
            if ready and time.monotonic() >= self._resubmit_at:
                self._submit(stream, ready)
        return True, POLL_INTERVAL

    def _link_for(self, seg: SealedSegment) -> Callable[[str], None] | None:
        """How a local-directory store takes ``seg`` without a copy: a hard link of the
        sealed file (Stage.link_segment; see the module doc), or None (upload it)."""
        if not self._linking:
            return None

        def link(tmp: str) -> None:
            try:
                self.stage.link_segment(seg, tmp)
            except OSError as e:
                if e.errno in _NO_LINK:  # another file system, or no hard links there
                    self._linking = False
                raise

        return link

    def _start_uploads(self, sealed: list[SealedSegment]) -> None:
        """Start uploads, oldest segment first, up to ``max_uploads_in_flight`` running."""
        running = sum(1 for u in self._uploads.values() if not u.future.done())
        self._round += 1
        for seg in sealed:
            if running >= self._max_inflight:
                return
            if seg.ulid in self._uploads:
                continue
            if seg.ulid not in {s.ulid for s in self.stage.sealed_segments()}:
                continue  # exported and released since this pass listed the stage
            link = self._link_for(seg)
            if link is not None:
                # a store taking the file as a hard link needs its bytes only if the link
                # is refused (then ``reload`` reads them): check the file in place
                body, why = b"", self.stage.verify_segment(seg)
            else:
                body = self.stage.read_segment(seg)
                why = verify(seg, body)
            if why is not None:  # never upload bad bytes (I7); say loudly what is lost
                dest = self.stage.quarantine(seg, why)
                self.stats.incr("segments_quarantined")
                if self._on_lost is not None:
                    self._on_lost(seg.stream, StagedDataLossError(str(dest), seg.sequences, why))
                continue
            suffix = keys.SEGMENT_SUFFIX if seg.stream == "qseg" else keys.BATCH_SUFFIX
            p = Pending(
                body,
                suffix,
                seg.items,
                seg.last_sequence + 1,
                crc32=seg.crc32,
                reload=functools.partial(_read_verified, self.stage, seg),
                link=link,
            )
            p.size = seg.size
            fut = self._pool.submit(self._upload, seg.stream, p)
            with self._cond:
                self._uploads[seg.ulid] = _Upload(seg, p, fut, self._round)
            running += 1

    def _upload(self, stream: str, p: Pending) -> None:
        started = time.monotonic()
        self._publishers[stream].upload(p)
        took = time.monotonic() - started
        self.upload_s = ewma(self.upload_s, took)
        p.drop_body()  # it waits for its append on disk, not in memory
        self._wake.set()

    def _submit(self, stream: str, ready: list[_Upload]) -> None:
        """Hand every uploaded segment of ``stream`` to the hub, oldest first.  Append
        numbers (each segment's last per-core sequence + 1) increase with gaps; the
        commit skips those a watermark already covers (a regrouped export after a crash)."""
        with self._cond:
            for up in ready:
                up.submitted = True
        entries = [
            Announced(
                u.pending.producer_seq, u.pending.location, u.pending.size, u.pending.metadata
            )
            for u in ready
        ]
        self.stats.incr("groups_handed_over")
        self._hub.submit(
            self._publishers[stream].producer_id,
            entries,
            functools.partial(self._committed, stream, ready),
            functools.partial(self._reupload, stream, ready),
        )

    def _committed(
        self,
        stream: str,
        ready: list[_Upload],
        seqs: list[tuple[int, str]] | None,
        err: BaseException | None,
    ) -> None:
        """On the hub's thread: the segments' entries were found in the queue; release
        them.  A segment whose append cannot be confirmed (its writer's watermark covers
        it, its entry is unlinked already: RemoteUnconfirmedError) is released too -- the
        manifest holds it past its watermark, and exporting it again would append it
        twice -- and its waiters fail with that error."""
        if isinstance(err, RemoteUnconfirmedError):
            log.error(
                "export of %d segment(s) not confirmed REMOTE (released; their waiters "
                "are told): %s",
                len(ready),
                err,
            )
            for up in ready:
                self.stats.incr("segments_unconfirmed")
                if self._on_unconfirmed is not None:
                    self._on_unconfirmed(stream, up.segment.sequences, err)
                self._release(up)
            self._wake.set()
            return
        if err is not None or seqs is None:
            permanent = isinstance(err, PermanentStoreError | CorruptError)
            delay = backoff_delay(
                self.failure_retry if permanent else self.retry, self._hub_failures
            )
            self._hub_failures += 1
            with self._cond:
                self._resubmit_at = time.monotonic() + delay
                for up in ready:
                    up.submitted = False  # handed to the hub again, backed off
            if isinstance(err, PermanentStoreError | CorruptError):
                self._fail(err)
            else:
                log.error("export of %d segment(s) failed: %s", len(ready), err)
            self._wake.set()
            return
        self._hub_failures = 0
        if self._error is not None:
            self._recover()  # an export landed: exports work again
        for up, (seq, location) in zip(ready, seqs, strict=True):
            self.stats.incr("segments_exported")
            self.stats.incr("bytes_exported", up.pending.size)
            if self._on_exported is not None:  # first: a flush() sees the stage empty once
                self._on_exported(
                    Exported(
                        stream,
                        up.segment.sequences,
                        seq,  # released,
                        location,
                    )
                )  # and its handles say REMOTE
            self._release(up)
        self._wake.set()

    def _release(self, up: _Upload) -> None:
        self.stage.release(up.segment)
        with self._cond:  # only now: a pass that finds no upload of a segment finds it
            self._uploads.pop(up.segment.ulid, None)  # released, not sealed
            self._cond.notify_all()

    def _reupload(
        self, stream: str, ready: list[_Upload], entries: Sequence[Announced]
    ) -> list[Announced]:
        """The GC grace rule (on the hub's thread): upload these segments again under
        fresh keys; their bytes are read back from the stage."""
        by_seq = {u.pending.producer_seq: u.pending for u in ready}
        out = []
        for e in entries:
            p = by_seq.get(e.producer_seq)
            if p is None:
                out.append(e)
                continue
            self._publishers[stream].upload(p)
            p.drop_body()
            self.stats.incr("reuploads_for_grace")
            out.append(Announced(e.producer_seq, p.location, p.size, e.metadata))
        return out


@dataclass(eq=False, slots=True)
class _Upload:
    segment: SealedSegment
    pending: Pending
    future: Future[None]
    round: int
    """Uploads started by one pass share a round."""
    submitted: bool = False
    """Handed to the fan-in hub (released once its commit lands)."""


def _read_verified(stage: Stage, seg: SealedSegment) -> bytes:
    """A sealed segment's bytes read again (to upload it again), still checked (I7)."""
    body = stage.read_segment(seg)
    why = verify(seg, body)
    if why is not None:
        raise StagedDataLossError(str(seg.path), seg.sequences, why)
    return body
