"""Request bodies of ``POST /v1/produce``: parse and validate the whole body first.

Pure functions, no I/O: a body is accepted whole or rejected with :class:`BadBody`
(400) or :class:`TooLarge` (413) before anything is staged, so a bad request leaves
nothing behind.

* ``application/x-ndjson``: one JSON text per line; each line's bytes (without the
  line break) are one record, stored as sent.  Blank lines are skipped.  A line must
  be RFC 8259 JSON in UTF-8, as orjson reads it: no ``NaN``/``Infinity``, no byte
  order mark, no UTF-16, no lone surrogate escape, nesting at most 1024 deep.
* ``application/octet-stream``: records framed as in the RFC data batch format,
  ``[len: u32 LE][bytes]`` repeated.
* ``application/vnd.apache.arrow.stream``: an Arrow IPC stream; its record batches
  (one schema) are concatenated into **one** bundle in slot 0, so one request is one
  WAL entry and lands whole or not at all.

Bounded work per body: an ndjson or octet-stream body of more than ``max_records``
records is refused before its records are made (each costs a Python object here and
in the producer), and an Arrow stream whose buffers declare more than
``max_decoded`` bytes once decompressed, or more than ``max_records / 2`` fields,
batches and arrays, is refused before any is decoded (format/ipc_size.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    import pyarrow as pa

NDJSON = "application/x-ndjson"
OCTET_STREAM = "application/octet-stream"
ARROW_STREAM = "application/vnd.apache.arrow.stream"
CONTENT_TYPES = (NDJSON, OCTET_STREAM, ARROW_STREAM)

_LEN = struct.Struct("<I")
ARROW_PART_RECORDS = 2
"""An Arrow stream's fields, batches and arrays count this many records each against
``max_records``: each is a pyarrow object of about 1 KB while it is read, a record
about 200 bytes while it is parsed and staged (bench/service.py --memory)."""


class BadBody(ValueError):
    """The body does not parse; ``str()`` says where (HTTP 400)."""


class TooLarge(ValueError):
    """The body holds more than a limit allows; ``str()`` says which (HTTP 413)."""


@dataclass(frozen=True, slots=True)
class Records:
    records: list[bytes]


@dataclass(frozen=True, slots=True)
class Bundle:
    batch: pa.RecordBatch
    batches: int
    """How many record batches the stream held (concatenated into ``batch``)."""


def check_record_count(content_type: str, body: bytes | bytearray, max_records: int) -> None:
    """TooLarge when an ndjson or octet-stream ``body`` holds more than ``max_records``
    records, counted on its bytes before any record (or copy) is made: ndjson lines
    (blank ones too) with ``count``, octet-stream frames by their length prefixes (a
    damaged frame is left to the parser)."""
    if content_type == NDJSON:
        lines = body.count(b"\n") + (not body.endswith(b"\n"))
        if lines > max_records:
            raise TooLarge(f"more than {max_records} records in the body ({lines} lines)")
    elif content_type == OCTET_STREAM:
        pos, end, n = 0, len(body), 0
        while pos + _LEN.size <= end:
            if n == max_records:
                raise TooLarge(
                    f"more than {max_records} records in the body (record "
                    f"{max_records + 1} starts at byte {pos})"
                )
            pos += _LEN.size + _LEN.unpack_from(body, pos)[0]
            n += 1


def parse_ndjson(body: bytes, max_records: int | None = None) -> Records:
    """One record per non-blank line; TooLarge past ``max_records`` lines
    (:func:`check_record_count`)."""
    if max_records is not None:
        check_record_count(NDJSON, body, max_records)
    out: list[bytes] = []
    loads = orjson.loads
    for n, line in enumerate(body.split(b"\n"), start=1):
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line.strip():
            continue
        try:
            loads(line)
        except orjson.JSONDecodeError as e:
            raise BadBody(f"line {n} is not JSON: {e}") from None
        out.append(line)
    if not out:
        raise BadBody("no records in the body")
    return Records(out)


def parse_length_prefixed(body: bytes, max_records: int | None = None) -> Records:
    """TooLarge as soon as a record past ``max_records`` is found."""
    out: list[bytes] = []
    view = memoryview(body)
    pos, end = 0, len(body)
    while pos < end:
        if max_records is not None and len(out) == max_records:
            raise TooLarge(
                f"more than {max_records} records in the body (record "
                f"{max_records + 1} starts at byte {pos})"
            )
        if end - pos < _LEN.size:
            raise BadBody(f"truncated length prefix at byte {pos} ({end - pos} bytes left)")
        (n,) = _LEN.unpack_from(view, pos)
        pos += _LEN.size
        if n > end - pos:
            raise BadBody(
                f"record {len(out)} at byte {pos - _LEN.size} claims {n} bytes, {end - pos} left"
            )
        out.append(bytes(view[pos : pos + n]))
        pos += n
    if not out:
        raise BadBody("no records in the body")
    return Records(out)


def parse_arrow_stream(
    body: bytes | bytearray, max_decoded: int | None = None, max_parts: int | None = None
) -> Bundle:
    """TooLarge when the stream declares more than ``max_decoded`` bytes once
    decompressed, or more than ``max_parts`` fields, batches and arrays (each a pyarrow
    object of about 1 KB): summed from the stream's metadata before anything is
    decoded (format/ipc_size.py), so a decompression bomb never allocates."""
    import pyarrow as pa

    from tieredbuf.format.ipc_size import declared
    from tieredbuf.format.wal import describe_error

    if not body:
        raise BadBody("empty Arrow stream")
    data = pa.py_buffer(body)
    if max_decoded is not None or max_parts is not None:
        decoded_cap = (1 << 62) if max_decoded is None else max_decoded
        parts_cap = (1 << 62) if max_parts is None else max_parts
        try:
            got = declared(data, decoded_cap, parts_cap)
        except Exception as e:  # any failure framing untrusted Arrow bytes
            raise BadBody(f"corrupt Arrow IPC stream: {describe_error(e)}") from None
        if got.decoded > decoded_cap:
            raise TooLarge(
                f"the Arrow stream decodes to more than {decoded_cap} bytes "
                f"(its buffers declare at least {got.decoded})"
            )
        if got.parts > parts_cap:
            raise TooLarge(
                f"the Arrow stream holds more than {parts_cap} fields, batches "
                f"and arrays (at least {got.parts}): send fewer, larger batches"
            )
    try:
        source = pa.BufferReader(data)
        with pa.ipc.open_stream(source) as reader:
            batches = list(reader)
        for b in batches:  # every batch, before anything reads its values (concat does)
            b.validate(full=True)
            for name, col in zip(b.schema.names, b.columns, strict=True):
                _check_offsets(col, name)
        end = source.tell()
    except BadBody:
        raise
    except Exception as e:  # any failure decoding untrusted Arrow bytes
        raise BadBody(f"corrupt Arrow IPC stream: {describe_error(e)}") from None
    if end != len(body):
        # e.g. two streams sent back to back: the reader stops at the first one's
        # end-of-stream marker, and staging only that would drop the rest silently
        raise BadBody(f"{len(body) - end} bytes after the Arrow stream's end at byte {end}")
    if not batches:
        raise BadBody("the Arrow stream holds no record batches")
    try:
        batch = batches[0] if len(batches) == 1 else pa.concat_batches(batches)
    except Exception as e:
        raise BadBody(
            f"the Arrow stream's batches do not concatenate: {describe_error(e)}"
        ) from None
    return Bundle(batch, len(batches))


def _check_offsets(arr: pa.Array, name: str) -> None:
    """pyarrow 26's ``validate(full=True)`` accepts an empty list array whose only
    offset points past its values; slicing it (``flatten()``, in a consumer's code)
    then aborts the process.  Such a column is refused here, at the door."""
    import pyarrow as pa

    if isinstance(arr, pa.DictionaryArray):
        _check_offsets(arr.dictionary, name)
        return
    if isinstance(arr, pa.ListArray | pa.LargeListArray | pa.MapArray):
        offsets = arr.offsets
        first, last = offsets[0].as_py(), offsets[len(offsets) - 1].as_py()
        if not 0 <= first <= last <= len(arr.values):
            raise BadBody(
                f"column {name}: list offsets {first}..{last} outside its {len(arr.values)} values"
            )
        _check_offsets(arr.values, name)
    elif isinstance(arr, pa.FixedSizeListArray):
        _check_offsets(arr.values, name)
    elif isinstance(arr, pa.StructArray):
        for i in range(arr.type.num_fields):
            _check_offsets(arr.field(i), f"{name}.{arr.type.field(i).name}")


def parse(
    content_type: str,
    body: bytes | bytearray,
    *,
    max_records: int | None = None,
    max_decoded: int | None = None,
) -> Records | Bundle:
    """Parse ``body`` of ``content_type`` (one of :data:`CONTENT_TYPES`): BadBody (400)
    or TooLarge (413, past ``max_records`` records or ``max_decoded`` decoded bytes; an
    Arrow stream may hold ``max_records // ARROW_PART_RECORDS`` fields, batches and
    arrays)."""
    if content_type == NDJSON:
        return parse_ndjson(bytes(body), max_records)
    if content_type == OCTET_STREAM:
        return parse_length_prefixed(bytes(body), max_records)
    if content_type == ARROW_STREAM:
        parts = None if max_records is None else max(1, max_records // ARROW_PART_RECORDS)
        return parse_arrow_stream(body, max_decoded, parts)
    raise ValueError(f"unsupported content type {content_type!r}")


def encode_length_prefixed(records: list[bytes]) -> bytes:
    """The octet-stream body for ``records`` (for clients and tests)."""
    return b"".join(_LEN.pack(len(r)) + r for r in records)
