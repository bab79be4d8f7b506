"""Segments as Quiver writes them: the batch manifest with only the spec's two columns
(``bundle_index``, ``slot_refs``) and non-nullable fields, and the shape otel-arrow's
Quiver writer emits (directory and manifest as Arrow IPC *files*, an ``item_count``
column).  Every file the spec allows is read; tieredbuf keeps writing its richer form."""

from __future__ import annotations

import struct
import zlib

import pyarrow as pa
import pytest

from tieredbuf.errors import CorruptError
from tieredbuf.format import segment as seg
from tieredbuf.format import segment_tail as segt
from tieredbuf.format.segment import SegmentBundle

# Quiver's schemas, field by field from its segment layout: every field non-nullable
# (the list's item field nullable, as arrow-rs's ListBuilder makes it).
NN_SLOT_REF = pa.struct(
    [
        pa.field("slot_id", pa.uint16(), nullable=False),
        pa.field("stream_id", pa.uint32(), nullable=False),
        pa.field("chunk_index", pa.uint32(), nullable=False),
    ]
)
QUIVER_MANIFEST = pa.schema(
    [
        pa.field("bundle_index", pa.uint32(), nullable=False),
        pa.field(
            "slot_refs", pa.list_(pa.field("item", NN_SLOT_REF, nullable=True)), nullable=False
        ),
    ]
)
QUIVER_DIRECTORY = pa.schema(
    [pa.field(f.name, f.type, nullable=False) for f in seg.DIRECTORY_SCHEMA]
)

A = pa.record_batch({"x": pa.array(range(6), pa.int64())})
D = pa.record_batch({"k": pa.array(["a", "b", "a"]).dictionary_encode()})
BUNDLES = [
    SegmentBundle({0: A, 3: D}, 10, 100),
    SegmentBundle({3: D}, 11, 101),
    SegmentBundle({}, 12, 102),
    SegmentBundle({0: A}, 13, 103),
]


def _stream(b: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, b.schema) as w:
        w.write_batch(b)
    return bytes(sink.getvalue())


def _file(b: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, b.schema) as w:
        w.write_batch(b)
    return bytes(sink.getvalue())


def _resection(data: bytes, directory: bytes, manifest: bytes) -> bytes:
    """``data`` (a tieredbuf segment) with its directory and manifest replaced: the
    stream data region kept, then directory, manifest, footer v1 and trailer packed by
    hand from the layout (offsets and lengths rewritten, CRC recomputed)."""
    _, scount, bcount, d_off, _, _, _ = struct.unpack("<HIIQIQI", data[-50:-16])
    head = data[:d_off] + directory + manifest
    footer = struct.pack(
        "<HIIQIQI", 1, scount, bcount, d_off, len(directory), d_off + len(directory), len(manifest)
    )
    head += footer + struct.pack("<I", 34) + b"QUIVER\x00S"
    return head + struct.pack("<I", zlib.crc32(head))


def _sections(data: bytes) -> tuple[pa.RecordBatch, pa.RecordBatch]:
    r = seg.SegmentReader(data)
    _, _, _, d_off, d_len, m_off, m_len = struct.unpack("<HIIQIQI", data[-50:-16])
    d = pa.ipc.open_stream(pa.py_buffer(data[d_off : d_off + d_len])).read_next_batch()
    m = pa.ipc.open_stream(pa.py_buffer(data[m_off : m_off + m_len])).read_next_batch()
    assert r.bundle_count == m.num_rows
    return d, m


def _quiver_form(data: bytes, as_file: bool = False, item_count: bool = False) -> bytes:
    d, m = _sections(data)
    directory = pa.RecordBatch.from_arrays(d.columns, schema=QUIVER_DIRECTORY)
    cols = [m.column("bundle_index"), m.column("slot_refs").cast(QUIVER_MANIFEST[1].type)]
    schema = QUIVER_MANIFEST
    if item_count:
        cols.insert(1, pa.array([7] * m.num_rows, pa.uint64()))
        schema = schema.insert(1, pa.field("item_count", pa.uint64(), nullable=False))
    manifest = pa.RecordBatch.from_arrays(cols, schema=schema)
    enc = _file if as_file else _stream
    return _resection(data, enc(directory), enc(manifest))


def _check_read(data: bytes) -> None:
    got = seg.decode_segment(data, "data/q.qseg")
    assert len(got) == len(BUNDLES)
    for want, b in zip(BUNDLES, got, strict=True):
        assert (b.ingestion_ts_nanos, b.sequence) == (None, None)
        assert sorted(b.slots) == sorted(want.slots)
        for k, batch in want.slots.items():
            assert b.slots[k].equals(batch)
    tail = segt.parse_segment_tail(data[-segt.segment_tail_size(data[-4096:]) :], "data/q.qseg")
    assert [t.refs for t in tail.bundles] == [
        ((0, 0, 0), (3, 1, 0)),
        ((3, 1, 1),),
        (),
        ((0, 0, 1),),
    ]
    assert all((t.ingestion_ts_nanos, t.sequence) == (None, None) for t in tail.bundles)


def test_tieredbuf_writes_the_richer_manifest() -> None:
    _, m = _sections(seg.encode_segment(BUNDLES))
    assert m.schema.names == ["bundle_index", "slot_refs", "ingestion_ts_nanos", "sequence"]
    assert m.column("sequence").to_pylist() == [100, 101, 102, 103]


