"""Upload data objects and append them to the queue, exactly once.

Shared by the stateless producer and the exporter of the local tier.  Two races
are closed here:

* I2 -- an append whose outcome is unknown is retried through the manifest's
  per-producer watermark (see :mod:`tieredbuf.queue.manifest_queue`).
* The RFC's GC race -- an object uploaded long ago may already look like garbage
  to GC (older than the grace period, not referenced).  Before every manifest
  write, any object older than half the grace period is uploaded again under a
  fresh ULID, so an entry never points at an object GC may have deleted (I5).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import RetryConfig
from tieredbuf.errors import AlreadyExistsError, PermanentStoreError, StoreError
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.queue.manifest_queue import LostCas, ManifestQueue, Snapshot
from tieredbuf.runtime.retry import RetryLog, backoff_delay, retry_turn, stop_on
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import LinkingStore, Store

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Pending:
    """One data object on its way to the queue."""

    body: bytes
    suffix: str
    metadata: tuple[MetadataItem, ...]
    producer_seq: int
    ulid: ULID | None = None
    reload: Callable[[], bytes] | None = None
    """Reads the body again after :meth:`drop_body` (the exporter's segments stay on disk
    until appended), for an upload again under a fresh ULID (the GC grace race)."""
    size: int = field(init=False)
    """The body's length in bytes (kept when the body is dropped)."""

    def __post_init__(self) -> None:
        self.size = len(self.body)

    def drop_body(self) -> None:
        """Free the uploaded body while the append waits; it can be reloaded."""
        if self.reload is not None:
            self.body = b""
    link: Callable[[str], None] | None = None
    """For a store that can take a hard link (LinkingStore): creates the object's bytes
    at a temp path as a second name of a durable, immutable local file (the exporter's
    sealed segment), instead of uploading ``body``.  Set to None after it failed."""

    @property
    def location(self) -> str:
        assert self.ulid is not None, "not uploaded"
        return keys.data_key(self.ulid, self.suffix)


class _Stale(Exception):
    def __init__(self, stale: list[Pending]) -> None:
        super().__init__(f"{len(stale)} objects older than half the grace period")
        self.stale = stale


