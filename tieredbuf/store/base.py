"""The Store contract every backend implements (memory, local directory, S3).

A store is rooted at the buffer URL: keys are relative (see :mod:`tieredbuf.keys`).
Conditional writes are one typed parameter, as in obstore:

* ``mode="create"``      -- If-None-Match: * ; an existing key raises AlreadyExistsError
* ``mode="overwrite"``   -- unconditional
* ``mode=IfMatch(etag)`` -- If-Match: etag ; another version raises PreconditionFailedError,
                            a missing key raises ObjectNotFoundError or PreconditionFailedError
                            (S3 servers differ: moto 404, SeaweedFS 412)

A conditional read is one method: ``get_if_changed(key, etag)`` sends If-None-Match:
etag and returns None while the object is unchanged (304, no body), the object once it
changed: a watcher of one object polls and reads it in one request.

Errors are from :mod:`tieredbuf.errors`: ObjectNotFoundError, AlreadyExistsError,
PreconditionFailedError, OutcomeUnknownError (timeout / connection reset: the write
may have landed), StoreError for everything else.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class IfMatch:
    """Replace only if the current version's etag equals ``etag``."""

    etag: str


PutMode = Literal["create", "overwrite"] | IfMatch


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    key: str
    size: int
    etag: str | None
    last_modified: datetime | None


class GetResult:
    """An object's bytes and its version token (``etag``, to pass back in IfMatch).

    ``etag`` may be given as a function of nothing, called on first use: the local
    directory store's etag is a hash of the content, which a reader of data objects
    (never written twice) does not need to pay for.  ``crc32``: the checksum its writer
    kept beside it in the store's metadata (:class:`KeepsChecksums`), None for none.
    """

    __slots__ = ("_etag", "_etag_of", "crc32", "data")

    def __init__(
        self, data: bytes, etag: str | Callable[[], str], crc32: int | None = None
    ) -> None:
        self.data = data
        self._etag: str | None = None if callable(etag) else etag
        self._etag_of: Callable[[], str] | None = etag if callable(etag) else None
        self.crc32 = crc32

    @property
    def etag(self) -> str:
        if self._etag is None:
            assert self._etag_of is not None
            self._etag, self._etag_of = self._etag_of(), None
        return self._etag

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GetResult):
            return NotImplemented
        return self.data == other.data and self.etag == other.etag

    __hash__ = None  # type: ignore[assignment]  # holds a lazily filled cache

    def __repr__(self) -> str:
        return f"GetResult(data=<{len(self.data)} bytes>, etag={self.etag!r})"


@runtime_checkable
class Store(Protocol):
    """Object storage rooted at one buffer URL."""

    @property
    def url(self) -> str: ...

    def get(self, key: str) -> GetResult: ...

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        """The object, unless its etag is still ``etag`` (then None): one GET with
        If-None-Match, which the store answers 304 without a body while unchanged.  A store
        that ignores the header answers 200 with the object, and the etag comparison here
        decides.  ObjectNotFoundError when absent."""
        ...

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object."""
        ...

    def get_suffix(self, key: str, length: int) -> bytes:
        """The last ``length`` bytes (all of it when shorter)."""
        ...

    def head(self, key: str) -> ObjectMeta: ...

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        """Write ``data``; returns the new etag."""
        ...

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        """Write a large object from chunks (multipart on S3); returns the new etag."""
        ...

    def copy(self, src: str, dst: str) -> None:
        """Copy object ``src`` to the new key ``dst`` inside the store, without the bytes
        passing through this process where the backend can (S3 CopyObject; a hard link
        on a local directory).  ``dst`` must be a fresh key (a new ULID): S3 has no
        conditional copy.  A missing ``src`` raises ObjectNotFoundError."""
        ...

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        """Every object whose key starts with ``prefix`` (order not guaranteed)."""
        ...

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        """Delete ``keys``; missing keys are not failures. Returns the failures."""
        ...

    def close(self) -> None: ...


DEFAULT_MANIFEST_WRITES_PER_S = 5.0
"""The manifest write budget (appends per second per buffer, all writers together) on a
store with no per-key write limit: S3, Azure Blob, a local directory, memory."""
KEY_LIMITED_MANIFEST_WRITES_PER_S = 1.0
"""The budget on a store that allows about one write per second to one key (Google
Cloud Storage, Cloudflare R2: beyond it they answer 429)."""


def manifest_writes_per_s(store: object) -> float:
    """The default manifest write budget on ``store``: its ``manifest_writes_per_s``
    attribute when it has one (wrappers forward it), else
    :data:`DEFAULT_MANIFEST_WRITES_PER_S`."""
    value = getattr(store, "manifest_writes_per_s", None)
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return DEFAULT_MANIFEST_WRITES_PER_S


@dataclass(frozen=True, slots=True)
class Stored:
    """What a ranged read's response said about the object it came from."""

    size: int
    """The object's size in bytes."""
    crc32: int | None = None
    """The checksum its writer kept beside it (:class:`KeepsChecksums`), if any."""


