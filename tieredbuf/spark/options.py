"""Options of the ``tieredbuf`` Spark source and sink, and the packing rule.

Pure functions only (no Spark, no I/O), so they are tested without a session.
Spark hands options over with lower-cased keys (a case-insensitive dict); every
lookup here goes through :func:`_get`, which lower-cases the name it asks for.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tieredbuf.errors import ConfigError

MAX_LONG = (1 << 63) - 1
"""Spark's ``long``: sequences above it cannot be represented in a row."""

STRIDE = 1 << 20
"""Producer sequence numbers the sink reserves per commit: at most this many objects per
job or micro-batch.  A commit's last number is ``(version + 1) * STRIDE``, so a retry of
the same commit is recognised however many objects it carries."""

QUERY_TAG = "#spark-query="
"""Separates ``producerId`` from Spark's query id in a streaming sink's watermark id
(``producerId#spark-query=<query id>``); a producerId cannot contain it."""

MAX_VERSION = MAX_LONG // STRIDE - 1
"""``batchVersion`` / micro-batch ids above this do not fit a producer number."""

SPLIT_STREAMS_BYTES = 64 << 20
"""Default ``splitStreamsBytes``: bundle reads split ``.qseg`` objects larger than this
by stream."""

MAX_PARTITION_BYTES = 128 << 20
"""Default ``maxPartitionBytes``: small data objects are packed into one Spark partition
up to this many bytes (Spark's ``spark.sql.files.maxPartitionBytes``)."""

IDLE_POLL_MAX_MS = 2000
"""Default ``idlePollMaxMs``: an idle stream reads the root's footer at most once per
this long (0.5 requests/s) and sees new data within it."""

OPEN_COST_BYTES = 4 << 20
"""What opening one more object costs a partition, counted as bytes when packing
(Spark's ``spark.sql.files.openCostInBytes``)."""

EARLIEST = "earliest"
LATEST = "latest"

# Store options accepted by tieredbuf.open() for s3:// and Azure URLs, by lower-cased option
# name (snake_case and camelCase both arrive lower-cased; both spellings map here).
_STORE_KEYS: dict[str, str] = {
    "endpoint": "endpoint",
    "region": "region",
    "access_key_id": "access_key_id",
    "accesskeyid": "access_key_id",
    "secret_access_key": "secret_access_key",
    "secretaccesskey": "secret_access_key",
    "session_token": "session_token",
    "sessiontoken": "session_token",
    "allow_http": "allow_http",
    "allowhttp": "allow_http",
    "max_retries": "max_retries",
    "maxretries": "max_retries",
    "timeout": "timeout",
    "connect_timeout": "connect_timeout",
    "connecttimeout": "connect_timeout",
    "retry_timeout": "retry_timeout",
    "retrytimeout": "retry_timeout",
    # Azure Blob (az://, abfs://, https://ACCOUNT.blob.core.windows.net/...)
    "account_name": "account_name",
    "accountname": "account_name",
    "account_key": "account_key",
    "accountkey": "account_key",
    "sas_token": "sas_token",
    "sastoken": "sas_token",
    "client_id": "client_id",
    "clientid": "client_id",
    "client_secret": "client_secret",
    "clientsecret": "client_secret",
    "tenant_id": "tenant_id",
    "tenantid": "tenant_id",
    "use_azure_cli": "use_azure_cli",
    "useazurecli": "use_azure_cli",
    "managed_identity": "managed_identity",
    "managedidentity": "managed_identity",
    # Google Cloud Storage (gs://)
    "credentials_file": "credentials_file",
    "credentialsfile": "credentials_file",
    "anonymous": "anonymous",
}
_INT_STORE_OPTIONS = {"max_retries"}
_SECONDS_STORE_OPTIONS = {"timeout", "connect_timeout", "retry_timeout"}

READ_OPTIONS = frozenset(
    {
        "path",
        "startingoffsets",
        "endingoffsets",
        "startingtimestamp",
        "endingtimestamp",
        "failondataloss",
        "slot",
        "consumer",
        "maxoffsetspertrigger",
        "maxbytespertrigger",
        "splitstreamsbytes",
        "maxpartitionbytes",
        "minpartitions",
        "idlepollmaxms",
    }
)
WRITE_OPTIONS = frozenset(
    {
        "path",
        "slot",
        "producerid",
        "batchversion",
        "maxobjectbytes",
        "compression",
        "createbuffer",
    }
)
_REMOVED_OPTIONS = {
    "gcgraceperiodseconds": "the GC grace period is the buffer's own (in its manifest "
    "root; Buffer.set_gc_grace_period or `tieredbuf grace URL DURATION`), so the sink and "
    "GC cannot disagree",
}


