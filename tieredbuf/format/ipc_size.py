"""How many bytes an Arrow IPC stream's record batches decode to, read from what the
stream declares, before any of it is decompressed or copied.

A compressed IPC body holds each buffer as ``[uncompressed length: i64 LE][compressed
bytes]`` (``-1``: stored uncompressed); the buffers' places in the body are listed in
the message's flatbuffer metadata (``RecordBatch.buffers``; the Arrow columnar format's
"Compression" section).  pyarrow's reader allocates that declared length and then
decompresses into it, so a 33 KB stream can ask for 1 GiB.  :func:`declared`
sums the declared sizes of every record batch and dictionary batch (an uncompressed
buffer counts its length: writing the batch out again copies it, however its buffers
overlap), and counts its batches and arrays (each a pyarrow object of about 1 KB, so
110,000 one-row batches in 16 MiB took 114 MiB to read), stopping as soon as either
passes its limit.

Pure: it reads the bytes given (messages framed by pyarrow's ``MessageReader``, which
copies nothing from an in-memory buffer) and a few fields of each message's
flatbuffer, with every offset checked against the buffer before it is followed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import pyarrow as pa

_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_I64 = struct.Struct("<q")
_BUFFER = struct.Struct("<qq")  # flatbuffer struct Buffer {offset: long; length: long}

# Message.fbs: table Message {version; header (union: type, value); bodyLength; ...}
_MESSAGE_HEADER_TYPE, _MESSAGE_HEADER = 1, 2
_HEADER_SCHEMA, _HEADER_DICTIONARY_BATCH, _HEADER_RECORD_BATCH = 1, 2, 3
# table Schema {endianness; fields: [Field]; ...}; table Field {...; children: [Field]}
_SCHEMA_FIELDS, _FIELD_CHILDREN = 1, 5
# table RecordBatch {length; nodes; buffers; compression; ...}
_RECORD_BATCH_NODES, _RECORD_BATCH_BUFFERS, _RECORD_BATCH_COMPRESSION = 1, 2, 3
# table DictionaryBatch {id; data: RecordBatch; isDelta}
_DICTIONARY_BATCH_DATA = 1


class IpcSizeError(ValueError):
    """The stream's framing or metadata is not what Arrow writes."""


class _Flat:
    """Bounds-checked reads of one flatbuffer."""

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def _at(self, fmt: struct.Struct, pos: int) -> int:
        if pos < 0 or pos + fmt.size > len(self.data):
            raise IpcSizeError(f"flatbuffer offset {pos} outside its {len(self.data)} bytes")
        value: int = fmt.unpack_from(self.data, pos)[0]
        return value

    def root(self) -> int:
        return self._at(_U32, 0)

    def field(self, table: int, index: int) -> int | None:
        """Where field ``index`` of the table at ``table`` is, or None when absent."""
        vtable = table - self._at(_I32, table)
        size = self._at(_U16, vtable)
        slot = 4 + 2 * index
        if slot + 2 > size:
            return None
        off = self._at(_U16, vtable + slot)
        return table + off if off else None

    def u8(self, pos: int) -> int:
        if not 0 <= pos < len(self.data):
            raise IpcSizeError(f"flatbuffer offset {pos} outside its {len(self.data)} bytes")
        return self.data[pos]

    def deref(self, pos: int) -> int:
        """The table or vector an offset field at ``pos`` points to."""
        return pos + self._at(_U32, pos)

    def length(self, vector: int) -> int:
        """How many elements the vector at ``vector`` holds."""
        return self._at(_U32, vector)

    def buffers(self, vector: int) -> list[tuple[int, int]]:
        n = self._at(_U32, vector)
        start = vector + 4
        if start + n * _BUFFER.size > len(self.data):
            raise IpcSizeError(f"{n} buffers run past the metadata's {len(self.data)} bytes")
        return [_BUFFER.unpack_from(self.data, start + i * _BUFFER.size) for i in range(n)]


def _fields(flat: _Flat, schema: int, budget: int) -> int:
    """How many fields the Schema table at ``schema`` declares, nested children
    included; stops once past ``budget``."""
    n = 0
    todo = [schema]
    first = True
    while todo and n <= budget:
        table = todo.pop()
        where = flat.field(table, _SCHEMA_FIELDS if first else _FIELD_CHILDREN)
        first = False
        if where is None:
            continue
        vector = flat.deref(where)
        count = flat.length(vector)
        n += count
        if n > budget:
            break
        todo.extend(flat.deref(vector + 4 + 4 * i) for i in range(count))
    return n


def _batch_size(flat: _Flat, batch: int, body: memoryview) -> int:
    """The decoded bytes of the RecordBatch table at ``batch`` whose body is ``body``."""
    where = flat.field(batch, _RECORD_BATCH_BUFFERS)
    if where is None:
        return 0
    compressed = flat.field(batch, _RECORD_BATCH_COMPRESSION) is not None
    total = 0
    for offset, length in flat.buffers(flat.deref(where)):
        if offset < 0 or length < 0 or offset + length > len(body):
            raise IpcSizeError(
                f"buffer at {offset} of {length} bytes outside the message body's {len(body)}"
            )
        if not compressed or length == 0:
            total += length
            continue
        if length < _I64.size:
            raise IpcSizeError(f"compressed buffer at {offset} has {length} bytes, no length")
        declared = _I64.unpack_from(body, offset)[0]
        if declared == -1:  # stored uncompressed after the prefix
            total += length - _I64.size
        elif declared < 0:
            raise IpcSizeError(f"compressed buffer at {offset} declares {declared} bytes")
        else:
            total += declared
    return total


@dataclass(frozen=True, slots=True)
class Declared:
    """What an IPC stream declares, summed over its record and dictionary batches."""

    decoded: int
    """Bytes of their buffers once decoded."""
    parts: int
    """Batches plus arrays (field nodes: columns and nested children, per batch): each
    becomes a pyarrow object of about 1 KB however small its data."""


def declared(source: pa.Buffer, max_decoded: int, max_parts: int) -> Declared:
    """What the IPC stream in ``source`` declares; stops as soon as either sum passes its
    limit (the sums are then over it, not whole).  IpcSizeError (or pyarrow's error)
    for a stream it cannot frame."""
    reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(source))
    total = parts = 0
    while total <= max_decoded and parts <= max_parts:
        try:
            msg = reader.read_next_message()
        except StopIteration:
            break
        if msg.type not in ("schema", "record batch", "dictionary batch"):
            continue
        parts += 1
        flat = _Flat(memoryview(msg.metadata))
        message = flat.root()
        header = flat.field(message, _MESSAGE_HEADER)
        kind = flat.field(message, _MESSAGE_HEADER_TYPE)
        if header is None or kind is None:
            raise IpcSizeError(f"a {msg.type} message without its header")
        table = flat.deref(header)
        if flat.u8(kind) == _HEADER_SCHEMA:
            parts += _fields(flat, table, max_parts - parts + 1)
            continue
        if flat.u8(kind) == _HEADER_DICTIONARY_BATCH:
            data = flat.field(table, _DICTIONARY_BATCH_DATA)
            if data is None:
                continue
            table = flat.deref(data)
        elif flat.u8(kind) != _HEADER_RECORD_BATCH:
            raise IpcSizeError(f"a {msg.type} message with header type {flat.u8(kind)}")
        nodes = flat.field(table, _RECORD_BATCH_NODES)
        if nodes is not None:
            parts += flat.length(flat.deref(nodes))
        body = memoryview(msg.body) if msg.body is not None else memoryview(b"")
        total += _batch_size(flat, table, body)
    return Declared(total, parts)
