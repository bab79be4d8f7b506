"""An idempotency tag: a produce() call's ``Idempotency-Key``, carried in its metadata item
(pure codec).

A call made with an idempotency key (the service's ``Idempotency-Key`` header, or
``produce(..., idempotency_key=...)``) carries the key's digest, a fingerprint of what
it wrote and the key's time in front of its metadata payload, through the stage, the
data object's announcement and the manifest entry: whoever commits can tell a retry of
a call already in the queue and append it once (docs/architecture.md, "Idempotent
produce").  Layout of the metadata payload, little-endian::

    magic        9 bytes = b"\\x00tb-idem\\x01"
    key_digest  16 bytes   SHA-256 of the key's UTF-8, first 16 bytes
    fingerprint 16 bytes   SHA-256 of what the call wrote (records, metadata), first 16
    key_ms       i64       the time a ULID key names (its last 26 characters), else -1
    payload      ...       the call's own metadata, as given

A payload that does not start with the magic is an untagged call's own metadata.  The
decoder checks the magic and the length (I7); a tagged payload cut short is CorruptError.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ulid import ULID

from tieredbuf.errors import CorruptError

MAGIC = b"\x00tb-idem\x01"
WHAT = "idempotency tag"
_FIXED = struct.Struct("<16s16sq")
HEADER = len(MAGIC) + _FIXED.size
MAX_KEY_BYTES = 255
"""The longest key accepted (the IETF draft names no limit; Stripe takes 255)."""


@dataclass(frozen=True, slots=True)
class Tag:
    key_digest: bytes
    fingerprint: bytes
    key_ms: int
    """The key's own time (a ULID key), or -1."""
    payload: bytes
    """The call's own metadata."""


def digest(key: str) -> bytes:
    """The 16 bytes a key is known by (its SHA-256's first half)."""
    raw = key.encode("utf-8")
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"an idempotency key has 1..{MAX_KEY_BYTES} bytes")
    return hashlib.sha256(raw).digest()[:16]


def fingerprint(records: Sequence[bytes], metadata: bytes) -> bytes:
    """What a call wrote, as 16 bytes: its records (each length-prefixed) and metadata."""
    h = hashlib.sha256()
    h.update(struct.pack("<Q", len(metadata)))
    h.update(metadata)
    for r in records:
        h.update(struct.pack("<Q", len(r)))
        h.update(r)
    return h.digest()[:16]


def key_ms(key: str) -> int:
    """The time a key ending in a ULID names (ms), else -1."""
    if len(key) < 26:
        return -1
    try:
        return int(ULID.from_str(key[-26:]).milliseconds)
    except ValueError:
        return -1


def tag(key: str, fp: bytes, payload: bytes) -> bytes:
    """``payload`` with the key's tag in front."""
    if len(fp) != 16:
        raise ValueError("a fingerprint has 16 bytes")
    return MAGIC + _FIXED.pack(digest(key), fp, key_ms(key)) + payload


def parse(payload: bytes, obj: str | None = None) -> Tag | None:
    """The tag in front of a metadata payload, or None (an untagged call's own)."""
    if not payload.startswith(MAGIC):
        return None
    if len(payload) < HEADER:
        raise CorruptError(WHAT, obj, 0, f"a tagged payload of {len(payload)} bytes, < {HEADER}")
    d, fp, ms = _FIXED.unpack_from(payload, len(MAGIC))
    return Tag(d, fp, ms, bytes(payload[HEADER:]))


def own(payload: bytes) -> bytes:
    """A metadata payload as its call gave it (the tag, if any, taken off)."""
    return payload[HEADER:] if payload.startswith(MAGIC) and len(payload) >= HEADER else payload