def _get(options: Mapping[str, Any], name: str) -> Any:
    """Case-insensitive lookup (Spark lower-cases keys; a plain dict in tests may not)."""
    low = name.lower()
    for k, v in options.items():
        if k.lower() == low:
            return v
    return None


def store_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The store keyword options for :func:`tieredbuf.open` (credentials, endpoint, ...)."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        name = _STORE_KEYS.get(k.lower())
        if name is None or v is None:
            continue
        if name in _INT_STORE_OPTIONS:
            out[name] = _int(k, v)
        elif name in _SECONDS_STORE_OPTIONS:
            out[name] = _float(k, v)
        else:
            out[name] = v
    return out


SPARK_OPTIONS = frozenset({"path", "paths", "checkpointlocation", "queryname"})
"""Options Spark itself passes along to sources and sinks."""


_DISPLAY = {
    n.lower(): n
    for n in (
        "startingOffsets",
        "endingOffsets",
        "startingTimestamp",
        "endingTimestamp",
        "failOnDataLoss",
        "slot",
        "consumer",
        "maxOffsetsPerTrigger",
        "maxBytesPerTrigger",
        "splitStreamsBytes",
        "maxPartitionBytes",
        "minPartitions",
        "idlePollMaxMs",
        "producerId",
        "batchVersion",
        "maxObjectBytes",
        "compression",
        "createBuffer",
        "path",
    )
}
"""How the docs spell each option (Spark hands them over lower-cased)."""
_STORE_DISPLAY = (
    "endpoint",
    "region",
    "accessKeyId",
    "secretAccessKey",
    "sessionToken",
    "allowHttp",
    "maxRetries",
    "timeout",
    "connectTimeout",
    "retryTimeout",
    "credentialsFile",
)


def did_you_mean(word: str, choices: Mapping[str, str]) -> str:
    """`` (did you mean X?)`` for the nearest of ``choices`` (lower-case -> shown), or ""."""
    import difflib

    got = difflib.get_close_matches(word.lower(), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {choices[got[0]]}?)" if got else ""


def check_known(options: Mapping[str, Any], known: frozenset[str], what: str) -> None:
    """Refuse option names we do not know: a typo must not silently read everything.

    The error names the nearest valid option and lists the valid ones, each once in
    the docs' spelling (store options in camelCase; snake_case works too)."""
    for k in options:
        if k.lower() in _REMOVED_OPTIONS:
            raise ConfigError(f"option {k} is no longer supported: {_REMOVED_OPTIONS[k.lower()]}")
    unknown = sorted(
        k
        for k in options
        if k.lower() not in known | SPARK_OPTIONS and k.lower() not in _STORE_KEYS
    )
    if unknown:
        mine = {n: _DISPLAY.get(n, n) for n in known if n != "path"}
        store = {n.lower(): n for n in _STORE_DISPLAY}
        store.update(
            {
                k: v
                for k, v in ((a, store.get(a.replace("_", ""), a)) for a in _STORE_KEYS)
                if k not in store
            }
        )
        hint = did_you_mean(unknown[0], {**mine, **store})
        raise ConfigError(
            f"unknown tieredbuf {what} option {unknown[0]!r}{hint}"
            + (f" (and {unknown[1:]})" if len(unknown) > 1 else "")
            + f"; valid {what} options: {', '.join(sorted(mine.values(), key=str.lower))};"
            f" store options: {', '.join(_STORE_DISPLAY)}"
        )
    for k, v in options.items():
        low = k.lower()
        if low in known and low != "path" and isinstance(v, str) and not v.strip():
            # an empty value is not "unset": consumer="" would run with no subscriber,
            # producerId="" without exactly-once (store options may be empty: unset)
            raise ConfigError(
                f"option {_DISPLAY.get(low, k)} is empty; leave it out to get its default"
            )