@runtime_checkable
class ReadsInto(Protocol):
    """A store that reads a range of an object straight into the caller's buffer: a
    reader assembling a large object from parallel ranged GETs then holds the object
    once, with no copy of each part on the way (local directory: ``preadv``; obstore and
    botocore: the response body streamed in small chunks).  Not part of :class:`Store`:
    a store without it is read with ``get_range``."""

    def read_into(self, key: str, start: int, out: memoryview) -> Stored | None:
        """Write bytes ``[start, start + len(out))`` of ``key`` into ``out`` and return
        what the response that carried them said of the object: its size and checksum
        (None: this store cannot tell; a HEAD can give the size).  When the object ends
        before ``start + len(out)``, only the bytes it has are written: the caller
        compares the size.  ObjectNotFoundError when absent."""
        ...


def has_own(store: object, method: str) -> bool:
    """True when ``store``'s class defines ``method``: a wrapper that forwards what it does
    not define (``__getattr__``) does not have it, so the calls it intercepts (``put``,
    ``get_range``) are not bypassed through its inner store's extras."""
    return callable(getattr(type(store), method, None))


def reads_into(store: object) -> bool:
    """``store`` implements :class:`ReadsInto` itself (see :func:`has_own`)."""
    return has_own(store, "read_into")


def copy_range(store: Store, key: str, start: int, out: memoryview) -> Stored | None:
    """:meth:`ReadsInto.read_into` on any store: through it where the store has it, else a
    ranged GET copied into ``out`` (nothing known of the object: None)."""
    if reads_into(store):
        return store.read_into(key, start, out)  # type: ignore[attr-defined,no-any-return]
    got = store.get_range(key, start, start + len(out))
    out[: len(got)] = got
    return None


@runtime_checkable
class KeepsChecksums(Protocol):
    """A store that keeps a data object's CRC32 beside it, in the metadata its service
    keeps with an object (S3 user metadata ``x-amz-meta-tieredbuf_crc32``, Azure
    ``x-ms-meta-tieredbuf_crc32``, obstore's memory store attributes, the local
    directory's extended attribute ``user.tieredbuf.crc32``), and gives it back with
    every GET (``GetResult.crc32``) and ranged read (``Stored.crc32``).  The object's
    bytes stay exactly what the format says (RFC 0001's data batch has no room for a
    checksum): docs/format.md, "Checksums".  Not part of :class:`Store`: a store
    without it writes none."""

    def put_checksummed(
        self, key: str, data: bytes | memoryview, crc32: int, *, mode: PutMode = "create"
    ) -> str:
        """:meth:`Store.put` keeping ``crc32`` (of ``data``) beside the object."""
        ...


def put_with_checksum(
    store: Store, key: str, data: bytes | memoryview, crc32: int | None, *, mode: PutMode
) -> str:
    """Put ``data`` with its checksum where the store keeps one, else plainly."""
    if crc32 is not None and has_own(store, "put_checksummed"):
        return store.put_checksummed(key, data, crc32, mode=mode)  # type: ignore[attr-defined,no-any-return]
    return store.put(key, data, mode=mode)


@runtime_checkable
class LinkingStore(Protocol):
    """A store that can take an object as a hard link of a local file (the local
    directory store): the local tier's exporter then hands over a sealed segment
    without copying its bytes.  Not part of :class:`Store`: S3 and memory cannot."""

    def put_link(self, key: str, link: Callable[[str], None], *, crc32: int | None = None) -> None:
        """Create ``key`` (create-if-absent) from a file ``link(tmp)`` links to the temp
        path ``tmp``, keeping ``crc32`` beside it; see LocalDirStore.put_link."""
        ...
