"""The one error tree of tieredbuf.

Every error the package raises on purpose derives from :class:`TieredBufError`.
Three families are kept strictly apart, because callers must react to them
differently (pyiceberg's CommitFailed / CommitStateUnknown split):

* :class:`ConflictError` -- "someone else moved first; refresh and retry".
  NOTE: against a real store a conflict alone never proves that *our* write did
  not land (obstore retries a PUT whose response was lost, and the retry then
  meets our own first write).  The queue therefore re-reads and checks its
  watermark after every conflict (invariant I2).
* :class:`OutcomeUnknownError` -- "the request may or may not have taken
  effect"; never clean up after it.
* :class:`FencedError` -- "a newer instance of this subscriber owns its position"; stop.

and :class:`CorruptError` for bytes that do not decode (invariant I7).

Store failures are split by what a retry can do about them:

* :class:`PermanentStoreError` -- credentials rejected or missing, access denied, the
  bucket missing, an endpoint that ignores conditional writes, a malformed key.  A
  retry loop stops at once; nothing changes until someone fixes the cause.
* :class:`TransientStoreError` -- connection refused or reset, timeouts, 5xx,
  SlowDown.  Retried with jittered backoff.  :class:`StoreUnreachableError` says the
  request was never sent; :class:`OutcomeUnknownError` says a write may have landed.
"""

from __future__ import annotations


class TieredBufError(Exception):
    """Root of every error tieredbuf raises on purpose."""


class ConfigError(TieredBufError, ValueError):
    """A configuration value or URL is invalid."""


class ClosedError(TieredBufError):
    """The producer, consumer or stage was used after close()."""


# --- store -----------------------------------------------------------------


class StoreError(TieredBufError):
    """An object store operation failed.  Loops retry every StoreError that is not a
    :class:`PermanentStoreError` (an unclassified one counts as transient)."""


class PermanentStoreError(StoreError):
    """Retrying will not help until someone changes something: the credentials, a
    permission, the bucket, the endpoint or the key.  Retry loops stop at once; staged
    data stays staged (``tieredbuf drain`` exports it once the store works)."""


class CredentialsError(PermanentStoreError):
    """The store rejected the credentials (unknown key, bad signature, expired token,
    clock skew) or none could be found."""


class MissingCredentialsError(CredentialsError, ConfigError):
    """No credentials are configured for an ``s3://`` URL (found before any request)."""


class AccessDeniedError(PermanentStoreError):
    """The credentials are valid but lack a permission (403 AccessDenied)."""


class BucketNotFoundError(PermanentStoreError):
    """The bucket named by the URL does not exist."""

    def __init__(self, bucket: str, message: str) -> None:
        super().__init__(message)
        self.bucket = bucket


class TransientStoreError(StoreError):
    """A failure that may go away by itself (connection refused or reset, timeout, 5xx,
    SlowDown): retried with jittered backoff."""


class ThrottledError(TransientStoreError):
    """The store refused a request for its request rate (HTTP 429, S3 SlowDown, Azure
    ServerBusy; GCS and R2 allow about one write per second to one key): not applied.
    Retried after at least a second."""


