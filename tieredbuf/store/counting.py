"""Count a store's requests by operation and by object kind: what an object store bills.

Every :class:`tieredbuf.Buffer` wraps its store in a :class:`MeteredStore`, so every
role (producers, the exporter, consumers, readers, GC, inspect) counts the requests it
sends.  An operation is one of

==================  ===================================================================
``get``             GET of a whole object, and a conditional GET (``get_if_changed``,
                    If-None-Match) whether it answered 304 or the object: S3 bills both
                    as a GET
``get_range``       ranged GET (``get_range``, ``read_into``, and ``get_suffix``: the
                    22-byte footer)
``head``            HEAD
``put``             unconditional PUT (a multipart upload: initiate + parts + complete)
``put_conditional`` PUT with If-None-Match: * (create) or If-Match (CAS)
``copy``            server-side copy (S3 CopyObject; priced as a PUT), by the new key's kind
``list``            LIST, one per page of up to 1000 keys (S3's page size), at least one
``delete``          DeleteObjects, one per batch of up to 1000 keys (a store with no
                    batch delete, GCS, says so with ``delete_batch = 1``: one per key)
==================  ===================================================================

and the kind is :func:`tieredbuf.keys.key_kind` of the key (for a LIST, of the
prefix): ``data``, ``root``, ``group``, ``subscriber``, ``probe`` or ``other``.

A request is counted when it is sent, whether it succeeds or not: a conditional PUT
that loses (PreconditionFailed, AlreadyExists) is a request and is billed, and is
also counted in :attr:`RequestCounts.conflicts`.  The S3 backend reports the few
requests it sends on its own (the once-per-process conditional-write probe, the
once-per-store LIST that tells a missing bucket from a missing object, the
one-by-one deletes after a failed bulk delete, the full GET after a server refused
a range) through the same counter; so does the GCS backend (its probe and bucket
check).  A GCS resumable upload (an object over 8 MiB: two HTTP requests) is counted as
the one Class A operation GCS bills for it.  Not counted: retries inside the S3 client
(obstore retries a request that timed out or got a 5xx up to ``max_retries`` times;
those surface as transient-error counters when they finally fail).
"""

from __future__ import annotations

import builtins
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from tieredbuf.errors import ConflictError
from tieredbuf.keys import KINDS, key_kind
from tieredbuf.store.base import (
    GetResult,
    ObjectMeta,
    PutMode,
    Store,
    Stored,
    copy_range,
    put_with_checksum,
)

OPS = ("get", "get_range", "head", "put", "put_conditional", "copy", "list", "delete")
"""Every operation a request is counted under."""
OP_NAMES = {
    "get": "GET",
    "get_range": "ranged GET",
    "head": "HEAD",
    "put": "PUT",
    "put_conditional": "conditional PUT",
    "copy": "COPY",
    "list": "LIST",
    "delete": "DELETE",
}
LIST_PAGE = 1000
"""Keys per LIST response (S3 ListObjectsV2's maximum)."""
DELETE_BATCH = 1000
"""Keys per DeleteObjects request (S3's maximum)."""
MULTIPART_CHUNK = 8 << 20