def _int(name: str, v: Any) -> int:
    try:
        return int(str(v).strip())
    except ValueError as e:
        raise ConfigError(f"option {name} must be an integer, got {v!r}") from e


def _float(name: str, v: Any) -> float:
    try:
        return float(str(v).strip())
    except ValueError as e:
        raise ConfigError(f"option {name} must be a number, got {v!r}") from e


def _bool(name: str, v: Any, default: bool) -> bool:
    if v is None:
        return default
    s = str(v).strip().lower()
    if s in ("true", "1", "yes"):
        return True
    if s in ("false", "0", "no"):
        return False
    raise ConfigError(f"option {name} must be true or false, got {v!r}")


def parse_bound(name: str, v: Any) -> str | int | None:
    """``earliest`` / ``latest`` / a sequence number / ``{"sequence": n}`` (Kafka spirit)."""
    if v is None:
        return None
    s = str(v).strip()
    if s.lower() in (EARLIEST, LATEST):
        return s.lower()
    if s.startswith("{"):
        return _sequence_of(name, _bound_json(name, s)["sequence"])
    if not s.lstrip("-").isdigit():
        hint = did_you_mean(s, {EARLIEST: EARLIEST, LATEST: LATEST})
        raise ConfigError(
            f"option {name} must be earliest, latest, a sequence number or "
            f'{{"sequence": n}}, got {v!r}{hint}'
        )
    return _sequence_of(name, s)


OFFSET_KEYS = frozenset({"sequence", "buffer", "from", "consumer", "lostSequences"})
"""Keys an offsets JSON may carry (the streaming source's offsets, docs/spark.md)."""


def _bound_json(name: str, s: str) -> dict[str, Any]:
    try:
        doc = json.loads(s)
    except ValueError as e:
        raise ConfigError(f'option {name}: expected {{"sequence": n}}, got {s!r}') from e
    if not isinstance(doc, dict) or "sequence" not in doc:
        raise ConfigError(f'option {name}: expected {{"sequence": n}}, got {s!r}')
    unknown = sorted(set(doc) - OFFSET_KEYS)
    if unknown:
        raise ConfigError(
            f"option {name}: unknown key {unknown[0]!r} in {s!r}; an offsets JSON has "
            f"{', '.join(sorted(OFFSET_KEYS))}"
        )
    return dict(doc)


def bound_buffer(name: str, v: Any) -> str | None:
    """The buffer id an offsets JSON names (``{"sequence": n, "buffer": id}``), or None."""
    if v is None or not str(v).strip().startswith("{"):
        return None
    bid = _bound_json(name, str(v).strip()).get("buffer")
    return None if bid is None else str(bid)


def _sequence_of(name: str, v: Any) -> int:
    n = _int(name, v)
    if n < 0:
        raise ConfigError(f"option {name} must be >= 0, got {v!r}")
    return n


def parse_timestamp_ms(name: str, v: Any) -> int | None:
    """Epoch milliseconds (as Kafka's option) or an ISO-8601 time (UTC when naive)."""
    if v is None:
        return None
    s = str(v).strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(s)
    except ValueError as e:
        raise ConfigError(
            f"option {name} must be epoch milliseconds or an ISO-8601 time, got {v!r}"
        ) from e
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return int(t.timestamp() * 1000)


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """Everything a reader needs, parsed once on the driver (picklable)."""

    url: str
    store: tuple[tuple[str, Any], ...]
    starting: str | int | None
    ending: str | int | None
    starting_ts: int | None
    ending_ts: int | None
    fail_on_data_loss: bool
    slot: int | None
    consumer: str | None
    max_offsets: int | None
    max_bytes: int | None
    split_streams_bytes: int
    max_partition_bytes: int
    min_partitions: int
    bound_buffers: tuple[tuple[str, str], ...] = ()
    """(option, buffer id) for each offsets JSON that names a buffer: it must be the
    buffer read (checked against its root when planning)."""
    idle_poll_max_ms: int | None = None
    """``idlePollMaxMs``: the longest pause of an idle stream's backoff between footer
    reads (None: :data:`IDLE_POLL_MAX_MS`; ``ConsumerConfig.idle_poll_max`` for a
    consumer)."""

    @property
    def bundles(self) -> bool:
        return self.slot is not None

    def store_kwargs(self) -> dict[str, Any]:
        return dict(self.store)


