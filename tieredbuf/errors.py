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
* :class:`FencedError` -- "a newer consumer owns the queue"; stop.

and :class:`CorruptError` for bytes that do not decode (invariant I7).
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
    """An object store operation failed (transient or permanent)."""


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


class OutcomeUnknownError(StoreError):
    """The request may or may not have taken effect (timeout, reset).  Do not clean up."""


class ConditionalWritesUnsupportedError(StoreError):
    """The endpoint ignores If-Match / If-None-Match; using it would corrupt the queue."""


class InvalidKeyError(StoreError, ValueError):
    """An object key is malformed (empty, absolute, '..', reserved): a caller bug."""


# --- queue / consumer --------------------------------------------------------


class FencedError(TieredBufError):
    """A newer consumer has initialized (its epoch is higher); this one must stop."""

    def __init__(self, my_epoch: int, current_epoch: int) -> None:
        super().__init__(
            f"consumer fenced: this consumer holds epoch {my_epoch}, "
            f"the manifest is at epoch {current_epoch}"
        )
        self.my_epoch = my_epoch
        self.current_epoch = current_epoch


class NotInitializedError(TieredBufError):
    """The consumer was used before initialize()."""


class AckOrderError(TieredBufError, ValueError):
    """ack() was called out of order (acks must be contiguous)."""


class DataLossError(TieredBufError):
    """Data the manifest refers to (or a sequence asked for) is gone."""


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


class EnqueueTimeoutError(TieredBufError):
    """An append kept failing past the point where its object could be reclaimed by GC."""


class BackpressureError(TieredBufError):
    """A bounded buffer is full and the caller asked not to wait (or the wait timed out)."""


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


# --- local tier ------------------------------------------------------------------


class StageError(TieredBufError):
    """The local staging directory cannot be used."""


class StageLockedError(StageError):
    """Another process holds the staging directory's lock."""


# --- local tier: WAL / segments (issue 3) ---------------------------------------


class ConfigHashMismatchError(UnsupportedVersionError):
    """A WAL was written under a different segment layout contract (Quiver: treated
    exactly like an unknown format version -- drain it with the build that wrote it)."""


class WalFullError(StageError):
    """The WAL hit ``max_size`` or ``max_rotated_files`` and nothing can be reclaimed yet."""
