"""Upload data objects, exactly once each (create-if-absent under a fresh ULID).

Shared by the stateless producer and the exporter of the local tier; both hand what
they uploaded to the fan-in hub (:mod:`tieredbuf.produce.fanin`), which appends it.
A retried upload that meets its own object (its response was lost) is recognised: a
fresh ULID carries 80 random bits.  An object that waited for its commit past half
the GC grace period is uploaded again under a fresh ULID before it is appended (the
RFC's GC race; I5), by the hub through :meth:`Publisher.upload`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import RetryConfig
from tieredbuf.errors import AlreadyExistsError, PermanentStoreError, StoreError
from tieredbuf.format.manifest import MetadataItem
from tieredbuf.runtime.retry import RetryLog, backoff_delay
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import LinkingStore, Store, put_with_checksum

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Pending:
    """One data object on its way to the queue."""

    body: bytes
    suffix: str
    metadata: tuple[MetadataItem, ...]
    producer_seq: int
    ulid: ULID | None = None
    crc32: int | None = None
    """The body's CRC32, kept beside the object where the store can (KeepsChecksums):
    readers refuse an object whose bytes no longer match it (a ``.batch``; None: none)."""
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


class Publisher:
    """Uploads of one producer id (any thread)."""

    def __init__(
        self,
        store: Store,
        producer_id: str,
        *,
        retry: RetryConfig,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        stop: threading.Event | None = None,
        stats: Stats | None = None,
        retry_log: RetryLog | None = None,
    ) -> None:
        self.store = store
        self.producer_id = producer_id
        self.retry = retry
        self.clock_ms = clock_ms
        self.stop = stop or threading.Event()
        self.stats = stats or Stats()
        self.retry_log = retry_log or RetryLog(log)
        self.last_error: BaseException | None = None
        """The last transient upload failure, until an upload succeeds."""

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
                        self.store.put_link(p.location, p.link, crc32=p.crc32)
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
                    put_with_checksum(self.store, p.location, p.body, p.crc32, mode="create")
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
