"""An announcement spelled out in its key (pure codec): the *key form*.

The committer LISTs ``queue/pending/`` and reads every announcement it finds; a GET each
was one request per data object when every process has one writer.  So an announcement
of one writer's appends is spelled out in its key as well (its body is written as
always), and the committer takes it from the LIST.  Layout (docs/format.md)::

    i3_<created_ms>.<crc32>.<producer id>.<after><entry>[_<entry>...]
    entry = <seq><ULID time><ULID randomness><b: .batch | q: .qseg><size><item>...
    item  = [-<start index | stride>]<ingestion time>

Form 3 (above, written; it spells a version-3 body, whose run names the append it
follows): ``created_ms`` and the CRC in base 36 (``0-9a-z``, no leading zeros), the CRC
the body's own (``zlib.crc32``).  Every other number is *self-delimited*,
so none needs a separator: below 36 one base-36 digit, else ``A``-``M`` (2-14 digits)
and that many base-36 digits; a signed one is ``Z`` and its magnitude when negative.
``after`` is spelled as it is; each other number is a difference from the one before it
in the announcement: the producer sequence less the previous entry's, less one (the
first: less ``after``, less one -- 0 for a writer's next append); the ULID's time (ms, signed)
less the previous entry's (the first: less ``created_ms``), then the ULID's 16
characters of randomness verbatim; the size less the previous entry's (signed; the
first: less 0); an item's ingestion time less the previous item's (signed; the first
item's: less ``created_ms``).  An entry's first item starts at 0 or at the index its
``-`` gives; each later one at the previous item's start plus the *stride*, which
starts at 0 and is kept, across entries too, until an item's ``-`` sets it.  A
writer's ``produce()`` calls of one size at a steady pace cost one to three characters
an item: one data object of 50 calls, or three of 15, fit.

Form 2 (``i_``, written before form 3; still read) is form 3 without ``<after>``, the
first producer sequence less 0: it spells a version-2 body (no ``after``).

Form 1 (written by the first version to spell keys; still read)::

    i<created_ms>.<crc32>.<producer id>.<entry>[_<entry>...]
    entry = <producer_seq>-<data object ULID><b|q><size>[-<item>...]
    item  = <start_index - the previous item's>P<created_ms - ingestion_time_ms>
            (N instead of P: the ingestion time is after created_ms)

Only an announcement that fits is spelled: one writer, a producer id in
``[A-Za-z0-9_.:-]``, data objects named ``data/<ULID>.batch|.qseg``, metadata without
payloads whose start indexes never decrease -- and the key within a file name's 255
bytes.  :func:`runs_of` rebuilds the body's bytes from the text and checks their CRC and
length against the CRC spelled and the object's size as listed, so a key can only say
what its body says: anything else is CorruptError, and the reader GETs the body.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence

from ulid import base32

from tieredbuf import keys
from tieredbuf.errors import CorruptError
from tieredbuf.format.announce import (
    WHAT,
    Announced,
    Announcement,
    decode,
    encode,
    encode_without_after,
    make,
)
from tieredbuf.format.manifest import MetadataItem

FORM_3 = "i3_"
"""What a form-3 key form starts with."""
FORM_2 = "i_"
"""What a form-2 key form starts with (form 1 starts ``i`` and a digit or letter, never
followed by ``_``: its first field is a number)."""
_KIND = {keys.BATCH_SUFFIX: "b", keys.SEGMENT_SUFFIX: "q"}
_SUFFIX = {v: k for k, v in _KIND.items()}
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_LONG = "ABCDEFGHIJKLM"  # a self-delimited number of 2..14 base-36 digits
_NUM_RE = re.compile(r"0|[1-9a-z][0-9a-z]{0,12}")
_OBJECT_RE = re.compile(r"([0-9A-Z]{26})([bq])(.+)")
_ITEM_RE = re.compile(r"([0-9a-z]+)([PN])([0-9a-z]+)")
_SAFE_PID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,200}")


def key_form(runs: Sequence[Announcement], created_ms: int, body: bytes, room: int) -> str | None:
    """``body`` (``encode(runs, created_ms)``) spelled out in form 3 in at most ``room``
    characters, or None when it cannot be (see the module doc)."""
    if len(runs) != 1 or created_ms < 0 or not _SAFE_PID_RE.fullmatch(runs[0].producer_id):
        return None
    run = runs[0]
    try:
        spelled = _spell(run.entries, created_ms, run.after)
        after = _n(run.after)
    except ValueError:  # a number too large to spell
        return None
    if spelled is None:
        return None
    (crc,) = struct.unpack_from("<I", body, len(body) - 4)
    text = f"{FORM_3}{_b36(created_ms)}.{_b36(crc)}.{run.producer_id}.{after}{'_'.join(spelled)}"
    return text if len(text) <= room else None


def _spell(entries: Sequence[Announced], created_ms: int, after: int) -> list[str] | None:
    spelled: list[str] = []
    seq, size, stride = after, 0, 0
    ms = when = created_ms
    for e in entries:
        u = keys.parse_data_key(e.location)
        name = e.location[len(keys.DATA_PREFIX) : len(keys.DATA_PREFIX) + 26]
        if u is None or str(u) != name:
            return None
        kind = _KIND[e.location[len(keys.DATA_PREFIX) + 26 :]]
        parts = [_n(e.producer_seq - seq - 1), _z(u.milliseconds - ms), name[10:], kind]
        parts.append(_z(e.size - size))
        seq, ms, size = e.producer_seq, u.milliseconds, e.size
        start = 0
        for i, m in enumerate(e.metadata):
            if m.payload or m.start_index < start:
                return None
            if i == 0 and m.start_index:
                parts.append("-" + _n(m.start_index))
            elif i and m.start_index - start != stride:
                stride = m.start_index - start
                parts.append("-" + _n(stride))
            parts.append(_z(m.ingestion_time_ms - when))
            start, when = m.start_index, m.ingestion_time_ms
        spelled.append("".join(parts))
    return spelled


def runs_of(text: str, size: int, obj: str | None = None) -> tuple[Announcement, ...]:
    """The runs ``text`` (either form) spells, exactly as :func:`decode` makes of a body
    of ``size`` bytes; CorruptError when ``text`` is not a key form, or the body it spells
    has another CRC or length."""
    form = next((f for f in (FORM_3, FORM_2) if text.startswith(f)), "i")
    fields = text[len(form) :].split(".") if text.startswith("i") else []
    if len(fields) < 4:
        raise _bad(obj, "not an announcement's key form")
    created, crc = _num(fields[0], obj), _num(fields[1], obj)
    pid = ".".join(fields[2:-1])
    after = 0
    if form == FORM_3:
        t = _Text(fields[-1], obj)
        after = t.n()
        entries = _entries(fields[-1][t.pos :], created, obj, after)
    elif form == FORM_2:
        entries = _entries(fields[-1], created, obj, 0)
    else:
        entries = [_entry(spelled, created, obj) for spelled in fields[-1].split("_")]
    try:
        run = [make(pid, 0, entries, after)]
        body = encode(run, created) if form == FORM_3 else encode_without_after(run, created)
    except (ValueError, struct.error, OverflowError) as e:  # out of order, or out of range
        raise _bad(obj, f"key form: {e}") from e
    if body[-4:] != struct.pack("<I", crc & 0xFFFFFFFF) or crc >> 32:
        raise _bad(obj, "key form: CRC mismatch")
    if size != len(body):
        raise _bad(obj, f"key form spells {len(body)} bytes; the body has {size}")
    return decode(body, obj)


class _Text:
    """Form 2's entries, read left to right."""

    def __init__(self, text: str, obj: str | None) -> None:
        self.text, self.obj, self.pos = text, obj, 0

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip(self, c: str) -> bool:
        """Step over ``c`` if it comes next."""
        if self.peek() != c:
            return False
        self.pos += 1
        return True

    def take(self, n: int) -> str:
        if self.pos + n > len(self.text):
            raise _bad(self.obj, f"key form: entry {self.text!r} cut short")
        self.pos += n
        return self.text[self.pos - n : self.pos]

    def n(self) -> int:
        c = self.take(1)
        if c in _LONG:
            digits = self.take(_LONG.index(c) + 2)
            if digits[0] == "0" or not all(d in _DIGITS for d in digits):
                raise _bad(self.obj, f"key form: {c + digits!r} is not a number")
            return int(digits, 36)
        if c not in _DIGITS:
            raise _bad(
                self.obj,
                f"key form: {c!r} at {self.pos - 1} of entry {self.text!r} is not a number",
            )
        return int(c, 36)

    def z(self) -> int:
        if not self.skip("Z"):
            return self.n()
        v = self.n()
        if v == 0:
            raise _bad(self.obj, "key form: -0")
        return -v