def test_quivers_two_column_non_nullable_manifest_is_read() -> None:
    data = _quiver_form(seg.encode_segment(BUNDLES))
    _, _, _, _, _, m_off, m_len = struct.unpack("<HIIQIQI", data[-50:-16])
    m = pa.ipc.open_stream(pa.py_buffer(data[m_off : m_off + m_len])).read_next_batch()
    assert m.schema.equals(QUIVER_MANIFEST) and not m.schema.field("bundle_index").nullable
    _check_read(data)


def test_otel_arrow_writers_ipc_files_and_item_count_are_read() -> None:
    data = _quiver_form(seg.encode_segment(BUNDLES), as_file=True, item_count=True)
    _, _, _, _, _, m_off, _ = struct.unpack("<HIIQIQI", data[-50:-16])
    assert data[m_off : m_off + 6] == b"ARROW1"
    _check_read(data)


@pytest.mark.parametrize("case", ["extra column", "wrong type", "null ref", "two batches"])
def test_I7_a_manifest_outside_the_allowed_forms_is_corrupt(case: str) -> None:
    data = seg.encode_segment(BUNDLES)
    d, m = _sections(data)
    refs = m.column("slot_refs").cast(QUIVER_MANIFEST[1].type)
    idx = m.column("bundle_index")
    manifest: bytes
    if case == "extra column":
        b = pa.record_batch([idx, refs, idx], names=["bundle_index", "slot_refs", "other"])
        manifest = _stream(b)
    elif case == "wrong type":
        b = pa.record_batch([idx.cast(pa.uint64()), refs], names=["bundle_index", "slot_refs"])
        manifest = _stream(b)
    elif case == "null ref":
        nulled = pa.array([*refs.to_pylist()[:-1], None], refs.type)
        manifest = _stream(pa.record_batch([idx, nulled], names=["bundle_index", "slot_refs"]))
    else:
        b = pa.RecordBatch.from_arrays([idx, refs], schema=QUIVER_MANIFEST)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, b.schema) as w:
            w.write_batch(b.slice(0, 2))
            w.write_batch(b.slice(2))
        manifest = bytes(sink.getvalue())
    bad = _resection(data, _stream(d), manifest)
    _, _, _, _, _, m_off, _ = struct.unpack("<HIIQIQI", bad[-50:-16])
    with pytest.raises(CorruptError, match="batch manifest") as e:
        seg.decode_segment(bad, "data/q.qseg")
    assert e.value.offset == m_off and e.value.obj == "data/q.qseg"
    with pytest.raises(CorruptError, match="batch manifest"):
        segt.parse_segment_tail(bad, "data/q.qseg")


def test_a_read_quiver_bundle_cannot_be_written_back_without_its_sequence() -> None:
    b = seg.decode_segment(_quiver_form(seg.encode_segment(BUNDLES)))[0]
    with pytest.raises(ValueError, match="sequence"):
        seg.SegmentBuilder().add(b)


def test_I7_an_empty_slot_refs_list_with_its_offset_past_the_child_is_not_a_crash() -> None:
    """pyarrow accepts (validate(full=True)) an empty list array whose only offset is 1
    over an empty child; slicing it then aborts the process.  The reader must answer
    such a manifest without slicing: run in a child process, so an abort fails this test
    instead of killing the run."""
    import subprocess
    import sys

    empty_struct = pa.array([], NN_SLOT_REF)
    refs = pa.Array.from_buffers(
        pa.list_(NN_SLOT_REF),
        0,
        [None, pa.py_buffer(struct.pack("<i", 1))],
        children=[empty_struct],
    )
    manifest = pa.RecordBatch.from_arrays(
        [pa.array([], pa.uint32()), refs], names=["bundle_index", "slot_refs"]
    )
    data = _resection(
        seg.encode_segment([]), _stream(_sections(seg.encode_segment([]))[0]), _stream(manifest)
    )
    code = (
        "import sys; from tieredbuf.format import segment as s\n"
        "from tieredbuf.errors import CorruptError\n"
        "try:\n    print(len(s.decode_segment(sys.stdin.buffer.read(), 'q')))\n"
        "except CorruptError as e:\n    print('corrupt', e.offset)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert p.stdout.decode().split() == ["0"], "an empty manifest: no bundles"


def test_the_spark_reader_times_quiver_bundles_by_their_queue_entry_or_refuses_a_window() -> None:
    """A two-column manifest has no bundle times.  A time-windowed read places such a
    bundle at its queue entry's time; with no entry time either it fails loudly rather
    than guessing (a guess would drop or add rows); without a window every row is read."""
    from tieredbuf.errors import TieredBufError
    from tieredbuf.format.manifest import MetadataItem
    from tieredbuf.spark import arrow as ta

    data = _quiver_form(seg.encode_segment(BUNDLES))
    schema = pa.schema(
        [("x", pa.int64()), (ta.SEQUENCE_COL, pa.int64()), (ta.BUNDLE_COL, pa.int32())]
    )

    def rows(md: tuple[MetadataItem, ...], lo: int | None, hi: int | None) -> list[int]:
        ref = ta.ObjectRef(7, "data/q.qseg", md)
        return [
            v
            for b in ta.bundle_batches(data, ref, 0, schema, lo, hi)
            for v in b.column("x").to_pylist()
        ]

    every = list(range(6)) * 2  # slot 0 is in bundles 0 and 3
    assert rows((), None, None) == every
    at = (MetadataItem(0, 5_000, b""),)
    assert rows(at, 4_000, 6_000) == every and rows(at, 6_000, None) == []
    with pytest.raises(TieredBufError, match="no ingestion time"):
        rows((), 4_000, 6_000)
