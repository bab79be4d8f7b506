"""An announcement spelled out in its key (pure codec): the *key form*.

The committer LISTs ``queue/pending/`` and reads every announcement it finds; a GET each
was one request per data object when every process has one writer.  So an announcement
of one writer's appends is spelled out in its key as well (its body is written as
always), and the committer takes it from the LIST.  Layout (docs/format.md)::

    i<created_ms>.<crc32>.<producer id>.<entry>[_<entry>...]
    entry = <producer_seq>-<data object ULID><b: .batch | q: .qseg><size>[-<item>...]
    item  = <start_index - the previous item's>P<created_ms - ingestion_time_ms>
            (N instead of P: the ingestion time is after created_ms)

Numbers are base 36 (``0-9a-z``) without leading zeros; the CRC is the body's own
(``zlib.crc32``).  Only an announcement that fits is spelled: one writer, a producer id
in ``[A-Za-z0-9_.:-]``, data objects named ``data/<ULID>.batch|.qseg``, metadata without
payloads whose start indexes never decrease -- and the key within a file name's 255
bytes.  :func:`runs_of` rebuilds the body's bytes from the text and checks their CRC and
length against the CRC spelled and the object's size as listed, so a key can only say
what its body says: anything else is CorruptError, and the reader GETs the body.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence

from tieredbuf import keys
from tieredbuf.errors import CorruptError
from tieredbuf.format.announce import WHAT, Announced, Announcement, decode, encode, make
from tieredbuf.format.manifest import MetadataItem

_KIND = {keys.BATCH_SUFFIX: "b", keys.SEGMENT_SUFFIX: "q"}
_SUFFIX = {v: k for k, v in _KIND.items()}
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_NUM_RE = re.compile(r"0|[1-9a-z][0-9a-z]{0,12}")
_OBJECT_RE = re.compile(r"([0-9A-Z]{26})([bq])(.+)")
_ITEM_RE = re.compile(r"([0-9a-z]+)([PN])([0-9a-z]+)")
_SAFE_PID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,200}")


def key_form(runs: Sequence[Announcement], created_ms: int, body: bytes, room: int) -> str | None:
    """``body`` (``encode(runs, created_ms)``) spelled out in at most ``room``
    characters, or None when it cannot be (see the module doc)."""
    if len(runs) != 1 or created_ms < 0 or not _SAFE_PID_RE.fullmatch(runs[0].producer_id):
        return None
    spelled = []
    for e in runs[0].entries:
        u = keys.parse_data_key(e.location)
        if u is None:
            return None
        kind = _KIND[e.location[len(keys.DATA_PREFIX) + 26 :]]
        parts = [f"{_b36(e.producer_seq)}-{u}{kind}{_b36(e.size)}"]
        start = 0
        for m in e.metadata:
            if m.payload or m.start_index < start:
                return None
            ago = created_ms - m.ingestion_time_ms
            parts.append(f"{_b36(m.start_index - start)}{'P' if ago >= 0 else 'N'}{_b36(abs(ago))}")
            start = m.start_index
        spelled.append("-".join(parts))
    (crc,) = struct.unpack_from("<I", body, len(body) - 4)
    text = f"i{_b36(created_ms)}.{_b36(crc)}.{runs[0].producer_id}.{'_'.join(spelled)}"
    return text if len(text) <= room else None


def runs_of(text: str, size: int, obj: str | None = None) -> tuple[Announcement, ...]:
    """The runs ``text`` spells, exactly as :func:`decode` makes of a body of ``size``
    bytes; CorruptError when ``text`` is not a key form, or the body it spells has
    another CRC or length."""
    fields = text[1:].split(".") if text.startswith("i") else []
    if len(fields) < 4:
        raise _bad(obj, "not an announcement's key form")
    created, crc = _num(fields[0], obj), _num(fields[1], obj)
    pid = ".".join(fields[2:-1])
    entries = [_entry(spelled, created, obj) for spelled in fields[-1].split("_")]
    try:
        body = encode([make(pid, 0, entries)], created)
    except (ValueError, struct.error, OverflowError) as e:  # out of order, or out of range
        raise _bad(obj, f"key form: {e}") from e
    if body[-4:] != struct.pack("<I", crc & 0xFFFFFFFF) or crc >> 32:
        raise _bad(obj, "key form: CRC mismatch")
    if size != len(body):
        raise _bad(obj, f"key form spells {len(body)} bytes; the body has {size}")
    return decode(body, obj)


def _entry(spelled: str, created: int, obj: str | None) -> Announced:
    parts = spelled.split("-")
    m = _OBJECT_RE.fullmatch(parts[1]) if len(parts) > 1 else None
    if m is None:
        raise _bad(obj, f"key form: bad entry {spelled!r}")
    items = []
    start = 0
    for p in parts[2:]:
        i = _ITEM_RE.fullmatch(p)
        if i is None:
            raise _bad(obj, f"key form: bad metadata item {p!r}")
        start += _num(i.group(1), obj)
        ago = _num(i.group(3), obj)
        items.append(MetadataItem(start, created - (ago if i.group(2) == "P" else -ago), b""))
    loc = f"{keys.DATA_PREFIX}{m.group(1)}{_SUFFIX[m.group(2)]}"
    return Announced(_num(parts[0], obj), loc, _num(m.group(3), obj), tuple(items))


def _b36(n: int) -> str:
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = _DIGITS[d] + out
        if not n:
            return out


def _num(s: str, obj: str | None) -> int:
    if not _NUM_RE.fullmatch(s):
        raise _bad(obj, f"key form: {s!r} is not a number")
    return int(s, 36)


def _bad(obj: str | None, why: str) -> CorruptError:
    return CorruptError(WHAT, obj, 0, why)


__all__ = ["key_form", "runs_of"]
