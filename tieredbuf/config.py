"""Frozen, validated configuration records.

Defaults are the specifications' defaults: OpenData RFC 0001 for the producer /
consumer / GC, otel-arrow's Quiver for the local tier.  Durations are ``timedelta``,
sizes are ints (bytes).  The ``AWS_*`` and ``AZURE_*`` variables are named here and
read only in :func:`tieredbuf.store.settings.store_options_from_env`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from enum import IntEnum

from tieredbuf.errors import ConfigError


class Compression(IntEnum):
    """Data batch ``compression_type`` (RFC 0001).  Config fields also take the names
    ``"none"`` and ``"zstd"``."""

    NONE = 0
    ZSTD = 1

    @classmethod
    def _missing_(cls, value: object) -> Compression | None:
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        return None


DEFAULT_GC_GRACE_PERIOD = timedelta(minutes=10)
DEFAULT_WRITES_PER_S = 5.0
"""Commits of the manifest per second, all writers of a buffer together (fan-in)."""
MAX_UPLOADS_IN_FLIGHT = 4
"""Data object uploads one producer (or one exporter) keeps in flight at a time."""
"""The GC grace period a buffer gets when its root's buffer section is first written
(``Buffer.set_gc_grace_period`` changes it), and the fallback for a root without one."""
DEFAULT_IDLE_POLL_MAX = timedelta(seconds=2.5)
"""A consumer's longest pause between footer reads while idle (``ConsumerConfig
.idle_poll_max``): 0.4 requests/s once reached; the backoff from 0.1 s up to it makes
8 footer reads in the first 10 s of an idle spell, then 4 per 10 s."""


def _positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


def _non_negative_td(name: str, value: timedelta) -> None:
    if not isinstance(value, timedelta):
        raise ConfigError(f"{name} must be a datetime.timedelta, got {type(value).__name__}")
    if value < timedelta(0):
        raise ConfigError(f"{name} must not be negative, got {value!r}")


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Jittered exponential backoff for CAS conflicts and transient store errors."""

    initial_backoff: timedelta = timedelta(milliseconds=10)
    """First sleep after a conflict."""
    max_backoff: timedelta = timedelta(seconds=2)
    """Cap on one sleep."""
    multiplier: float = 2.0
    give_up_after: timedelta | None = timedelta(seconds=30)
    """A direct call (``buf.create()``, ``set_retention``, a consumer's ``flush()``...)
    whose store keeps failing transiently (unreachable, timeouts, 5xx) raises the last
    error after retrying this long (logging it at WARNING once per interval meanwhile);
    None: retry until it works.  Background loops -- a producer's appends, the local
    tier's exporter -- retry until closed or stopped; a ``close()`` or ``flush()``
    without ``timeout`` gives up once the store has failed with nothing getting through
    for this long (a stateless producer then drops what it holds, a staged one keeps it
    staged), and one with ``timeout`` waits that long."""

    def __post_init__(self) -> None:
        _non_negative_td("initial_backoff", self.initial_backoff)
        _non_negative_td("max_backoff", self.max_backoff)
        if self.multiplier < 1.0:
            raise ConfigError(f"multiplier must be >= 1, got {self.multiplier}")
        if self.give_up_after is not None:
            _non_negative_td("give_up_after", self.give_up_after)
            if self.give_up_after <= timedelta(0):
                raise ConfigError("give_up_after must be > 0 (None: retry until it works)")