class Publisher:
    """Uploads and appends for one producer id; appends must come from one thread."""

    def __init__(
        self,
        store: Store,
        queue: ManifestQueue,
        producer_id: str,
        *,
        retry: RetryConfig,
        gc_grace_period: timedelta,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        stop: threading.Event | None = None,
        stats: Stats | None = None,
        retry_log: RetryLog | None = None,
    ) -> None:
        self.store = store
        self.queue = queue
        self.producer_id = producer_id
        self.retry = retry
        self.max_age_ms = int(gc_grace_period.total_seconds() * 1000) // 2
        self.clock_ms = clock_ms
        self.stop = stop or threading.Event()
        self.stats = stats or Stats()
        self.retry_log = retry_log or RetryLog(log)
        self.last_error: BaseException | None = None
        """The last transient upload failure, until an upload succeeds."""
        self.between_attempts: Callable[[], None] = lambda: None
        """Runs after an append's retry sleep, before it reads the root again (after a
        lost CAS): a paced writer waits for its slot there (backoff.retry_turn)."""
        self.optimistic: Callable[[], bool] = lambda: False
        """True when this writer believes it is the buffer's only one appending: its next
        append then CASes against the root it last wrote, without reading it first."""

    def _new_ulid(self) -> ULID:
        return ULID.from_timestamp(self.clock_ms() / 1000)

    def upload(self, p: Pending) -> None:
        """PUT ``p`` under a fresh ULID (create-if-absent), retrying transient errors."""
        p.ulid = self._new_ulid()
        if not p.body and p.reload is not None and p.link is None:
            p.body = p.reload()
        attempt = 0
        started = time.perf_counter_ns()
        while True:
            try:
                # One conditional PUT whatever the size: obstore 0.12.1 has no conditional
                # multipart (ObjStore.put_multipart turns any non-overwrite mode into one
                # PUT of b"".join(chunks), a full copy of a 32 MiB body with the GIL held),
                # and S3 takes up to 5 GiB in one PUT.  put_multipart stays in the Store
                # API for unconditional streaming; no upload here needs it today.
                if p.link is not None and isinstance(self.store, LinkingStore):
                    try:
                        self.store.put_link(p.location, p.link)
                    except OSError as e:
                        if isinstance(e, StoreError):
                            raise
                        # the link itself failed (EXDEV: another file system): upload
                        log.info("%s: no hard link (%s); uploading its bytes", p.location, e)
                        p.link = None
                        if not p.body and p.reload is not None:
                            p.body = p.reload()
                        continue
                    self.stats.incr("objects_linked")
                else:
                    self.store.put(p.location, p.body, mode="create")
                break
            except AlreadyExistsError:
                # A fresh ULID carries 80 random bits: the object is our own earlier
                # attempt whose response was lost.
                break
            except PermanentStoreError:
                self.stats.incr("store_permanent_errors")
                raise  # credentials, access, bucket: a retry cannot help; the caller decides
            except StoreError as e:
                self.stats.incr("upload_retries")
                self.stats.incr("store_transient_retries")
                self.last_error = e
                delay = backoff_delay(self.retry, attempt)
                self.retry_log.failed("upload of a data object", e, delay)
                if self.stop.wait(delay):
                    raise
                attempt += 1
        if attempt:
            self.last_error = None
            self.retry_log.recovered("upload of a data object")
        self.stats.incr("objects_uploaded")
        self.stats.incr("bytes_uploaded", p.size)
        self.stats.incr("upload_ns", time.perf_counter_ns() - started)

    def _check_fresh(self, group: Sequence[Pending], snap: Snapshot) -> None:
        # the root's grace period when it records one (GC reads the same), else our config
        root_grace = snap.gc_grace_ms
        max_age = self.max_age_ms if root_grace is None else root_grace // 2
        now = self.clock_ms()
        stale = [
            p for p in group if p.ulid is not None and now - p.ulid.milliseconds > max_age
        ]
        if stale:
            raise _Stale(stale)

    def append(
        self, group: Sequence[Pending], more: Callable[[], Sequence[Pending]] | None = None,
    ) -> list[int | None]:
        """Append ``group`` (uploaded, consecutive producer_seq) in one CAS, exactly once.

        ``more``: after a lost CAS (and the wait for this writer's turn), returns the
        objects uploaded meanwhile (next in producer_seq): the retry carries them too,
        so the lost CAS costs no extra append later.  The result then has one sequence
        per object of ``group`` and of every ``more()``, in order."""
        if not group:
            return []
        for a, b in itertools.pairwise(group):
            if b.producer_seq != a.producer_seq + 1:
                raise ValueError("a group's producer sequence numbers must be consecutive")
        return self._append(group, explicit=False, more=more)

    def append_increasing(
        self, group: Sequence[Pending], more: Callable[[], Sequence[Pending]] | None = None,
    ) -> list[int | None]:
        """Append ``group`` (uploaded, strictly increasing producer_seq, gaps allowed) in one
        CAS, exactly once (group commit).

        Numbers the producer's watermark already covers landed before (a retry, or a
        regrouped retry after a restart) and are skipped; their sequences are recovered
        when the whole group landed together, else ``None``.  ``more`` as in :meth:`append`
        (the objects it returns have higher numbers).
        """
        if not group:
            return []
        for a, b in itertools.pairwise(group):
            if b.producer_seq <= a.producer_seq:
                raise ValueError("a group's producer sequence numbers must strictly increase")
        return self._append(group, explicit=True, more=more)

    def _append(self, group: Sequence[Pending], *, explicit: bool,
                more: Callable[[], Sequence[Pending]] | None = None) -> list[int | None]:
        group = list(group)
        attempt = 0
        while True:
            seqs = [p.producer_seq for p in group] if explicit else None
            entries = [NewEntry(p.location, p.metadata, p.size) for p in group]
            try:
                with stop_on(self.stop), retry_turn(self.between_attempts):
                    return self.queue.append(
                        entries, self.producer_id, group[-1].producer_seq,
                        before_write=functools.partial(self._check_fresh, group),
                        producer_seqs=seqs, optimistic=self.optimistic(),
                        regroup=more is not None, first_attempt=attempt,
                    )
            except LostCas as lost:
                attempt = lost.attempt
                assert more is not None
                extra = list(more())
                for a, b in itertools.pairwise([group[-1], *extra]):
                    if (b.producer_seq <= a.producer_seq if explicit
                            else b.producer_seq != a.producer_seq + 1):
                        raise ValueError(
                            "more() must return the next producer sequence numbers") from None
                if extra:
                    self.stats.incr("regrouped_appends")
                    self.stats.incr("objects_regrouped", len(extra))
                group.extend(extra)
            except _Stale as s:
                for p in s.stale:
                    self.stats.incr("reuploads_for_grace")
                    log.warning(
                        "%s waited past half the GC grace period; uploading it again", p.location
                    )
                    self.upload(p)
