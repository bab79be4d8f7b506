"""Damaged data objects, as a disk, a bucket or a person with ``aws s3 cp`` makes them
(invariant I10: a record is served only from an object checked against what the manifest
recorded).

Four kinds of damage (:data:`DAMAGES`), each a pure function of the object's bytes
(:func:`damaged`):

* ``replaced`` -- another valid object of the same kind and another size (it decodes);
* ``truncated`` -- cut to half its length;
* ``extended`` -- 16 bytes appended;
* ``flipped`` -- one byte inside a record (or a ``.qseg`` stream) inverted: same size.

Two ways to apply them:

* :func:`damage_object` changes the stored object itself, behind the buffer's back:
  ``how="flipped"`` changes the bytes in place and keeps what the store keeps beside
  them (its metadata: bit rot under the bucket), the others overwrite the object with a
  plain PUT (``aws s3 cp``: the store's metadata goes with the old object).
* :class:`DamagingStore` wraps a store and serves damaged bytes for chosen keys (every
  read: GET, ranged GET, suffix GET, HEAD's size) without touching the store: the fault
  mode for torture harnesses (``tests/faults.py`` holds the other fault-injecting
  stores).
"""

from __future__ import annotations

import builtins
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal
from urllib.parse import urlparse

from tieredbuf import keys
from tieredbuf.config import Compression
from tieredbuf.format.batch import FOOTER_SIZE, decode_batch, encode_batch
from tieredbuf.store.base import (
    GetResult,
    ObjectMeta,
    PutMode,
    Store,
    Stored,
    copy_range,
    put_with_checksum,
)

Damage = Literal["replaced", "truncated", "extended", "flipped"]
DAMAGES: tuple[Damage, ...] = ("replaced", "truncated", "extended", "flipped")


def _other_segment() -> bytes:
    import pyarrow as pa

    from tieredbuf.format.segment import SegmentBundle, encode_segment

    batch = pa.record_batch({"x": pa.array([1, 2, 3], pa.int64())})
    return encode_segment([SegmentBundle({0: batch}, 1, 1)])


def flip_at(data: bytes, location: str) -> int:
    """Where ``flipped`` changes ``data``: inside a record (uncompressed ``.batch``: the
    middle of the record block; zstd: the middle of the compressed block), or the middle
    of a ``.qseg`` object's first stream."""
    if location.endswith(keys.SEGMENT_SUFFIX):
        from tieredbuf.format.segment import SegmentReader

        s = SegmentReader(data, location).streams[0]
        return s.byte_offset + s.byte_length // 2
    return (len(data) - FOOTER_SIZE) // 2


def damaged(data: bytes, how: Damage, location: str) -> bytes:
    """``data`` damaged ``how`` (see the module docstring)."""
    if how == "replaced":
        if location.endswith(keys.SEGMENT_SUFFIX):
            other = _other_segment()
        else:
            ctype = Compression(data[-FOOTER_SIZE])
            recs = decode_batch(data)
            other = encode_batch([*recs[:1], b"not what was produced"], ctype)
        assert len(other) != len(data)
        return other
    if how == "truncated":
        return data[: len(data) // 2]
    if how == "extended":
        return data + bytes(range(16))
    if how == "flipped":
        at = flip_at(data, location)
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
    raise ValueError(f"unknown damage {how!r}")


def damage_object(store: Store, url: str, key: str, how: Damage) -> bytes:
    """Damage the stored object ``key`` of the buffer at ``url`` ``how``; returns the new
    bytes.  ``flipped`` writes in place where it can (a ``file://`` buffer: the file's
    extended attributes stay), else like the others: one plain PUT over the object."""
    data = store.get(key).data
    new = damaged(data, how, key)
    u = urlparse(url)
    if how == "flipped" and u.scheme == "file":
        at = flip_at(data, key)
        path = os.path.join(u.path, *key.split("/"))
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, new[at : at + 1], at)
            os.fsync(fd)
        finally:
            os.close(fd)
        return new
    store.put(key, new, mode="overwrite")
    return new


class DamagingStore:
    """A Store that serves ``damaged`` bytes for the keys :meth:`damage` names (every
    read of them: GET, ranged and suffix GETs, HEAD's size); writes and other keys pass
    through.  Thread-safe.  ``reads[key]`` counts the reads served damaged."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._damage: dict[str, Damage] = {}
        self.reads: dict[str, int] = {}

    @property
    def inner(self) -> Store:
        return self._inner

    @property
    def url(self) -> str:
        return self._inner.url

    def damage(self, key: str, how: Damage) -> None:
        with self._lock:
            self._damage[key] = how

    def heal(self, key: str | None = None) -> None:
        with self._lock:
            if key is None:
                self._damage.clear()
            else:
                self._damage.pop(key, None)

    def _bytes(self, key: str) -> bytes | None:
        with self._lock:
            how = self._damage.get(key)
            if how is not None:
                self.reads[key] = self.reads.get(key, 0) + 1
        if how is None:
            return None
        return damaged(self._inner.get(key).data, how, key)

    def get(self, key: str) -> GetResult:
        bad = self._bytes(key)
        got = self._inner.get(key)
        return got if bad is None else GetResult(bad, got.etag, got.crc32)

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        bad = self._bytes(key)
        got = self._inner.get_if_changed(key, etag)
        return got if bad is None or got is None else GetResult(bad, got.etag, got.crc32)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        bad = self._bytes(key)
        return self._inner.get_range(key, start, end) if bad is None else bad[start:end]

    def read_into(self, key: str, start: int, out: memoryview) -> Stored | None:
        bad = self._bytes(key)
        if bad is None:
            return copy_range(self._inner, key, start, out)
        got = bad[start : start + len(out)]
        out[: len(got)] = got
        kept = self._inner.get(key).crc32  # what the store keeps beside it is unchanged
        return Stored(len(bad), kept)

    def get_suffix(self, key: str, length: int) -> bytes:
        bad = self._bytes(key)
        if bad is None:
            return self._inner.get_suffix(key, length)
        return bad[max(0, len(bad) - length) :]

    def head(self, key: str) -> ObjectMeta:
        meta = self._inner.head(key)
        bad = self._bytes(key)
        if bad is None:
            return meta
        return ObjectMeta(meta.key, len(bad), meta.etag, meta.last_modified)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        return self._inner.put(key, data, mode=mode)

    def put_checksummed(
        self, key: str, data: bytes | memoryview, crc32: int, *, mode: PutMode = "create"
    ) -> str:
        return put_with_checksum(self._inner, key, data, crc32, mode=mode)

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        return self._inner.put_multipart(key, chunks, mode=mode)

    def copy(self, src: str, dst: str) -> None:
        self._inner.copy(src, dst)

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        for m in self._inner.list(prefix):
            bad = self._bytes(m.key) if m.key in self._damage else None
            yield m if bad is None else ObjectMeta(m.key, len(bad), m.etag, m.last_modified)

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        return self._inner.delete_many(keys)

    def close(self) -> None:
        self._inner.close()