class RequestCounts:
    """Thread-safe request counts by (operation, kind); one per buffer (or shared)."""

    __slots__ = ("_conflicts", "_lock", "_n")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: dict[tuple[str, str], int] = {}
        self._conflicts: dict[str, int] = {}

    def add(self, op: str, key: str, n: int = 1) -> None:
        """Count ``n`` requests of ``op`` on ``key`` (a key or a list prefix)."""
        if n <= 0:
            return
        slot = (op, key_kind(key))
        with self._lock:
            self._n[slot] = self._n.get(slot, 0) + n

    def conflict(self, key: str) -> None:
        """A conditional PUT on ``key`` was refused (already counted as a request)."""
        kind = key_kind(key)
        with self._lock:
            self._conflicts[kind] = self._conflicts.get(kind, 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        """{(op, kind): requests} so far."""
        with self._lock:
            return dict(self._n)

    @property
    def conflicts(self) -> dict[str, int]:
        """{kind: conditional PUTs refused} so far."""
        with self._lock:
            return dict(self._conflicts)

    def total(self, op: str | None = None, kind: str | None = None) -> int:
        """Requests so far, of one operation and/or kind (None: all)."""
        return sum(
            n
            for (o, k), n in self.snapshot().items()
            if (op is None or o == op) and (kind is None or k == kind)
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"total": n, "by_op": {...}, "by_kind": {...}, "requests":
        {op: {kind: n}}, "conflicts": {kind: n}}`` (zeros left out)."""
        snap = self.snapshot()
        nested: dict[str, dict[str, int]] = {}
        by_op: dict[str, int] = {}
        by_kind: dict[str, int] = {}
        for (op, kind), n in sorted(snap.items()):
            nested.setdefault(op, {})[kind] = n
            by_op[op] = by_op.get(op, 0) + n
            by_kind[kind] = by_kind.get(kind, 0) + n
        return {
            "total": sum(snap.values()),
            "by_op": by_op,
            "by_kind": by_kind,
            "requests": nested,
            "conflicts": self.conflicts,
        }


def diff(
    after: Mapping[tuple[str, str], int], before: Mapping[tuple[str, str], int]
) -> dict[tuple[str, str], int]:
    """The requests between two :meth:`RequestCounts.snapshot` results (zeros left out)."""
    out = {k: v - before.get(k, 0) for k, v in after.items()}
    return {k: v for k, v in out.items() if v}


def _is_conditional(mode: PutMode) -> bool:
    return mode != "overwrite"


class MeteredStore:
    """A Store that forwards to ``inner`` and counts each request it sends."""

    def __init__(self, inner: Store, counts: RequestCounts | None = None) -> None:
        self._inner = inner
        self.counts = counts or RequestCounts()
        attach = getattr(inner, "attach_meter", None)
        if attach is not None:  # the backend's own requests (probe, bucket check)
            attach(self.counts)

    @property
    def inner(self) -> Store:
        return self._inner

    @property
    def url(self) -> str:
        return self._inner.url

    def __repr__(self) -> str:
        return f"MeteredStore({self._inner!r})"

    def __getattr__(self, name: str) -> Any:
        # backend extras (LocalDirStore.root, ObjStore.s3, ...) stay reachable
        return getattr(self._inner, name)

    def get(self, key: str) -> GetResult:
        self.counts.add("get", key)
        return self._inner.get(key)

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        self.counts.add("get", key)  # a 304 is billed as a GET too
        return self._inner.get_if_changed(key, etag)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # an empty range is a HEAD (it must still report a missing key)
        self.counts.add("head" if end == start else "get_range", key)
        return self._inner.get_range(key, start, end)

    def read_into(self, key: str, start: int, out: memoryview) -> Stored | None:
        self.counts.add("head" if not len(out) else "get_range", key)
        return copy_range(self._inner, key, start, out)

    def get_suffix(self, key: str, length: int) -> bytes:
        self.counts.add("head" if length == 0 else "get_range", key)
        return self._inner.get_suffix(key, length)

    def head(self, key: str) -> ObjectMeta:
        self.counts.add("head", key)
        return self._inner.head(key)

    def _put(self, key: str, mode: PutMode, n: int, call: Any) -> str:
        self.counts.add("put_conditional" if _is_conditional(mode) else "put", key, n)
        try:
            etag: str = call()
        except ConflictError:
            if _is_conditional(mode):
                self.counts.conflict(key)
            raise
        return etag

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        return self._put(key, mode, 1, lambda: self._inner.put(key, data, mode=mode))

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        if _is_conditional(mode):  # one conditional PUT of the joined body (every backend)
            return self._put(
                key, mode, 1, lambda: self._inner.put_multipart(key, chunks, mode=mode)
            )
        # a multipart upload: initiate, one request per part, complete
        body = list(chunks)
        size = sum(memoryview(c).nbytes for c in body)
        n = 2 + max(1, math.ceil(size / MULTIPART_CHUNK))
        return self._put(key, mode, n, lambda: self._inner.put_multipart(key, body, mode=mode))

    def put_checksummed(
        self, key: str, data: bytes | memoryview, crc32: int, *, mode: PutMode = "create"
    ) -> str:
        """A PUT keeping ``crc32`` beside the object where the inner store can
        (KeepsChecksums), else a plain one."""
        return self._put(
            key, mode, 1, lambda: put_with_checksum(self._inner, key, data, crc32, mode=mode)
        )

    def put_link(self, key: str, link: Callable[[str], None], *, crc32: int | None = None) -> None:
        """A local-directory store's object as a hard link (LocalDirStore.put_link): one
        create-if-absent PUT.  Only for an inner store that has it (LinkingStore)."""
        put_link = getattr(self._inner, "put_link", None)
        if put_link is None:
            raise TypeError(f"{self._inner!r} cannot take an object as a hard link")

        def call() -> str:
            if crc32 is None:
                put_link(key, link)
            else:
                put_link(key, link, crc32=crc32)
            return ""

        self._put(key, "create", 1, call)

    def copy(self, src: str, dst: str) -> None:
        self.counts.add("copy", dst)
        self._inner.copy(src, dst)

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        self.counts.add("list", prefix)
        for seen, m in enumerate(self._inner.list(prefix)):
            if seen and seen % LIST_PAGE == 0:
                self.counts.add("list", prefix)  # the next page
            yield m

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        # one DeleteObjects per batch, counted under its first key's kind (GC deletes
        # data objects and tree nodes in separate batches)
        batch = getattr(self._inner, "delete_batch", DELETE_BATCH)
        for i in range(0, len(keys), batch):
            self.counts.add("delete", keys[i])
        return self._inner.delete_many(keys)

    def close(self) -> None:
        self._inner.close()


__all__ = [
    "DELETE_BATCH",
    "KINDS",
    "LIST_PAGE",
    "OPS",
    "OP_NAMES",
    "MeteredStore",
    "RequestCounts",
    "diff",
]
