"""The subscriber registry: root section 7 (pure codec; layout in docs/format.md).

    body: count u32, then per subscriber, sorted by name:
          name_len u8, name (ASCII [A-Za-z0-9_-], 1..64 bytes), reg_id 16 bytes,
          flags u8 (bit 0: shared work queue), published_next u64

``reg_id`` is the binary ULID of the registration (all zero for "default", the
root-resident RFC 0001 consumer); ``published_next`` is the first sequence the
subscriber still needs, as last published into the root.  A root without
section 7 has an *implied* registry (:func:`implied`), so a buffer with only the
default consumer keeps RFC-era bytes.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from tieredbuf.errors import ConfigError
from tieredbuf.format._reader import Reader, pack_u32

DEFAULT = "default"
"""The root-resident subscriber: ``buf.consumer()``, RFC 0001's fenced consumer."""
MAX_SUBSCRIBERS = 1024
"""Registry cap: keeps the root bounded (I6): at most 4 + 1024 x 90 bytes."""
MAX_NAME = 64
FLAG_SHARED = 0x01
ZERO_REG = bytes(16)
ENTRY_OVERHEAD = 1 + 16 + 1 + 8
"""Bytes per registration besides its name."""
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TAIL = struct.Struct("<16sBQ")
WHAT = "queue manifest"


def check_name(name: object) -> str:
    """A subscriber name: 1-64 of ``A-Z a-z 0-9 _ -`` (it becomes part of an object key)."""
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise ConfigError(
            f"bad subscriber name {name!r}: use 1-{MAX_NAME} characters from A-Z, a-z, 0-9, "
            "'_' and '-'"
        )
    return name


@dataclass(frozen=True, slots=True)
class Registration:
    """One registered subscriber, as the root records it."""

    name: str
    reg_id: bytes
    flags: int
    published_next: int

    @property
    def shared(self) -> bool:
        return bool(self.flags & FLAG_SHARED)

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT


def implied(epoch: int, head: int) -> dict[str, Registration]:
    """The registry of a root without section 7: the default consumer at the head once one
    ever initialized (epoch > 0), else nobody."""
    if epoch > 0:
        return {DEFAULT: Registration(DEFAULT, ZERO_REG, 0, head)}
    return {}


def encode(regs: Mapping[str, Registration]) -> bytes:
    if len(regs) > MAX_SUBSCRIBERS:
        raise ValueError(f"{len(regs)} subscribers exceed the cap of {MAX_SUBSCRIBERS}")
    out = [pack_u32(len(regs))]
    for name in sorted(regs):
        r = regs[name]
        n = check_name(r.name).encode("ascii")
        if len(r.reg_id) != 16 or (r.reg_id == ZERO_REG) != r.is_default:
            raise ValueError(f"subscriber {r.name}: bad registration id")
        out.append(bytes([len(n)]) + n + _TAIL.pack(r.reg_id, r.flags, r.published_next))
    return b"".join(out)


def decode(body: Reader) -> dict[str, Registration]:
    """Section 7's body; checks the count, order, names, ids and flags (I7)."""
    at = body.pos
    count = body.u32("subscriber count")
    if count > MAX_SUBSCRIBERS:
        raise body.fail(f"subscriber count {count} exceeds the cap {MAX_SUBSCRIBERS}", at)
    if count * (1 + 1 + _TAIL.size) > body.remaining():
        raise body.fail(f"subscriber count {count} cannot fit", at)
    out: dict[str, Registration] = {}
    last = ""
    for i in range(count):
        at = body.pos
        raw = bytes(body.take(body.u8(f"subscriber {i} name length"), f"subscriber {i} name"))
        name = raw.decode("ascii", "replace")
        if _NAME_RE.fullmatch(name) is None:
            raise body.fail(f"subscriber {i}: bad name {raw!r}", at)
        if name <= last:
            raise body.fail(f"subscriber {name!r} out of order or repeated", at)
        last = name
        body.need(_TAIL.size, f"subscriber {name!r}")
        reg_id, flags, published = _TAIL.unpack_from(body.buf, body.pos)
        body.pos += _TAIL.size
        if flags & ~FLAG_SHARED:
            raise body.fail(f"subscriber {name!r}: unknown flags 0x{flags:02x}", at)
        if (reg_id == ZERO_REG) != (name == DEFAULT) or (name == DEFAULT and flags):
            raise body.fail(f"subscriber {name!r}: bad registration id or flags", at)
        out[name] = Registration(name, reg_id, flags, published)
    return out


def head_of(regs: Mapping[str, Registration], low: int, next_seq: int, head: int) -> int:
    """The root's head: the slowest registered subscriber's published position, clamped
    into ``[low, next_seq]``; with nobody registered the head stays where it is."""
    if not regs:
        return max(head, low)
    slowest = min(r.published_next for r in regs.values())
    return min(max(slowest, low), next_seq)
