"""The exporter: move sealed segments from a stage to the object store and the queue.

For every sealed segment, oldest first: read it, upload it as ``data/<ULID>.batch``
or ``.qseg`` (one create-if-absent PUT: obstore has no conditional multipart),
append it to the manifest
(uploads run in parallel, up to ``max_uploads_in_flight`` segments at a time;
then those segments are appended in ONE CAS, in sequence order: group commit),
and only then release them from the stage (delete the local files).

Exactly once across crashes (I2).  Each kind's segments are appended under the
producer id ``<stage producer id>.<kind>`` with the segment's last per-core
sequence + 1 as its append number.  Within one kind, segments seal one after another
and cover increasing sequences, and the stage never reuses a sequence (Quiver
#4024), so the numbers only grow: a segment that was appended but not released
before a crash is recognised by the manifest's watermark and released without a
second entry; a group regrouped after a restart appends only the segments whose
numbers the watermark does not cover yet.  Transient store errors are retried with
backoff, forever; a segment is never skipped.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

from tieredbuf import keys
from tieredbuf.config import RetryConfig
from tieredbuf.publish import Pending, Publisher
from tieredbuf.queue.backoff import Stats, backoff_delay
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.stage.segments import SealedSegment
from tieredbuf.stage.stage import Stage
from tieredbuf.store.base import Store

log = logging.getLogger(__name__)

KINDS = ("batch", "qseg")
POLL_INTERVAL = 0.01
"""How often the exporter looks for newly sealed segments when idle (seconds)."""


@dataclass(frozen=True, slots=True)
class Exported:
    """A segment that reached the queue: its per-core sequence runs and where it went."""

    kind: str
    sequences: tuple[tuple[int, int], ...]
    sequence: int | None
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
        gc_grace_period: timedelta = timedelta(minutes=10),
        max_uploads_in_flight: int = 4,
        on_exported: Callable[[Exported], None] | None = None,
    ) -> None:
        self.stage = stage
        self.retry = retry or RetryConfig()
        self.stats = Stats()
        self._stop = threading.Event()
        self._publishers = {
            kind: Publisher(
                store, queue, f"{stage.producer_id}.{kind}", retry=self.retry,
                gc_grace_period=gc_grace_period, stop=self._stop, stats=self.stats,
            )
            for kind in KINDS
        }
        self._on_exported = on_exported
        self._pool = ThreadPoolExecutor(max_uploads_in_flight, thread_name_prefix="tb-export")
        self._max_inflight = max_uploads_in_flight
        self._cond = threading.Condition()
        self._idle = True
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tb-exporter", daemon=True)
        self._thread.start()

    # --- control -----------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every sealed segment of the stage is exported and released."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._error is not None
                or (self._idle and not self.stage.sealed_segments()),
                timeout,
            )
        if self._error is not None:
            raise self._error
        if not ok:
            raise TimeoutError(f"exporter did not drain the stage in {timeout} s")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)

    @property
    def error(self) -> BaseException | None:
        return self._error

    # --- the loop ------------------------------------------------------------------

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            try:
                worked = self._export_ready()
                attempt = 0
            except Exception as e:  # a failure here must never skip a segment: retry
                if self._stop.is_set():
                    return
                self.stats.incr("export_retries")
                log.warning("export pass failed (retrying): %s", e)
                self._stop.wait(backoff_delay(self.retry, attempt))
                attempt += 1
                continue
            if not worked:
                with self._cond:
                    self._idle = True
                    self._cond.notify_all()
                self._stop.wait(POLL_INTERVAL)

    def _export_ready(self) -> bool:
        sealed = self.stage.sealed_segments()
        if not sealed:
            return False
        with self._cond:
            self._idle = False
        for kind in KINDS:
            segs = sorted((s for s in sealed if s.kind == kind), key=lambda s: s.last_sequence)
            for i in range(0, len(segs), self._max_inflight):
                self._export_group(kind, segs[i : i + self._max_inflight])
        return True

    def _export_group(self, kind: str, segs: list[SealedSegment]) -> None:
        pub = self._publishers[kind]
        suffix = keys.SEGMENT_SUFFIX if kind == "qseg" else keys.BATCH_SUFFIX
        pending = [
            Pending(seg.path.read_bytes(), suffix, seg.items, seg.last_sequence + 1)
            for seg in segs
        ]
        futures: list[Future[None]] = [self._pool.submit(pub.upload, p) for p in pending]
        for f in futures:
            f.result()
        # Group commit: every uploaded segment of this batch in one CAS.  Append numbers
        # (each segment's last per-core sequence + 1) increase with gaps; the manifest
        # skips those its watermark already covers (a regrouped retry after a crash).
        seqs = pub.append_increasing(pending)
        self.stats.incr("group_commits")
        for seg, p, seq in zip(segs, pending, seqs, strict=True):
            self.stats.incr("segments_exported")
            self.stats.incr("bytes_exported", len(p.body))
            self.stage.release(seg)
            if self._on_exported is not None:
                self._on_exported(Exported(kind, seg.sequences, seq, p.location))


class ExportTracker:
    """Maps per-core sequences to their REMOTE outcome, whichever arrives first.

    A LOCAL ack (the stage's future) and the export of the segment holding that
    sequence race: a segment can be sealed and exported before the WAL fsync that
    acks its entries returns.  Both sides meet here under one lock.
    """

    def __init__(self, remember: int = 256) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[tuple[str, int], Callable[[Exported], None]] = {}
        self._recent: dict[str, deque[Exported]] = {k: deque(maxlen=remember) for k in KINDS}
        self._through: dict[str, int] = dict.fromkeys(KINDS, -1)

    def exported(self, ex: Exported) -> None:
        fire = []
        with self._lock:
            self._recent[ex.kind].append(ex)
            self._through[ex.kind] = max(self._through[ex.kind], ex.sequences[-1][1])
            for lo, hi in ex.sequences:
                if hi - lo + 1 <= len(self._waiting):
                    for s in range(lo, hi + 1):
                        cb = self._waiting.pop((ex.kind, s), None)
                        if cb is not None:
                            fire.append(cb)
                else:
                    for key in [k for k in self._waiting if k[0] == ex.kind and lo <= k[1] <= hi]:
                        fire.append(self._waiting.pop(key))
        for cb in fire:
            cb(ex)

    def wait_for(self, kind: str, seq: int, cb: Callable[[Exported], None]) -> None:
        """Call ``cb`` when ``seq`` is exported (at once if it already is)."""
        with self._lock:
            if seq > self._through[kind]:
                self._waiting[(kind, seq)] = cb
                return
            hit = next(
                (e for e in self._recent[kind] if any(lo <= seq <= hi for lo, hi in e.sequences)),
                None,
            )
        cb(hit or Exported(kind, ((seq, seq),), None, ""))