def _entries(spelled: str, created: int, obj: str | None, after: int) -> list[Announced]:
    entries: list[Announced] = []
    seq, size, stride = after, 0, 0
    ms = when = created
    for part in spelled.split("_"):
        t = _Text(part, obj)
        seq += t.n() + 1
        ms += t.z()
        randomness, kind = t.take(16), t.take(1)
        loc = ""
        if 0 <= ms < 1 << 48 and kind in _SUFFIX:
            name = base32.encode_timestamp(ms.to_bytes(6, "big")) + randomness
            loc = f"{keys.DATA_PREFIX}{name}{_SUFFIX[kind]}"
        if keys.parse_data_key(loc) is None:  # the ULID's characters are checked there
            raise _bad(obj, f"key form: bad entry {part!r}")
        size += t.z()
        items: list[MetadataItem] = []
        start = 0
        while t.peek():
            if t.skip("-"):
                if items:
                    stride = t.n()
                else:
                    start = t.n()
            start += stride if items else 0
            when += t.z()
            items.append(MetadataItem(start, when, b""))
        entries.append(Announced(seq, loc, size, tuple(items)))
    return entries


def _entry(spelled: str, created: int, obj: str | None) -> Announced:
    """A form-1 entry."""
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


def _n(v: int) -> str:
    """``v`` (0 or more) self-delimited."""
    s = _b36(v) if v >= 0 else ""
    if not s or len(s) > len(_LONG) + 1:
        raise ValueError(f"{v} is too large to spell")
    return s if len(s) == 1 else _LONG[len(s) - 2] + s


def _z(v: int) -> str:
    """``v`` (signed) self-delimited."""
    return _n(v) if v >= 0 else "Z" + _n(-v)


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


__all__ = ["FORM_2", "FORM_3", "key_form", "runs_of"]
