"""The queue manifest as a CAS-written queue (RFC 0001), with exactly-once append.

Every write is a conditional PUT of the whole root: If-None-Match: * when the
manifest does not exist yet, If-Match: <etag> otherwise.  After *any* failed
write (conflict or unknown outcome) the queue re-reads the manifest and decides
from what it finds, never from the error alone (I2):

* append: the producer's watermark says whether its append already landed;
* initialize: the epoch owner says whether our epoch bump already landed;
* dequeue: the first sequence says whether our dequeue already landed.

Retries sleep a jittered, exponentially growing delay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tieredbuf.config import RetryConfig
from tieredbuf.errors import (
    ConflictError,
    FencedError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    StoreError,
    TieredBufError,
)
from tieredbuf.format import manifest as fm
from tieredbuf.keys import MANIFEST_KEY
from tieredbuf.queue.backoff import Stats, backoff_delay
from tieredbuf.store.base import IfMatch, PutMode, Store

WATERMARK_CAP = 16384
"""At most this many producer watermarks are kept (most recently active first)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One read of the manifest: its decoded view and the etag to CAS against."""

    view: fm.ManifestView
    etag: str | None

    @property
    def footer(self) -> fm.Footer:
        return self.view.footer

    def entries(self) -> list[fm.ManifestEntry]:
        return list(fm.iter_entries(self.view))


class ManifestQueue:
    """CAS operations on ``queue/manifest``; safe to share between threads."""

    def __init__(
        self,
        store: Store,
        *,
        key: str = MANIFEST_KEY,
        retry: RetryConfig | None = None,
        watermark_ttl_ms: int = 86_400_000,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        sleep: Callable[[float], None] = time.sleep,
        max_transient_retries: int | None = None,
    ) -> None:
        self.store = store
        self.key = key
        self.retry = retry or RetryConfig()
        self.watermark_ttl_ms = watermark_ttl_ms
        self.clock_ms = clock_ms
        self.sleep = sleep
        self.max_transient_retries = max_transient_retries
        self.stats = Stats()

    # --- reads -------------------------------------------------------------

    def read(self) -> Snapshot:
        """Read and decode the root (an absent manifest reads as empty)."""
        try:
            got = self.store.get(self.key)
        except ObjectNotFoundError:
            return Snapshot(fm.empty_manifest(), None)
        self.stats.incr("manifest_reads")
        return Snapshot(fm.open_manifest(got.data, obj=self.key), got.etag)

    def read_footer(self) -> fm.Footer:
        """Only the 22-byte footer (epoch, counts): one small ranged GET."""
        try:
            tail = self.store.get_suffix(self.key, fm.FOOTER_SIZE)
        except ObjectNotFoundError:
            return fm.empty_manifest().footer
        return fm.parse_footer(tail, obj=self.key)

    def check_epoch(self, epoch: int) -> fm.Footer:
        """Raise FencedError unless the manifest is still at ``epoch``."""
        footer = self.read_footer()
        if footer.epoch != epoch:
            raise FencedError(epoch, footer.epoch)
        return footer

    # --- the retry loop ----------------------------------------------------

    def _cas(self, snap: Snapshot, data: bytes) -> None:
        mode: PutMode = "create" if snap.etag is None else IfMatch(snap.etag)
        self.store.put(self.key, data, mode=mode)

    def _pause(self, attempt: int, why: str) -> None:
        self.stats.incr(why)
        self.stats.incr("retries")
        if self.max_transient_retries is not None and attempt >= self.max_transient_retries:
            raise TieredBufError(f"manifest operation gave up after {attempt} retries ({why})")
        self.sleep(backoff_delay(self.retry, attempt))

    def _attempt(self, snap: Snapshot, data: bytes, attempt: int) -> bool:
        """One CAS; True if it succeeded, False if the caller must re-read and decide."""
        try:
            self._cas(snap, data)
            return True
        except ConflictError:
            self._pause(attempt, "conflicts")
        except OutcomeUnknownError:
            self._pause(attempt, "unknown_outcomes")
        except StoreError:
            self._pause(attempt, "transient_errors")
        return False

    def _read_retrying(self, attempt: int) -> Snapshot:
        while True:
            try:
                return self.read()
            except StoreError:
                self._pause(attempt, "transient_errors")
                attempt += 1

    # --- append --------------------------------------------------------------

    def append(
        self,
        new: Sequence[fm.NewEntry],
        producer_id: str,
        last_producer_seq: int,
        *,
        before_write: Callable[[], None] | None = None,
    ) -> list[int | None]:
        """Append ``new`` exactly once; returns the sequence given to each entry.

        ``new[i]`` is the producer's append number ``last_producer_seq - len(new) + 1 + i``.
        Entries whose number the manifest's watermark already covers landed earlier (a
        retry after an unknown outcome, or a restart) and are not appended again; their
        sequence is known when the whole group landed together, else ``None``.
        ``before_write`` runs before every write and may raise to abort (GC grace race).
        """
        n = len(new)
        if n == 0:
            return []
        first_pseq = last_producer_seq - n + 1
        if first_pseq < 1:
            raise ValueError("producer sequence numbers start at 1")
        attempt = 0
        while True:
            snap = self._read_retrying(attempt)
            view = snap.view
            wm = view.watermarks.get(producer_id)
            done = 0 if wm is None else max(0, min(n, wm.producer_seq - first_pseq + 1))
            if done == n:
                assert wm is not None
                if attempt:
                    self.stats.incr("deduplicated_appends")
                last = wm.last_sequence - (wm.producer_seq - last_producer_seq)
                return list(range(last - n + 1, last + 1))
            if before_write is not None:
                before_write()
            todo = new[done:]
            now = self.clock_ms()
            wms = fm.prune_watermarks(view.watermarks, now, self.watermark_ttl_ms, WATERMARK_CAP)
            last_seq = view.footer.next_sequence + len(todo) - 1
            wms[producer_id] = fm.Watermark(producer_id, last_producer_seq, last_seq, now)
            data, first = fm.append(view, todo, wms)
            if self._attempt(snap, data, attempt):
                self.stats.incr("appends")
                self.stats.incr("entries_appended", len(todo))
                return [None] * done + list(range(first, first + len(todo)))
            attempt += 1

    # --- consumer operations ---------------------------------------------------

    def initialize(self, owner: str) -> int:
        """Bump the epoch (fencing every older consumer); returns the new epoch.

        ``owner`` must be unique to this call: it is how a retry recognises its own bump.
        """
        attempt = 0
        target: int | None = None
        while True:
            snap = self._read_retrying(attempt)
            if target is not None and snap.view.owner == owner and snap.footer.epoch == target:
                return target
            target = snap.footer.epoch + 1
            if self._attempt(snap, fm.with_epoch(snap.view, target, owner), attempt):
                self.stats.incr("epoch_bumps")
                return target
            attempt += 1

    def dequeue(self, through_sequence: int, epoch: int) -> None:
        """Remove entries with sequence <= ``through_sequence``; fenced by ``epoch``."""
        attempt = 0
        while True:
            snap = self._read_retrying(attempt)
            if snap.footer.epoch != epoch:
                raise FencedError(epoch, snap.footer.epoch)
            if snap.footer.first_sequence > through_sequence:
                return
            if self._attempt(snap, fm.dequeue(snap.view, through_sequence), attempt):
                self.stats.incr("dequeues")
                return
            attempt += 1