class StoreUnreachableError(TransientStoreError):
    """The request was never sent: connection refused, no route, the host name does not
    resolve.  A write that fails this way did not land."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """The object does not exist."""

    def __init__(self, key: str, message: str | None = None) -> None:
        super().__init__(message or f"object not found: {key}")
        self.key = key


class ConflictError(StoreError):
    """A conditional write lost: refresh and retry.  It may still have landed."""

    def __init__(self, key: str, message: str | None = None) -> None:
        super().__init__(message or f"conditional write conflict on {key}")
        self.key = key


class AlreadyExistsError(ConflictError):
    """A create-if-absent PUT found the key already present."""


class PreconditionFailedError(ConflictError):
    """A replace-if-match PUT found a different version than expected."""


class OutcomeUnknownError(TransientStoreError):
    """A write was sent and may or may not have taken effect (timeout or connection reset
    after sending, 5xx).  Do not clean up; decide from a fresh read."""


class ConditionalWritesUnsupportedError(PermanentStoreError):
    """The endpoint ignores If-Match / If-None-Match; using it would corrupt the queue."""


class InvalidKeyError(PermanentStoreError, ValueError):
    """An object key is malformed (empty, absolute, '..', reserved): a caller bug."""


# --- queue / consumer --------------------------------------------------------


class FencedError(TieredBufError):
    """A newer instance of the same subscriber has initialized (its epoch is higher); this
    one must stop.  Other subscribers are never fenced by it."""

    def __init__(self, my_epoch: int, current_epoch: int, subscriber: str = "default") -> None:
        where = "the manifest" if subscriber == "default" else "its progress object"
        super().__init__(
            f"consumer fenced: another instance of subscriber {subscriber!r} took over at "
            f"epoch {current_epoch} in {where} (this one holds epoch {my_epoch}); stop this "
            f"consumer -- its unflushed acks are re-read by the new owner -- or, if the other "
            f"one is gone, call initialize() again to take it back (that fences it)"
        )
        self.my_epoch = my_epoch
        self.current_epoch = current_epoch
        self.subscriber = subscriber


class SubscriberRemovedError(FencedError):
    """The subscriber was removed (``remove_subscriber``): its live instances must stop."""

    def __init__(self, subscriber: str, my_epoch: int = 0) -> None:
        TieredBufError.__init__(
            self,
            f"subscriber {subscriber!r} was removed (remove_subscriber): this instance "
            "must stop; initialize() again registers it afresh",
        )
        self.my_epoch = self.current_epoch = my_epoch
        self.subscriber = subscriber


class LeaseExpiredError(TieredBufError):
    """A worker's ack or reject came after its lease lapsed and another claim re-leased the
    entry: nothing changed for those sequences (the entry is acked by whoever holds it)."""

    def __init__(self, subscriber: str, sequences: list[int]) -> None:
        super().__init__(
            f"subscriber {subscriber!r}: the leases on sequences {sequences} lapsed and were "
            "claimed again by another worker; these acks/rejects changed nothing"
        )
        self.subscriber = subscriber
        self.sequences = sequences


class NotInitializedError(TieredBufError):
    """The consumer was used before initialize()."""


class AckOrderError(TieredBufError, ValueError):
    """ack() was called out of order (acks must be contiguous)."""


class DataLossError(TieredBufError):
    """Data the manifest refers to (or a sequence asked for) is gone."""


class MissingObjectError(DataLossError):
    """A data object an entry names is missing from the store.  Raised only after the root
    was read again and still links the entry (else it was retention's unlinking: a
    ``DataLossError`` saying so, or a skip with ``on_lost="skip"``)."""

    def __init__(self, message: str, location: str, sequence: int) -> None:
        super().__init__(message)
        self.location = location
        self.sequence = sequence


class StagedDataLossError(DataLossError):
    """A sealed segment in a stage failed its CRC check: it was quarantined (renamed
    ``.corrupt``), never uploaded, and its records are lost unless the WAL still held
    them.  Names the file and the per-core sequences."""

    def __init__(self, path: str, sequences: tuple[tuple[int, int], ...], why: str) -> None:
        super().__init__(
            f"staged segment {path} is corrupt ({why}): quarantined, not uploaded; the "
            f"records of per-core sequences {list(sequences)} are lost"
        )
        self.path = path
        self.sequences = sequences


class BufferNotFoundError(TieredBufError):
    """No buffer (no ``queue/manifest``) exists at the URL: a reader never creates one.

    Only producers (and an explicit ``Buffer.create()``) create a buffer, so a mistyped
    URL fails loudly instead of reading as an empty queue."""

    def __init__(self, url: str, detail: str = "") -> None:
        why = f": {detail}" if detail else ""
        super().__init__(
            f"no tieredbuf buffer at {url} (no queue/manifest there){why}; "
            "check the URL, or create it by producing to it"
        )
        self.url = url


class ProducerIdReusedError(TieredBufError):
    """An append's producer id already has a watermark past (or inside) this append's
    numbers that this append did not write: another writer uses the same producer id.

    Raised only by appends that ask for it (``ManifestQueue.append(strict=True)``: the
    Spark sink); treating the numbers as already appended would silently drop the data."""

    def __init__(
        self, producer_id: str, recorded: int, attempted: int, message: str | None = None
    ) -> None:
        super().__init__(
            message
            or (
                f"producer id {producer_id!r} has already appended up to number {recorded}; "
                f"this append ends at {attempted} and did not land before: another writer "
                "uses the same producer id"
            )
        )
        self.producer_id = producer_id
        self.recorded = recorded
        self.attempted = attempted


class RemoteUnconfirmedError(TieredBufError):
    """A write cannot be confirmed REMOTE: its writer's watermark in the root covers it,
    but no entry naming its data object is linked any more (I10: REMOTE only from the
    write's own entry located in a manifest).  Either it was appended and dequeued before
    this process saw its entry, or another writer appended under the same producer id.
    The handle fails with this instead of guessing; the write is not retried (it would
    be a duplicate in the first case).  Names the writer, its append numbers and the
    data objects looked for."""

    def __init__(self, producer_id: str, producer_seqs: list[int], locations: list[str]) -> None:
        super().__init__(
            f"writer {producer_id!r}: appends {producer_seqs} are covered by its watermark but "
            f"no linked entry names {', '.join(locations)}: appended and already dequeued, or "
            "appended by another writer with the same producer id; not confirmed REMOTE and "
            "not retried"
        )
        self.producer_id = producer_id
        self.producer_seqs = producer_seqs
        self.locations = locations


class ServiceError(TieredBufError):
    """A write through ``tieredbuf serve`` (:mod:`tieredbuf.client`) failed.  ``status``:
    the HTTP status of the last answer (None: none came); ``may_have_landed``: an
    attempt's outcome is unknown (sent, and no answer or a 5xx came back), so the
    service may have stored it."""

    def __init__(
        self, message: str, *, status: int | None = None, may_have_landed: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.may_have_landed = may_have_landed


class ServiceRefusedError(ServiceError):
    """The service refused the request and no retry would change that (400, 401, 403,
    413, 415, 422; a certificate that does not verify): this attempt stored nothing."""


class ServiceUnavailableError(ServiceError):
    """Every attempt failed with an error worth retrying (503, 504, 409, a connection
    refused or lost, a timeout) until the client's ``give_up_after``."""


class RemoteNotRequestedError(ServiceError):
    """A REMOTE wait on a write sent with ``durability="local"``: the service was asked
    for LOCAL only, so REMOTE is never confirmed to this client."""


class BackpressureError(TieredBufError):
    """A bounded buffer is full and the caller asked not to wait (or the wait timed out)."""


class FlushTimeoutError(TieredBufError, TimeoutError):
    """close(), flush() or drain ran out of time; the message says what is not REMOTE yet
    and where it is (a stage directory, or memory for a stateless producer)."""


class OutputError(TieredBufError):
    """A command's output (stdout, ``--out``) could not be written: a full disk, a path
    nobody can create.  What was not written was not acknowledged (I10)."""


class OutputClosedError(OutputError):
    """The reader of a command's output went away (a closed pipe, as ``| head`` does):
    the command stops quietly, as ``cat`` does, having acked only what was written."""


class ForkedError(TieredBufError):
    """An object that owns threads was created before ``fork()`` and used in the child,
    where its threads do not exist.  Create it after the fork."""


# --- formats -------------------------------------------------------------------


class CorruptError(TieredBufError):
    """Bytes failed to decode.  Names the object and the byte offset (invariant I7)."""

    def __init__(self, what: str, obj: str | None, offset: int, detail: str) -> None:
        where = obj if obj is not None else "<bytes>"
        super().__init__(f"corrupt {what} in {where} at offset {offset}: {detail}")
        self.what = what
        self.obj = obj
        self.offset = offset
        self.detail = detail


class UnsupportedVersionError(CorruptError):
    """The bytes carry a format version this build does not know."""


class DamagedObjectError(CorruptError):
    """A data object is not what the manifest recorded: another size, or a checksum that
    does not match (replaced, cut short, extended or changed behind the buffer's back).
    No record of it is served and nothing is acked past it (invariant I10).

    ``recorded`` and ``found`` are the sizes (equal when only the checksum differs);
    ``offset`` is where the two objects start to differ as far as is known: the shorter
    size for a size mismatch, 0 for a checksum."""

    def __init__(
        self, location: str, sequence: int, offset: int, detail: str, recorded: int, found: int
    ) -> None:
        super().__init__("data object", location, offset, f"sequence {sequence}: {detail}")
        self.location = location
        self.sequence = sequence
        self.recorded = recorded
        self.found = found


# --- local tier ------------------------------------------------------------------


class StageError(TieredBufError):
    """The local staging directory cannot be used."""


class StageLockedError(StageError):
    """Another process holds the staging directory's lock."""


class StageBufferMismatchError(StageError, ConfigError):
    """A staging directory holds records for another buffer than the one it was opened
    with: exporting them there would put them where nobody meant them to go.  Nothing
    is exported; the stage keeps its records (drain it into its own buffer)."""

    def __init__(self, message: str, stage: str, bound: dict[str, object]) -> None:
        super().__init__(message)
        self.stage = stage
        self.bound = bound


class DiskError(StageError):
    """A disk operation of the stage failed.  The write that raised it (or whose
    future carries it) was NOT acknowledged LOCAL -- though, like an outcome-unknown
    store write, its record may still reach the queue (its bytes may have reached the
    disk, or a segment); nothing acknowledged earlier is affected.  The stage retries
    on its own: appends work again once the disk does (docs/failure-modes.md)."""

    def __init__(self, message: str, errno: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.path = path


class DiskFullError(DiskError):
    """The stage's disk is full (ENOSPC, EDQUOT)."""


class DiskIOError(DiskError):
    """Any other failed disk operation (EIO above all: after a failed fdatasync the
    page cache cannot be trusted, so the stage never retries one on the same data)."""


# --- local tier: WAL / segments --------------------------------------------------


class ConfigHashMismatchError(UnsupportedVersionError):
    """A WAL was written under a different segment layout contract (Quiver: treated
    exactly like an unknown format version -- drain it with the build that wrote it)."""


class WalFullError(StageError):
    """The WAL hit ``max_size`` or ``max_rotated_files`` and nothing can be reclaimed yet."""
