"""The tiered producer: stage locally (LOCAL acks), export in the background (REMOTE).

``buf.producer(staging_dir="./stage")`` gives one of these.  ``produce()`` and
``ingest()`` append to the stage's WAL and open segments and return a
:class:`WriteHandle` that reaches LOCAL once the bytes are fdatasynced (or, in
``segment_only`` durability, once their segment is sealed) and REMOTE once the
segment holding them is in the queue.  ``close()`` seals, exports and waits
until the stage is empty, so the node can go away (Danube's seal).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from tieredbuf import keys
from tieredbuf.config import (
    MAX_UPLOADS_IN_FLIGHT,
    ProducerConfig,
    RetryConfig,
    SegmentConfig,
    StageConfig,
    WalConfig,
)
from tieredbuf.errors import (
    ClosedError,
    ConfigError,
    DiskError,
    DiskFullError,
    FlushTimeoutError,
    TieredBufError,
)
from tieredbuf.produce.export_tracker import ExportTracker
from tieredbuf.produce.exporter import FAILURE_RETRY, Exported, Exporter
from tieredbuf.produce.handles import (
    Durability,
    DurabilityWatcher,
    GiveUp,
    RemoteOutcome,
    WriteHandle,
    WriteOutcome,
)
from tieredbuf.produce.producer import as_records, keyed_metadata
from tieredbuf.produce.prompt_seal import PromptSealer
from tieredbuf.produce.stage_binding import StageBinding, bind
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.runtime.forks import ForkGuard
from tieredbuf.stage.append_item import StageAck
from tieredbuf.stage.stage import Stage
from tieredbuf.store.base import Store

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import pyarrow as pa


_EXPORTER_FIELDS = {
    "gc_grace_period",
    "retry",
    "max_uploads_in_flight",
    "producer_id",
    "failure_retry",
    "manifest_writes_per_s",
}


def _field_names(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def split_config(options: dict[str, Any]) -> tuple[StageConfig, dict[str, Any]]:
    """Route keyword options to the stage, WAL, segment and exporter settings."""
    stage_kw: dict[str, Any] = {}
    wal_kw: dict[str, Any] = {}
    seg_kw: dict[str, Any] = {}
    exp_kw: dict[str, Any] = {}
    stage_f, wal_f, seg_f = (
        _field_names(StageConfig) - {"wal", "segment"},
        _field_names(WalConfig),
        _field_names(SegmentConfig),
    )
    for k, v in options.items():
        if k in stage_f or k in ("wal", "segment"):
            stage_kw[k] = v
        elif k in wal_f:
            wal_kw[k] = v
        elif k in seg_f:
            seg_kw[k] = v
        elif k in _EXPORTER_FIELDS:
            exp_kw[k] = v
        else:
            known = sorted(stage_f | wal_f | seg_f | _EXPORTER_FIELDS)
            raise ConfigError(f"unknown staged producer option {k!r}; known: {known}")
    if wal_kw:
        stage_kw["wal"] = dataclasses.replace(stage_kw.get("wal", WalConfig()), **wal_kw)
    if seg_kw:
        stage_kw["segment"] = dataclasses.replace(
            stage_kw.get("segment", SegmentConfig()), **seg_kw
        )
    return StageConfig(**stage_kw), exp_kw


class StagedProducer:
    """A producer with a local tier; one per process per staging directory."""

    def __init__(
        self, store: Store, queue: ManifestQueue, staging_dir: Path, **options: Any
    ) -> None:
        stage_config, exp = split_config(options)
        defaults = ProducerConfig()
        self.stage = Stage(staging_dir, exp.get("producer_id"), stage_config)
        self.producer_id = self.stage.producer_id
        self._tracker = ExportTracker()
        self._lock = threading.Lock()
        self._closed = False
        self._guard = ForkGuard("staged producer")
        try:
            self.binding = bind(self.stage, queue)  # before anything can be exported
            self.exporter = Exporter(
                self.stage,
                store,
                queue,
                before_export=self.binding.before_export,
                retry=exp.get("retry", defaults.retry),
                gc_grace_period=exp.get("gc_grace_period", defaults.gc_grace_period),
                max_uploads_in_flight=exp.get("max_uploads_in_flight", MAX_UPLOADS_IN_FLIGHT),
                on_exported=self._tracker.exported,
                on_error=self._tracker.fail,
                on_lost=self._tracker.lost,
                on_unconfirmed=self._tracker.unconfirmed,
                failure_retry=exp.get("failure_retry", FAILURE_RETRY),
                manifest_writes_per_s=exp.get(
                    "manifest_writes_per_s", defaults.manifest_writes_per_s
                ),
            )
        except BaseException:
            self.stage.close()
            raise
        self._prompt = PromptSealer(self.stage, self.exporter)
        self._give_up = GiveUp(self.exporter.stall_watch, self._wait_gave_up)

    @property
    def stats(self) -> dict[str, Any]:
        fsyncs, fsync_ns = self.stage.wal_sync_stats()
        return {
            **self.exporter.stats.snapshot(),
            **dataclasses.asdict(self.stage.stats),
            "wal_fsyncs": fsyncs,
            "wal_fsync_ns": fsync_ns,
            "stage_disk_bytes": self.stage.disk_bytes(),
            "sealed_segments_pending": len(self.stage.sealed_segments()),
            "export_failing": int(self.exporter.error is not None),
            "prompt_seals": self._prompt.seals,
            "quarantined_segments": len(self.stage.quarantined()),
        }

    def commit_health(self) -> str | None:
        """What keeps this producer's exports from their commits now (a committer whose
        clock is too far ahead, docs/architecture.md "Clocks"), or None."""
        return self.exporter.commit_health()

    def disk_fault(self) -> DiskError | None:
        """The stage's current disk error (None while its disk works): readiness."""
        return self.stage.disk_fault()

    def _wait_gave_up(self, durability: Durability) -> BaseException:
        """What a write's REMOTE wait without timeout raises once the store stalled."""
        limit = self.exporter.retry.give_up_after
        secs = 0.0 if limit is None else limit.total_seconds()
        last = self.exporter.last_transient_error
        return FlushTimeoutError(
            f"write not {durability.name}: the store kept failing for {secs:g} s with "
            f"nothing exported (RetryConfig.give_up_after; pass timeout= to wait longer); "
            f"it stays staged (LOCAL) and is still exported"
            + (f" (last error: {last})" if last is not None else "")
        )

    def _check_open(self) -> None:
        """Writes are accepted while the store fails (permanently or not): they are LOCAL
        and stay staged; only their REMOTE waits fail (and size_cap still applies)."""
        self._guard.check()
        if self._closed:
            raise ClosedError("producer is closed")

    def _handle(self, stream: str, fut: Future[StageAck]) -> WriteHandle:
        # the first wait for REMOTE asks for a prompt seal (tieredbuf/produce/prompt_seal.py)
        return WriteHandle(_StagedWatcher(fut, stream, self, self._prompt.request))

    def _follow(self, w: DurabilityWatcher, stream: str, fut: Future[StageAck]) -> None:
        """Push the write's LOCAL ack and then its export into ``w`` as they happen."""

        def remote(ex: Exported) -> None:
            w.reach(Durability.REMOTE, RemoteOutcome(ex.sequence, ex.location))

        def local(f: Future[StageAck]) -> None:
            err = f.exception()
            if err is not None:
                w.fail(err)
                return
            w.reach(Durability.LOCAL)
            self._tracker.wait_for(stream, f.result().sequence, remote, w.fail)

        fut.add_done_callback(local)

    def produce(
        self,
        entries: object,
        metadata: bytes = b"",
        *,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        fingerprint: bytes | None = None,
    ) -> WriteHandle:
        """Stage one call's records; LOCAL after fdatasync, REMOTE once in the queue.
        ``idempotency_key``: as :meth:`Producer.produce`."""
        records = as_records(entries)
        meta = keyed_metadata(records, bytes(metadata), idempotency_key, fingerprint)
        self._check_open()
        return self._handle("batch", self.stage.append_records(records, meta, timeout))

    def ingest(
        self, bundle: Mapping[int, pa.RecordBatch], *, timeout: float | None = None
    ) -> WriteHandle:
        """Stage one Arrow bundle (slot id -> RecordBatch)."""
        if not isinstance(bundle, Mapping) or not bundle:
            raise TypeError("ingest() takes a non-empty mapping of slot id -> pyarrow.RecordBatch")
        self._check_open()
        return self._handle("qseg", self.stage.append_bundle(bundle, timeout))

    def flush(self, timeout: float | None = None) -> None:
        """Seal what is open and wait until the stage is exported.

        Raises the permanent store error that stops exports, or FlushTimeoutError naming
        what is still staged and where; either way the data stays staged (LOCAL)."""
        self._guard.check()
        self._seal_all(timeout)
        self.exporter.drain(timeout)

    def _seal_all(self, timeout: float | None) -> None:
        """Seal what is open; on a full disk, wait for the exporter to free space (up to
        ``timeout``, else the retry's ``give_up_after``), as an append at a cap does."""
        limit = self.exporter.retry.give_up_after
        wait = timeout if timeout is not None else (limit.total_seconds() if limit else None)
        deadline = None if wait is None else time.monotonic() + wait
        pause = threading.Event()
        delay = 0.01
        while True:
            try:
                self.stage.seal_all()
                return
            except DiskFullError:
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise
            self.exporter.wake()
            pause.wait(delay)  # a retry's backoff while the exporter releases segments
            delay = min(delay * 2, 1.0)

    def close(self, timeout: float | None = None) -> None:
        """Seal, export and wait until the stage is empty; then release it.

        On a store error or a timeout it raises as :meth:`flush` does, after releasing
        the stage: what was not exported stays in the staging directory, for the next
        start or ``tieredbuf drain``."""
        self._guard.check()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._prompt.close()
            self._seal_all(timeout)
            self.exporter.drain(timeout)
            record_buffer_id(self.binding)
        finally:
            self.exporter.stop()
            self.stage.close()

    def __enter__(self) -> StagedProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StagedWatcher(DurabilityWatcher):
    """A staged write's watcher, wired to its stage future and to the export tracker
    only when someone asks for more than LOCAL (a REMOTE wait, ``when``, ``level``,
    ``result``).  Most calls are only waited for LOCAL, or not at all: they then cost
    no callback on the WAL's flusher thread and no entry in the tracker -- with four
    producer threads at 1 KiB records that wiring was ~20 % of the producer's Python
    time (docs/architecture.md).  Once wired it behaves as any watcher."""

    __slots__ = ("_fut", "_kind", "_producer")

    def __init__(
        self, fut: Future[StageAck], stream: str, producer: StagedProducer, on_remote_wait: Any
    ) -> None:
        super().__init__(on_remote_wait, producer._give_up)
        self._fut = fut
        self._kind = stream
        self._producer: StagedProducer | None = producer
        """Set until the watcher is wired (then None)."""

    def _wire(self) -> None:
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is not None:
            producer._follow(self, self._kind, self._fut)

    @overload
    def wait(
        self, durability: Literal[Durability.REMOTE] = ..., timeout: float | None = None
    ) -> RemoteOutcome: ...

    @overload
    def wait(self, durability: Durability, timeout: float | None = None) -> WriteOutcome: ...

    def wait(
        self, durability: Durability = Durability.REMOTE, timeout: float | None = None
    ) -> WriteOutcome:
        producer = self._producer
        if durability <= Durability.LOCAL and producer is not None:
            try:
                ack = self._fut.result(timeout)  # raises the write's failure as is
            except TimeoutError:
                raise TimeoutError(f"write not {durability.name} after {timeout} s") from None
            if ack.sequence > producer._tracker.exported_through(self._kind):
                return WriteOutcome(None, None, Durability.LOCAL)
        self._wire()  # exported already (its outcome is REMOTE), or more than LOCAL
        return super().wait(durability, timeout)

    await_durable = wait

    def when(self, durability: Durability, fn: Any) -> None:
        self._wire()
        super().when(durability, fn)

    @property
    def level(self) -> Durability | None:
        self._wire()
        return super().level

    def result(self) -> RemoteOutcome | None:
        self._wire()
        return super().result()