def buffer_url(options: Mapping[str, Any]) -> str:
    url = _get(options, "path")
    if not url:
        raise ConfigError('tieredbuf needs the buffer URL: .load("s3://bucket/prefix")')
    url = str(url)
    if url.startswith("memory://"):
        raise ConfigError(
            "memory:// buffers live in one process; Spark executors cannot see them. "
            "Use file:///dir, s3://bucket/prefix or az://container/prefix"
        )
    return url


def parse_read_options(options: Mapping[str, Any]) -> ReadOptions:
    check_known(options, READ_OPTIONS, "read")
    slot = _get(options, "slot")
    maxo = _get(options, "maxOffsetsPerTrigger")
    maxb = _get(options, "maxBytesPerTrigger")
    consumer = _get(options, "consumer")
    idle = _get(options, "idlePollMaxMs")
    ro = ReadOptions(
        url=buffer_url(options),
        store=tuple(sorted(store_options(options).items())),
        starting=parse_bound("startingOffsets", _get(options, "startingOffsets")),
        ending=parse_bound("endingOffsets", _get(options, "endingOffsets")),
        starting_ts=parse_timestamp_ms("startingTimestamp", _get(options, "startingTimestamp")),
        ending_ts=parse_timestamp_ms("endingTimestamp", _get(options, "endingTimestamp")),
        fail_on_data_loss=_bool("failOnDataLoss", _get(options, "failOnDataLoss"), True),
        slot=None if slot is None else _int("slot", slot),
        consumer=None if consumer is None else str(consumer),
        max_offsets=None if maxo is None else _int("maxOffsetsPerTrigger", maxo),
        max_bytes=None if maxb is None else _int("maxBytesPerTrigger", maxb),
        split_streams_bytes=_int(
            "splitStreamsBytes", _get(options, "splitStreamsBytes") or SPLIT_STREAMS_BYTES
        ),
        max_partition_bytes=_int(
            "maxPartitionBytes", _get(options, "maxPartitionBytes") or MAX_PARTITION_BYTES
        ),
        min_partitions=_int("minPartitions", _get(options, "minPartitions") or os.cpu_count() or 1),
        idle_poll_max_ms=None if idle is None else _int("idlePollMaxMs", idle),
        bound_buffers=tuple(
            (name, bid)
            for name in ("startingOffsets", "endingOffsets")
            if (bid := bound_buffer(name, _get(options, name))) is not None
        ),
    )
    if ro.starting is not None and ro.starting_ts is not None:
        raise ConfigError("give startingOffsets or startingTimestamp, not both")
    if ro.ending is not None and ro.ending_ts is not None:
        raise ConfigError("give endingOffsets or endingTimestamp, not both")
    if isinstance(ro.starting, int) and isinstance(ro.ending, int) and ro.ending < ro.starting:
        raise ConfigError(
            f"endingOffsets {ro.ending} is below startingOffsets {ro.starting}: the range "
            "would be empty"
        )
    if ro.starting_ts is not None and ro.ending_ts is not None and ro.ending_ts < ro.starting_ts:
        raise ConfigError(
            f"endingTimestamp {ro.ending_ts} is before startingTimestamp {ro.starting_ts} "
            "(epoch ms): the window would be empty"
        )
    for name, n in (("maxOffsetsPerTrigger", ro.max_offsets), ("maxBytesPerTrigger", ro.max_bytes)):
        if n is not None and n <= 0:
            raise ConfigError(f"option {name} must be > 0, got {n}")
    if ro.slot is not None and not 0 <= ro.slot < 1 << 16:
        raise ConfigError(f"option slot must be in 0..65535, got {ro.slot}")
    if ro.max_partition_bytes < 0:
        raise ConfigError(
            "option maxPartitionBytes must be >= 0 (0: one partition per data object), "
            f"got {ro.max_partition_bytes}"
        )
    if ro.idle_poll_max_ms is not None and ro.idle_poll_max_ms <= 0:
        raise ConfigError(
            f"option idlePollMaxMs must be > 0 (milliseconds), got {ro.idle_poll_max_ms}"
        )
    if ro.min_partitions < 1:
        raise ConfigError(f"option minPartitions must be >= 1, got {ro.min_partitions}")
    if ro.split_streams_bytes < 0:
        raise ConfigError(
            f"option splitStreamsBytes must be >= 0 (0: never split), got {ro.split_streams_bytes}"
        )
    return ro