@dataclass(frozen=True, slots=True)
class ProducerConfig:
    """Producer settings, named as RFC 0001 names them."""

    flush_interval: timedelta = timedelta(milliseconds=100)
    """Flush the open batch when it is this old."""
    flush_size_bytes: int = 64 << 20
    """Flush once the open batch exceeds this many bytes (a loose limit, as in the RFC)."""
    max_buffered_inputs: int = 1000
    """produce() calls buffered before produce() blocks (backpressure)."""
    max_buffered_bytes: int = 256 << 20
    """Bytes buffered (not yet durable) before produce() blocks (backpressure)."""
    batch_compression: Compression = Compression.ZSTD
    """Compression of the data batch record block: ``zstd`` (level 3, with the frame's
    content checksum) or ``none``.  At 100 B and 1 KiB log-like records zstd stores
    about a fifth of the bytes (PUT bytes, storage, egress) for 0-20 % of the direct
    ingest rate and 6-17 % of Spark's read rate (bench/compression.py,
    docs/benchmarks.md); on incompressible records it saves nothing and costs."""
    gc_grace_period: timedelta = DEFAULT_GC_GRACE_PERIOD
    """Used only with a root that has no buffer section (written by an older tieredbuf):
    otherwise the root's grace period (``Buffer.set_gc_grace_period``) applies.  An
    object older than half the grace period is re-uploaded under a new ULID before it
    is enqueued, so GC can never have deleted it."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    manifest_writes_per_s: float | None = None
    """The buffer's commit budget: the writer holding the commit lease appends what every
    writer has uploaded at most this often (tieredbuf/produce/fanin.py), so a write waits
    about one interval for its commit whatever the number of writers.  Use the same value
    for every writer of a buffer; 0 commits as soon as something is uploaded.  None: the
    store's own budget (``tieredbuf.store.base.manifest_writes_per_s``): 1 per second
    where the store allows about one write per second to a key (Cloudflare R2), else
    :data:`DEFAULT_WRITES_PER_S`."""

    def __post_init__(self) -> None:
        _non_negative_td("flush_interval", self.flush_interval)
        if self.manifest_writes_per_s is not None and self.manifest_writes_per_s < 0:
            raise ConfigError(
                f"manifest_writes_per_s must be >= 0, got {self.manifest_writes_per_s!r}"
            )
        _positive("flush_size_bytes", self.flush_size_bytes)
        _positive("max_buffered_inputs", self.max_buffered_inputs)
        _positive("max_buffered_bytes", self.max_buffered_bytes)
        if not isinstance(self.batch_compression, Compression):
            try:
                object.__setattr__(self, "batch_compression", Compression(self.batch_compression))
            except ValueError as e:
                raise ConfigError(f"unknown batch_compression {self.batch_compression!r}") from e
        _non_negative_td("gc_grace_period", self.gc_grace_period)


SERVICE_DURABILITIES = ("local", "remote")


def _service_retry() -> RetryConfig:
    return RetryConfig(
        initial_backoff=timedelta(milliseconds=50),
        max_backoff=timedelta(seconds=2),
        give_up_after=None,
    )


@dataclass(frozen=True, slots=True)
class ServiceProducerConfig:
    """A producer that writes through ``tieredbuf serve`` (:mod:`tieredbuf.client`):
    ``produce()`` calls are batched as the direct producer batches them, and each batch
    is one ``POST /v1/produce``, retried under one ``Idempotency-Key``."""

    flush_interval: timedelta = timedelta(milliseconds=100)
    """Send the open batch when it is this old."""
    flush_size_bytes: int = 8 << 20
    """A call that would take the open batch past this many bytes starts a new one: keep
    it under the service's ``--max-body`` (16 MiB by default).  A single call larger
    than that is sent alone (and refused with 413 if the service's limit is lower)."""
    max_request_records: int = 100_000
    """... and past this many records: the service's ``--max-records``."""
    max_buffered_inputs: int = 1000
    """produce() calls not yet answered before produce() blocks (backpressure)."""
    max_buffered_bytes: int = 256 << 20
    """Bytes not yet answered before produce() blocks (backpressure)."""
    max_in_flight: int = 1
    """Requests this producer has in flight at once (each on its own connection); while
    all are out the open batch keeps filling.  With 1 and ``durability="remote"`` each
    request is in the queue before the next is sent, so the producer's calls land in
    the order they were made, as a direct producer's do (I3).  More lower a light
    producer's latency (a call need not wait for the request before it) and give up
    that order; under load they cost more requests, and CPU on both sides
    (docs/operations.md, "The client")."""
    durability: str = "remote"
    """What the service is asked for: ``remote`` (handles reach LOCAL and REMOTE when
    the answer names the request's entry) or ``local`` (handles reach LOCAL when the
    service's stage fsynced the request; REMOTE waits fail with
    ``RemoteNotRequestedError``)."""
    request_timeout: timedelta = timedelta(seconds=60)
    """One attempt's socket timeout.  Keep it above the service's ``--remote-timeout``
    (30 s): the service answers 504 then, and the request is retried."""
    retry: RetryConfig = field(default_factory=_service_retry)
    """Backoff between attempts (jittered, 50 ms doubling to 2 s), unless the service
    said ``Retry-After``.  ``give_up_after`` None (the default): a request is retried
    until the producer is closed, as the direct producer's uploads are; set: its
    handles fail with ``ServiceUnavailableError`` after retrying that long."""
    max_retry_after: timedelta = timedelta(seconds=30)
    """A ``Retry-After`` longer than this is taken as this long."""
    unknown_outcome_for: timedelta = timedelta(minutes=5)
    """Once an attempt's outcome is unknown (sent and not answered, or answered 5xx), the
    request's later attempts are marked as retries of it (``X-Tieredbuf-Retry: 1``): the
    service answers them from the first (its own table, or the entry in the queue), and
    409 while no instance can tell -- it may be in flight, or staged at an instance that
    is down.  After this long of that the calls fail with ``ServiceUnavailableError``
    (``may_have_landed``): stored once, or not at all, never twice."""
    token: str | None = field(default=None, repr=False)
    """Bearer token sent as ``Authorization: Bearer <token>`` (never printed)."""
    token_file: str | None = None
    """... or a file holding it (its first token; blank lines and ``#`` comments
    skipped), read again when it changes: a rotated token is picked up without a
    restart."""
    ca_file: str | None = None
    """PEM file of the certificate authorities an ``https://`` service is checked
    against (default: the system's).  Certificates are always verified."""

    def __post_init__(self) -> None:
        _non_negative_td("flush_interval", self.flush_interval)
        for name in (
            "flush_size_bytes",
            "max_request_records",
            "max_buffered_inputs",
            "max_buffered_bytes",
            "max_in_flight",
        ):
            _positive(name, getattr(self, name))
        _non_negative_td("request_timeout", self.request_timeout)
        _positive("request_timeout", self.request_timeout.total_seconds())
        _non_negative_td("max_retry_after", self.max_retry_after)
        _non_negative_td("unknown_outcome_for", self.unknown_outcome_for)
        if self.durability not in SERVICE_DURABILITIES:
            raise ConfigError(
                f"durability must be one of {', '.join(SERVICE_DURABILITIES)}, "
                f"got {self.durability!r}"
            )
        if not isinstance(self.retry, RetryConfig):
            raise ConfigError(f"retry must be a RetryConfig, got {type(self.retry).__name__}")
        if self.token is not None and self.token_file is not None:
            raise ConfigError("give token or token_file, not both")


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    """Consumer settings (RFC 0001 plus read-ahead)."""

    dequeue_every: int = 100
    """Acks between automatic dequeues (the RFC's 100)."""
    read_ahead: int = 8
    """Data objects fetched ahead of next_batch(), in parallel."""
    read_ahead_bytes: int = 128 << 20
    """Read-ahead starts another data object only when, with it, those fetched ahead and
    not yet returned hold at most this (by the sizes the manifest records; an entry with
    no recorded size counts 0): a reader holds at most this plus the object it is
    serving, and an object larger than this is fetched only when asked for.  Large
    entries of which fewer than 4 fit are each fetched in parallel 8 MiB ranged GETs,
    read straight into one buffer of the object's size."""
    check_every: int = 100
    """Between the checks that this instance is still its subscriber's current one (the
    root footer's epoch; a named subscriber's progress object), at most this many entries
    are served from what the consumer already knows.  It also checks when it reaches the
    end of what it knows and with every write (I4: a fenced consumer's writes never land;
    its reads stop within ``check_every`` entries or ``check_interval``)."""
    check_interval: timedelta = timedelta(seconds=1)
    """... and at most this long passes between two checks while it serves entries."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    on_lost: str = "raise"
    """Entries retention unlinked before this subscriber read them: ``raise``
    (DataLossError naming them) or ``skip`` (move on, counted in ``lost``)."""
    publish_interval: timedelta = timedelta(seconds=1)
    """A named subscriber publishes its position into the root at most this often (and
    only while it is the one holding the head back), besides every flush()/close()."""
    idle_poll_max: timedelta = DEFAULT_IDLE_POLL_MAX
    """The longest pause between footer reads of an idle ``next_batch(timeout=...)``
    (the long poll's backoff doubles from 0.1 s up to it): an idle consumer sends about
    one small GET per this long, and the first entry after an idle spell is seen up to
    this late.  The Spark source's ``idlePollMaxMs`` is the same trade for a stream."""

    def __post_init__(self) -> None:
        _positive("dequeue_every", self.dequeue_every)
        if self.read_ahead < 0:
            raise ConfigError(f"read_ahead must be >= 0, got {self.read_ahead}")
        _positive("read_ahead_bytes", self.read_ahead_bytes)
        _positive("check_every", self.check_every)
        _non_negative_td("check_interval", self.check_interval)
        _on_lost(self.on_lost)
        _non_negative_td("publish_interval", self.publish_interval)
        _non_negative_td("idle_poll_max", self.idle_poll_max)
        if self.idle_poll_max <= timedelta(0):
            raise ConfigError(f"idle_poll_max must be > 0, got {self.idle_poll_max!r}")


def _on_lost(value: str) -> None:
    if value not in ("raise", "skip"):
        raise ConfigError(f"on_lost must be 'raise' or 'skip', got {value!r}")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """A worker of a shared work queue (Quiver's claim / ack / defer / reject)."""

    lease: timedelta = timedelta(seconds=30)
    """How long a claimed entry is this worker's; lapsed, it is redelivered to another.
    Judged by the claimer's wall clock (skew means earlier or later redelivery)."""
    claim_batch: int = 8
    """Entries leased per CAS of the progress object; handed out one per claim()."""
    max_claim_batch: int | None = None
    """When refills are slow against its processing speed (S3's round trips, contention)
    a worker leases more per CAS, up to this (None: 8 x claim_batch): enough to cover
    about twice its measured refill time at its measured processing speed, and never
    more than it can process in half a lease, counting what it holds."""
    refill_ahead: bool = True
    """Start the next refill in the background when the leased entries are about to run
    out, so claim() does not wait for the progress CAS; False: refill only when claim()
    finds none left (a lease then starts when a claim needs it)."""
    max_deliveries: int | None = None
    """Reject an entry (reason ``max_deliveries reached``) instead of delivering it a
    ``max_deliveries + 1``-th time; None: redeliver forever."""
    max_span: int = 1024
    """At most this many sequences between the position (oldest not done) and the claim
    cursor: bounds the progress object while a poison entry keeps the position back."""
    read_ahead: int = 8
    """Data objects of leased entries fetched ahead, in parallel."""
    read_ahead_bytes: int = 128 << 20
    """As :attr:`ConsumerConfig.read_ahead_bytes`."""
    on_lost: str = "raise"
    """Entries retention unlinked before they were acked: ``raise`` or ``skip``."""
    check_interval: timedelta = timedelta(seconds=1)
    """A refill whose claim reaches past the tail it knows reads the root's 22-byte
    footer (new entries?), or the whole root when its view is older than this.  A refill
    inside the known backlog reads no root."""
    publish_interval: timedelta = timedelta(seconds=1)
    """The queue's publisher (one of its workers) copies its position into the root at
    most this often while it holds the head back."""
    redelivery_delay: timedelta = timedelta(seconds=1)
    """A deferred entry is claimable again this long after its first delivery, twice as
    long after its second, and so on (SQS's visibility timeout on a failed receive);
    ``timedelta(0)``: at once.  ``defer(seq, delay=...)`` overrides it per entry."""
    redelivery_delay_max: timedelta = timedelta(minutes=5)
    """The longest redelivery delay."""
    idle_poll_max: timedelta = timedelta(seconds=3)
    """``claim(timeout=...)`` with nothing claimable: the longest pause between the root
    footer reads that show new entries (0.1 s after it went idle, doubling to this), and
    a fifth as often a read of the progress object (entries other workers handed back):
    at most 0.4 requests/s while idle."""
    retry: RetryConfig = field(default_factory=RetryConfig)

    def __post_init__(self) -> None:
        _non_negative_td("lease", self.lease)
        _non_negative_td("redelivery_delay", self.redelivery_delay)
        if self.redelivery_delay_max < self.redelivery_delay:
            raise ConfigError(
                f"redelivery_delay_max {self.redelivery_delay_max!r} < redelivery_delay "
                f"{self.redelivery_delay!r}"
            )
        if self.idle_poll_max <= timedelta(0):
            raise ConfigError(f"idle_poll_max must be > 0, got {self.idle_poll_max!r}")
        if self.lease <= timedelta(0):
            raise ConfigError("lease must be > 0")
        _positive("claim_batch", self.claim_batch)
        if self.max_claim_batch is not None and self.max_claim_batch < self.claim_batch:
            raise ConfigError(
                f"max_claim_batch {self.max_claim_batch} < claim_batch {self.claim_batch}"
            )
        if self.max_deliveries is not None and not 1 <= self.max_deliveries <= 0xFFFF:
            raise ConfigError(f"max_deliveries must be in 1..65535, got {self.max_deliveries}")
        if not self.claim_batch <= self.max_span <= 1 << 16:
            raise ConfigError(f"max_span must be in claim_batch..65536, got {self.max_span}")
        if self.read_ahead < 0:
            raise ConfigError(f"read_ahead must be >= 0, got {self.read_ahead}")
        _positive("read_ahead_bytes", self.read_ahead_bytes)
        _on_lost(self.on_lost)
        _non_negative_td("check_interval", self.check_interval)
        _non_negative_td("publish_interval", self.publish_interval)


@dataclass(frozen=True, slots=True)
class GcConfig:
    """Garbage collector settings (RFC 0001)."""

    gc_interval: timedelta = timedelta(minutes=5)
    gc_grace_period: timedelta = DEFAULT_GC_GRACE_PERIOD
    """Used only with a root that has no buffer section; otherwise the root's applies."""
    delete_batch: int = 1000

    def __post_init__(self) -> None:
        _non_negative_td("gc_interval", self.gc_interval)
        _non_negative_td("gc_grace_period", self.gc_grace_period)
        _positive("delete_batch", self.delete_batch)


# Keyword options accepted by tieredbuf.open() for S3, and the environment
# variables they default from (the standard AWS names).
S3_OPTION_ENV: dict[str, tuple[str, ...]] = {
    "endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "access_key_id": ("AWS_ACCESS_KEY_ID",),
    "secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
    "session_token": ("AWS_SESSION_TOKEN",),
    "allow_http": ("AWS_ALLOW_HTTP",),
    "skip_signature": ("AWS_SKIP_SIGNATURE",),
    # not an AWS name: asking the instance metadata service for credentials is opt-in
    "instance_metadata": ("TIEREDBUF_S3_INSTANCE_METADATA",),
}

# Credential sources obstore finds by itself in the environment (besides static keys).
S3_CREDENTIAL_ENV: tuple[str, ...] = (
    "AWS_WEB_IDENTITY_TOKEN_FILE",  # EKS IRSA (with AWS_ROLE_ARN)
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",  # ECS task role
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",  # EKS pod identity
)


AZURE_OPTION_ENV: dict[str, tuple[str, ...]] = {
    "account_name": ("AZURE_STORAGE_ACCOUNT_NAME",),
    "account_key": ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_KEY"),
    "sas_token": ("AZURE_STORAGE_SAS_TOKEN",),
    "bearer_token": ("AZURE_STORAGE_TOKEN",),
    "client_id": ("AZURE_CLIENT_ID",),
    "client_secret": ("AZURE_CLIENT_SECRET",),
    "tenant_id": ("AZURE_TENANT_ID",),
    "federated_token_file": ("AZURE_FEDERATED_TOKEN_FILE",),
    "use_azure_cli": ("AZURE_USE_AZURE_CLI",),
    "endpoint": ("AZURE_STORAGE_ENDPOINT",),
    "allow_http": ("AZURE_ALLOW_HTTP",),
    # account, key or SAS and endpoint in one string, filling what the others left unset
    "connection_string": ("AZURE_STORAGE_CONNECTION_STRING",),
    # not an Azure name: asking the instance metadata service for a token is opt-in
    "managed_identity": ("TIEREDBUF_AZURE_MANAGED_IDENTITY",),
}
"""az:// options and the standard Azure variables they are read from when not given."""


SECRET_OPTIONS = (
    "access_key_id",
    "secret_access_key",
    "session_token",
    "account_key",
    "sas_token",
    "bearer_token",
    "client_secret",
    "connection_string",
)
"""Store options (and their ``AWS_*`` / ``AZURE_*`` variables) whose values never
appear in any output (errors, logs, HTTP answers, inspect, metrics): see
:mod:`tieredbuf.runtime.redact`."""


# --- local tier (stage/): named as Quiver names them ------------------------------


@dataclass(frozen=True, slots=True)
class WalConfig:
    """Per-core write-ahead log (Quiver ``wal.*``)."""

    flush_interval: timedelta = timedelta(milliseconds=25)
    """Group commit: a background flusher fdatasyncs this often while appends are
    pending; ``0`` fdatasyncs before every append returns (concurrent appenders share
    one fdatasync).  An append's LOCAL ack completes only after its fdatasync."""
    rotation_target: int = 64 << 20
    """Rotate ``quiver.wal`` to ``quiver.wal.N`` once it holds this many bytes."""
    max_size: int = 4 << 30
    """Cap on the aggregate bytes of the active WAL plus every rotated sibling."""
    max_rotated_files: int = 10
    """Cap on WAL files, counting the active one."""
    corrupt_policy: str = "fail"
    """A CRC error *mid-file* (not a torn tail): ``fail`` refuses to open with a
    CorruptError naming file and offset; ``truncate`` drops the file from there on
    (Quiver's behaviour, which can lose acknowledged entries)."""

    def __post_init__(self) -> None:
        _non_negative_td("flush_interval", self.flush_interval)
        _positive("rotation_target", self.rotation_target)
        _positive("max_size", self.max_size)
        if self.max_rotated_files < 1:
            raise ConfigError(f"max_rotated_files must be >= 1, got {self.max_rotated_files}")
        if self.corrupt_policy not in ("fail", "truncate"):
            raise ConfigError(
                f"corrupt_policy must be 'fail' or 'truncate', got {self.corrupt_policy!r}"
            )


@dataclass(frozen=True, slots=True)
class SegmentConfig:
    """Open segment accumulators and sealed segment files (Quiver ``segment.*``)."""

    target_size: int = 32 << 20
    """Seal an open segment once its accumulated bytes reach this."""
    max_open_duration: timedelta = timedelta(seconds=5)
    """Seal an open segment this long after its first entry (timer-driven)."""
    max_open_bytes: int = 128 << 20
    """Memory bound on all open segments together; appends wait (backpressure) above it."""
    records_compression: Compression = Compression.NONE
    """Compression of sealed ``.batch`` files."""

    def __post_init__(self) -> None:
        _positive("target_size", self.target_size)
        _non_negative_td("max_open_duration", self.max_open_duration)
        _positive("max_open_bytes", self.max_open_bytes)
        if not isinstance(self.records_compression, Compression):
            try:
                object.__setattr__(
                    self, "records_compression", Compression(self.records_compression)
                )
            except ValueError as e:
                raise ConfigError(
                    f"unknown records_compression {self.records_compression!r}"
                ) from e


@dataclass(frozen=True, slots=True)
class StageConfig:
    """The local tier as a whole (Quiver ``durability`` and ``retention.*``)."""

    durability: str = "wal"
    """``wal``: appends are acked after their WAL fdatasync.  ``segment_only``: no
    WAL; appends are acked when their segment is sealed (a crash loses open segments)."""
    wal: WalConfig = field(default_factory=WalConfig)
    segment: SegmentConfig = field(default_factory=SegmentConfig)
    size_cap: int = 16 << 30
    """Staging disk budget: WAL plus sealed, not yet released segments."""
    size_cap_policy: str = "backpressure"
    """At a cap: ``backpressure`` blocks appends (up to ``backpressure_timeout``, then
    BackpressureError); ``drop_oldest`` deletes the oldest sealed segment and counts it."""
    backpressure_timeout: timedelta = timedelta(seconds=30)
    keep_freed_memory: bool = True
    """glibc only, process-wide: keep up to 64 MiB of freed heap for reuse instead of
    returning it to the OS after each seal (``stage/malloc.py``; skipped when the
    environment sets glibc's malloc thresholds)."""

    def __post_init__(self) -> None:
        if self.durability not in ("wal", "segment_only"):
            raise ConfigError(
                f"durability must be 'wal' or 'segment_only', got {self.durability!r}"
            )
        if self.size_cap_policy not in ("backpressure", "drop_oldest"):
            raise ConfigError(
                f"size_cap_policy must be 'backpressure' or 'drop_oldest', got "
                f"{self.size_cap_policy!r}"
            )
        _positive("size_cap", self.size_cap)
        _non_negative_td("backpressure_timeout", self.backpressure_timeout)


@dataclass(frozen=True, slots=True)
class TreeConfig:
    """The queue manifest as an M-way tree, and retention of acked history.

    Every writer of one buffer (producers, exporters, consumers) should use the
    same ``m``: rebalancing runs inside whichever writer's CAS loop touches the root.
    Retention is the root's: the retention fields only *seed* the root's stored
    policy in this writer's first write when the root has never had one; afterwards
    the stored policy (``Buffer.set_retention``) wins for every writer.  Nothing
    here is read from the environment.
    """

    m: int = 1024
    """Branching factor: the root keeps at most ``m`` entries and ``m`` refs of each level;
    the oldest ``m`` of a fuller level move into one immutable group object."""
    retention_max_age: timedelta | None = None
    """Seed for the root's policy: keep acked history at least until it is this old."""
    retention_max_bytes: int | None = None
    """Seed for the root's policy: unlink acked history, oldest first, while the linked
    data exceeds this many bytes."""
    link_deadline: timedelta = timedelta(minutes=2)
    """A writer abandons a CAS attempt whose new group objects are older than this: they
    must be linked well inside GC's grace period (keep it under half of gc_grace_period)."""

    def __post_init__(self) -> None:
        if not isinstance(self.m, int) or self.m < 2:
            raise ConfigError(f"m must be an int >= 2, got {self.m!r}")
        if self.retention_max_age is not None:
            _non_negative_td("retention_max_age", self.retention_max_age)
        if self.retention_max_bytes is not None and self.retention_max_bytes < 0:
            raise ConfigError(f"retention_max_bytes must be >= 0, got {self.retention_max_bytes}")
        _non_negative_td("link_deadline", self.link_deadline)

    @property
    def retains(self) -> bool:
        """True when acked history is kept (dequeue moves the head; retention unlinks)."""
        return self.retention_max_age is not None or self.retention_max_bytes is not None