def stage_producer_ids(staging_dir: Path) -> list[str]:
    """The producer ids that have a stage under ``staging_dir`` (a folder holding a stage
    lock file: any other folder is not a stage, and draining it would create one)."""
    if not staging_dir.is_dir():
        return []
    return sorted(
        p.name for p in staging_dir.iterdir() if p.is_dir() and (p / keys.STAGE_LOCK_NAME).exists()
    )


def drain(
    store: Store,
    queue: ManifestQueue,
    staging_dir: Path,
    producer_id: str,
    *,
    on_exported: Any = None,
    timeout: float | None = None,
    failure_retry: RetryConfig = FAILURE_RETRY,
) -> dict[str, Any]:
    """Take over a (dead) producer's stage: recover its WAL, seal, export, release.

    Raises StageLockedError if the producer is still alive (it holds the lock),
    StageBufferMismatchError if the stage holds records for another buffer, the
    permanent store error that stopped the export, or FlushTimeoutError (``timeout``)
    naming what is still staged; the stage keeps whatever was not exported.
    """
    stage = Stage(staging_dir, producer_id)
    try:
        binding = bind(stage, queue)  # ids are compared before the first export
        exporter = Exporter(
            stage,
            store,
            queue,
            on_exported=on_exported,
            failure_retry=failure_retry,
            before_export=binding.before_export,
        )
    except BaseException:
        stage.close()
        raise
    try:
        stage.seal_all()
        exporter.drain(timeout)
        record_buffer_id(binding)  # if this drain's export created the buffer
    finally:
        exporter.stop()
        stage.close()
    return {
        **exporter.stats.snapshot(),
        "replayed_entries": stage.stats.replayed_entries,
        "segments_quarantined": stage.stats.segments_quarantined,
        "quarantined": [str(s.path) for s in stage.quarantined()],
    }


def record_buffer_id(binding: StageBinding) -> None:
    """After a clean export: the buffer's id, if that export created the buffer (the
    check before each export could not know it yet).  Only bookkeeping: a store hiccup
    here is not the caller's failure."""
    try:
        binding.before_export()
    except TieredBufError as e:
        log.info("stage %s: buffer id not recorded yet: %s", binding.stage.path, e)