@dataclass(frozen=True, slots=True)
class WriteOptions:
    url: str
    store: tuple[tuple[str, Any], ...]
    slot: int | None
    """Write Arrow bundles into this slot (None: records when rows have a ``value``
    column, else bundles into slot 0)."""
    producer_id: str | None
    batch_version: int | None
    """Batch writes with ``producerId``: this write's version (Delta's txnVersion)."""
    max_object_bytes: int
    zstd: bool
    create_buffer: bool

    def store_kwargs(self) -> dict[str, Any]:
        return dict(self.store)


def parse_write_options(options: Mapping[str, Any]) -> WriteOptions:
    check_known(options, WRITE_OPTIONS, "write")
    comp = str(_get(options, "compression") or "none").lower()
    if comp not in ("none", "zstd"):
        raise ConfigError(f"option compression must be none or zstd, got {comp!r}")
    pid = _get(options, "producerId")
    version = _get(options, "batchVersion")
    slot = _get(options, "slot")
    wo = WriteOptions(
        url=buffer_url(options),
        store=tuple(sorted(store_options(options).items())),
        slot=None if slot is None else _int("slot", slot),
        producer_id=None if pid is None else str(pid),
        batch_version=None if version is None else _int("batchVersion", version),
        max_object_bytes=_int("maxObjectBytes", _get(options, "maxObjectBytes") or 64 << 20),
        zstd=comp == "zstd",
        create_buffer=_bool("createBuffer", _get(options, "createBuffer"), False),
    )
    if wo.max_object_bytes <= 0:
        raise ConfigError("option maxObjectBytes must be > 0")
    if wo.slot is not None and not 0 <= wo.slot < 1 << 16:
        raise ConfigError(f"option slot must be in 0..65535, got {wo.slot}")
    if wo.producer_id is not None and len(wo.producer_id.encode()) > 200:
        raise ConfigError("option producerId must be at most 200 bytes")
    if wo.producer_id is not None and QUERY_TAG in wo.producer_id:
        raise ConfigError(
            f"option producerId cannot contain {QUERY_TAG!r} (the sink adds it, with the "
            "streaming query's id, to the watermark it records)"
        )
    if wo.batch_version is not None and not 0 <= wo.batch_version < MAX_VERSION:
        raise ConfigError(
            f"option batchVersion must be in 0..{MAX_VERSION - 1}, got {wo.batch_version}"
        )
    if wo.batch_version is not None and wo.producer_id is None:
        raise ConfigError(
            "option batchVersion needs producerId (the pair is what makes a "
            "batch write idempotent, like Delta's txnAppId / txnVersion)"
        )
    return wo


# --- offset ranges -------------------------------------------------------------------


def check_long(seq: int) -> int:
    if seq > MAX_LONG:
        raise ConfigError(
            f"sequence {seq} exceeds Spark's long (2^63-1); this buffer cannot be read by Spark"
        )
    return seq


def pack(
    sizes: Sequence[int], max_bytes: int, min_partitions: int, open_cost: int = OPEN_COST_BYTES
) -> list[range]:
    """Consecutive data objects packed into partitions: index ranges over ``sizes``.

    Spark's rule for small files (``FilePartition``): each object costs its size plus
    ``open_cost``; a partition takes objects while it stays within
    ``min(max_bytes, max(open_cost, total / min_partitions))``, so a small read still
    spreads over ``min_partitions`` tasks and a large one over ``max_bytes`` pieces.
    Order is kept: each partition is a run of consecutive sequences.  ``max_bytes``
    of 0 gives one partition per object.
    """
    n = len(sizes)
    if max_bytes <= 0:
        return [range(i, i + 1) for i in range(n)]
    total = sum(sizes) + open_cost * n
    limit = min(max_bytes, max(open_cost, total // max(1, min_partitions)))
    out: list[range] = []
    lo, acc = 0, 0
    for i, size in enumerate(sizes):
        if i > lo and acc + size > limit:
            out.append(range(lo, i))
            lo, acc = i, 0
        acc += size + open_cost
    if lo < n:
        out.append(range(lo, n))
    return out
