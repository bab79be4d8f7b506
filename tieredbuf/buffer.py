"""``tieredbuf.open(url)``: one buffer = one store root + its queue manifest."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, overload

from tieredbuf.client.producer import ServiceProducer
from tieredbuf.config import (
    ConsumerConfig,
    ProducerConfig,
    ServiceProducerConfig,
    TreeConfig,
    WorkerConfig,
)
from tieredbuf.consume.consumer import Consumer
from tieredbuf.consume.fetch import fetch_object
from tieredbuf.consume.reader import ContinuousReader, OnLost, Position, TreeReader
from tieredbuf.consume.worker import Worker
from tieredbuf.errors import ConfigError, DataLossError, ObjectNotFoundError
from tieredbuf.format import idem
from tieredbuf.format.manifest import ManifestEntry, RetentionPolicy
from tieredbuf.format.registry import check_name
from tieredbuf.keys import MANIFEST_KEY, QUEUE_PREFIX
from tieredbuf.produce.api import RecordProducer
from tieredbuf.produce.producer import Producer
from tieredbuf.produce.staged import StagedProducer, drain
from tieredbuf.queue import dedupe
from tieredbuf.queue.dedupe import Found
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot
from tieredbuf.queue.redrive import RedriveResult
from tieredbuf.queue.redrive import redrive as redrive_dead_letters
from tieredbuf.queue.subscribers import ProgressStore, SubscriberInfo, publish, remove
from tieredbuf.queue.subscribers import listing as subscriber_listing
from tieredbuf.queue.subscription import Subscription, open_subscription
from tieredbuf.store import open_store
from tieredbuf.store.azure import is_azure_url
from tieredbuf.store.base import Store
from tieredbuf.store.counting import MeteredStore, RequestCounts


def _build(cls: Any, kind: str, options: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ConfigError(f"unknown {kind} option(s) {unknown}; known: {sorted(names)}")
    return cls(**options)


class Buffer:
    """A tiered buffer rooted at one URL (``s3://``, ``file://``, ``memory://``)."""

    def __init__(self, store: Store, tree: TreeConfig | None = None) -> None:
        # every role of this buffer sends its requests through one meter (what S3 bills)
        self.store: MeteredStore = store if isinstance(store, MeteredStore) else MeteredStore(store)
        self.tree_config = tree or TreeConfig()
        self.queue = ManifestQueue(self.store, tree_config=self.tree_config)

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def requests(self) -> RequestCounts:
        """The store requests this process sent for this buffer, by operation and object
        kind (:mod:`tieredbuf.store.counting`), from every producer, consumer, reader and
        GC pass opened through it."""
        return self.store.counts

    @overload
    def producer(self, staging_dir: None = None, **config: Any) -> Producer: ...

    @overload
    def producer(self, staging_dir: str | Path, **config: Any) -> StagedProducer: ...

    def producer(self, staging_dir: str | Path | None = None, **config: Any) -> RecordProducer:
        """A producer.  ``staging_dir=None``: stateless (REMOTE acks only).

        Keyword arguments are :class:`ProducerConfig` fields (and, with a staging
        directory, the local tier's fields), e.g. ``flush_interval=timedelta(ms=100)``.
        Both kinds are a :class:`~tieredbuf.produce.api.RecordProducer`.
        """
        if staging_dir is None:
            return Producer(self.store, self.queue, _build(ProducerConfig, "producer", config))
        return StagedProducer(self.store, self.queue, Path(staging_dir), **config)

    def drain_stage(
        self,
        staging_dir: str | Path,
        producer_id: str,
        *,
        on_exported: Any = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Take over a (dead) producer's stage into this buffer: recover its WAL, seal,
        export, release (``tieredbuf drain``; :func:`tieredbuf.produce.staged.drain`)."""
        return drain(
            self.store,
            self.queue,
            Path(staging_dir),
            producer_id,
            on_exported=on_exported,
            timeout=timeout,
        )

    def consumer(self, subscriber: str = "default", **config: Any) -> Consumer:
        """A consumer of ``subscriber`` ("default": RFC 0001's consumer); call
        ``initialize()`` on it (that fences older instances of the same subscriber only).

        Keyword arguments are :class:`ConsumerConfig` fields (``dequeue_every``,
        ``read_ahead``, ``on_lost``, ...).
        """
        return Consumer(
            self.store, self.queue, _build(ConsumerConfig, "consumer", config), subscriber
        )

    def worker(self, subscriber: str, **config: Any) -> Worker:
        """A worker of the shared work queue ``subscriber``: ``claim()`` leases entries,
        ``ack`` / ``defer`` / ``reject`` resolve them (any order).  Keyword arguments are
        :class:`WorkerConfig` fields (``lease=timedelta(seconds=30)``, ``claim_batch``, ...)."""
        return Worker(self.store, self.queue, subscriber, _build(WorkerConfig, "worker", config))

    def subscription(self, subscriber: str = "default", **options: Any) -> Subscription:
        """A subscriber's position without reading data (e.g. a Spark driver):
        ``initialize`` / ``position`` / ``ack_through`` / ``flush``."""
        return open_subscription(self.queue, subscriber, **options)

    def subscribers(self) -> list[SubscriberInfo]:
        """Every registered subscriber: position, lag (entries, bytes, age), epoch, last
        activity, and for shared work queues their leases and rejected entries."""
        return subscriber_listing(self.queue)

    def remove_subscriber(self, name: str) -> bool:
        """Unregister ``name`` and release its hold on the buffer (its unacked entries may
        then be unlinked); live instances fail with SubscriberRemovedError.  False if it
        was not registered."""
        return remove(self.queue, check_name(name))

    def redrive(
        self, queue: str, sequences: Collection[int] | None = None, *, drop: bool = False
    ) -> RedriveResult:
        """Send the dead letters ``sequences`` (all when None) of the work queue ``queue``
        back: claimable again at once, delivery count reset (SQS's dead-letter redrive).
        ``drop=True`` instead lets the buffer unlink their entries (they stay listed).
        Dead letters whose entries retention already unlinked are reported, not redriven."""
        return redrive_dead_letters(self.queue, check_name(queue), sequences, drop=drop)

    def publish_subscribers(self) -> int:
        """Copy every named subscriber's position from its progress object into the root
        (one CAS, only if one moved): what a cron GC does for subscribers gone quiet.
        Returns the head afterwards."""
        return publish(self.queue, ProgressStore(self.queue))

    def exists(self) -> bool:
        """True when a buffer lives at this URL (its ``queue/manifest`` exists); one HEAD."""
        try:
            self.store.head(MANIFEST_KEY)
        except ObjectNotFoundError:
            return False
        return True

    def check_store(self) -> None:
        """Check that this buffer's store works now: one LIST under ``queue/`` (a missing
        buffer is fine).  Raises the permanent error that would stop every export --
        BucketNotFoundError, CredentialsError, AccessDeniedError: a HEAD answers a
        missing bucket and a wrong key without a body, a LIST names them -- or a
        transient StoreError (unreachable, 5xx)."""
        listing = self.store.list(QUEUE_PREFIX)
        try:
            next(iter(listing), None)
        finally:
            close = getattr(listing, "close", None)
            if close is not None:
                close()

    def create(self) -> bool:
        """Create an empty buffer here if there is none (producers also create it on their
        first append; consumers and workers never do).  True if this call created it."""
        return self.queue.create()

    def snapshot(self) -> Snapshot:
        """One read of the queue manifest (no fencing; read-only)."""
        return self.queue.read()

    def entries(self) -> list[ManifestEntry]:
        return self.snapshot().entries()

    def find_keyed(self, key: str) -> Found | None:
        """The entry holding a produce() call made with idempotency ``key``, among the
        linked entries since the key's time (one root read; :mod:`tieredbuf.queue.dedupe`),
        or None."""
        d = idem.digest(key)
        got = dedupe.find(self.snapshot(), {d: idem.key_ms(key)}, self.queue.clock_ms())
        return got.get(d)

    def lookup_sequence(self, seq: int, *, on_lost: OnLost = "raise") -> Position:
        """Find entry ``seq`` (one GET per tree level; see :mod:`tieredbuf.consume.reader`)."""
        return TreeReader(self.queue).lookup_sequence(seq, on_lost=on_lost)

    def lookup_time(self, time_ms: int, *, on_lost: OnLost = "raise") -> Position:
        """Find the first entry ingested at or after ``time_ms`` (ms since the epoch)."""
        return TreeReader(self.queue).lookup_time(time_ms, on_lost=on_lost)

    def reader(
        self,
        *,
        start_sequence: int | None = None,
        start_time_ms: int | None = None,
        on_lost: OnLost = "raise",
    ) -> ContinuousReader:
        """A read-only reader streaming retained history, then the live tail (no fencing).

        With neither start given it starts at the first retained sequence.
        """
        return ContinuousReader(
            self.queue,
            start_sequence=start_sequence,
            start_time_ms=start_time_ms,
            on_lost=on_lost,
        )

    def apply_retention(self) -> None:
        """Apply the root's retention policy now (it also runs inside every append and dequeue)."""
        self.queue.apply_retention()

    def set_retention(
        self, *, max_age: timedelta | None = None, max_bytes: int | None = None
    ) -> RetentionPolicy:
        """Store the retention policy in the root (one CAS); every writer then applies it.

        Acked history stays readable until it is older than ``max_age`` or while the
        linked data exceeds ``max_bytes``.  Both None: no retention (acked history is
        unlinked as it is dequeued).  The stored policy wins over any writer's TreeConfig.
        """
        return self.queue.set_retention(max_age, max_bytes)

    def set_gc_grace_period(self, grace: timedelta, *, force: bool = False) -> timedelta:
        """Store the buffer's GC grace period in the root (one CAS; 10 minutes until set).

        GC and every writer read it from the root, so they cannot disagree: GC keeps an
        unreferenced object younger than it, a writer re-uploads (or copies) an object
        older than half of it before enqueueing it.  Values under twice the tree's
        ``link_deadline`` (4 minutes by default) are refused unless ``force``.
        """
        return self.queue.set_gc_grace_period(grace, force=force)

    @property
    def gc_grace_period(self) -> timedelta | None:
        """The root's GC grace period (one read; None: the root records none yet)."""
        ms = self.snapshot().gc_grace_ms
        return None if ms is None else timedelta(milliseconds=ms)

    @property
    def retention(self) -> RetentionPolicy | None:
        """The root's retention policy (one read; None: never set, no retention)."""
        return self.snapshot().retention

    def read_object(self, entry: ManifestEntry, size: int | None = None) -> bytes:
        """The data object an entry points at, checked against what the manifest recorded
        (``size``: the recorded size, as ``reader().poll_sized()`` gives it; None looks it
        up, one root read).  A missing object is DataLossError; one of another size, or a
        ``.qseg`` failing its CRC, is CorruptError (DamagedObjectError): never served."""
        if size is None:
            size = self.recorded_size(entry)
        return fetch_object(self.store, entry, size)

    def recorded_size(self, entry: ManifestEntry) -> int:
        """The size the manifest recorded for ``entry``'s data object (0: none recorded);
        DataLossError when the manifest no longer links it (one root read, and one GET per
        tree level below it)."""
        for e, size in self.snapshot().iter_sized_from(entry.sequence):
            if e.sequence == entry.sequence and e.location == entry.location:
                return size
            break
        raise DataLossError(
            f"sequence {entry.sequence} ({entry.location}) is not linked by the manifest of "
            f"{self.url} (dequeued, or unlinked by retention): no size recorded to check"
        )

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open(url: str, *, tree: TreeConfig | None = None, **options: Any) -> Buffer:
    """Open the buffer at ``url``; ``options`` are store options (endpoint, region, ...).

    ``tree`` sets the manifest tree's branching factor; its retention fields seed the
    root's retention policy in this buffer's first write if the root has none (the
    root's stored policy is authoritative: see :meth:`Buffer.set_retention`).
    """
    if is_service_url(url):
        raise ConfigError(
            f"{url} is not a store URL: an http(s)://host:port URL is a `tieredbuf serve` "
            f"endpoint; write to it with tieredbuf.service_producer({url!r}), and open the "
            "buffer's own store URL (s3://, az://, file://) to read it"
        )
    return Buffer(open_store(url, **options), tree)


def is_service_url(url: str) -> bool:
    """Whether ``url`` names a ``tieredbuf serve`` endpoint (``http://``, ``https://``
    that is not an Azure Blob account URL; a comma list of them) rather than a store."""
    scheme = url.partition("://")[0].lower()
    return scheme in ("http", "https") and not is_azure_url(url)


def service_producer(urls: str | Sequence[str], **config: Any) -> ServiceProducer:
    """A producer that writes through ``tieredbuf serve``: the twin of
    :meth:`Buffer.producer` for a buffer behind the service.

    ``urls``: ``"http://host:8080"``, several instances of the service on one buffer as
    ``"http://host1:8080,host2:8080"`` (or a list), or one load-balanced address;
    ``https://`` for TLS.  Keyword arguments are :class:`ServiceProducerConfig` fields:
    ``flush_interval``, ``max_in_flight``, ``token`` / ``token_file``, ``ca_file``, ...
    ``produce()`` gives a WriteHandle that reaches REMOTE with the entry the service
    put the records in (docs/operations.md, "The client")."""
    return ServiceProducer(urls, _build(ServiceProducerConfig, "service producer", config))


__all__ = ["Buffer", "is_service_url", "open", "service_producer"]
