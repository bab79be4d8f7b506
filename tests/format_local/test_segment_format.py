"""The .qseg segment: golden footer/trailer bytes from Quiver's layout, round trips
(schema drift, dictionary key types, slot hydration, zero-copy), and I7."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pyarrow as pa
import pytest

from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format import segment as seg
from tieredbuf.format.segment import SegmentBundle


def _ipc_stream(b: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, b.schema) as w:
        w.write_batch(b)
    return bytes(sink.getvalue())


def test_empty_segment_footer_and_trailer_golden() -> None:
    directory = _ipc_stream(pa.RecordBatch.from_pylist([], schema=seg.DIRECTORY_SCHEMA))
    manifest = _ipc_stream(pa.RecordBatch.from_pylist([], schema=seg.MANIFEST_SCHEMA))
    # Footer v1 (34 bytes): version u16, stream_count u32, bundle_count u32,
    # directory_offset u64, directory_length u32, manifest_offset u64, manifest_length u32
    footer = struct.pack("<HIIQIQI", 1, 0, 0, 0, len(directory), len(directory), len(manifest))
    assert len(footer) == 34
    # Trailer (16 bytes): footer_size u32, magic b"QUIVER\0S", crc32 over all before it
    head = directory + manifest + footer + struct.pack("<I", 34) + b"QUIVER\x00S"
    expected = head + struct.pack("<I", zlib.crc32(head))
    assert seg.encode_segment([]) == expected
    assert seg.decode_segment(expected) == []


def test_footer_fields_and_64_byte_stream_alignment() -> None:
    a = pa.record_batch({"x": pa.array(range(5), pa.int64())})
    b = pa.record_batch({"y": pa.array(["p"] * 3)})
    data = seg.encode_segment(
        [
            SegmentBundle({0: a, 1: b}, 10, 1),
            SegmentBundle({0: a}, 11, 2),
        ]
    )
    trailer = data[-16:]
    footer_size, magic, crc = struct.unpack("<I8sI", trailer)
    assert (footer_size, magic) == (34, b"QUIVER\x00S")
    assert crc == zlib.crc32(data[:-4])
    version, streams, bundles, d_off, d_len, m_off, m_len = struct.unpack("<HIIQIQI", data[-50:-16])
    assert (version, streams, bundles) == (1, 2, 2)
    assert m_off == d_off + d_len and m_off + m_len == len(data) - 50
    r = seg.SegmentReader(data, "s")
    assert [s.byte_offset % 64 for s in r.streams] == [0, 0]
    assert [(s.slot_id, s.chunk_count, s.row_count) for s in r.streams] == [(0, 2, 10), (1, 1, 3)]
    # each stream is a standalone Arrow IPC file
    s0 = r.streams[0]
    f = pa.ipc.open_file(pa.py_buffer(data[s0.byte_offset : s0.byte_offset + s0.byte_length]))
    assert f.num_record_batches == 2


def _same(x: SegmentBundle, y: SegmentBundle) -> None:
    assert (x.sequence, x.ingestion_ts_nanos) == (y.sequence, y.ingestion_ts_nanos)
    assert sorted(x.slots) == sorted(y.slots)
    for k in x.slots:
        assert y.slots[k].schema.equals(x.slots[k].schema, check_metadata=True)
        assert y.slots[k].equals(x.slots[k])


def test_round_trip_with_schema_drift_absent_slots_and_dictionary_key_types() -> None:
    logs1 = pa.record_batch({"body": pa.array(["a", "b"]), "n": pa.array([1, 2])})
    logs2 = pa.record_batch(
        {"body": pa.array(["c"]), "n": pa.array([3]), "extra": pa.array([True])}
    )
    d8 = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0], pa.uint8()), pa.array(["k", "v"]))
    d16 = pa.DictionaryArray.from_arrays(pa.array([1, 0], pa.uint16()), pa.array(["v", "k"]))
    d8b = pa.DictionaryArray.from_arrays(pa.array([0], pa.uint8()), pa.array(["other"]))
    attrs8 = pa.record_batch({"key": d8})
    attrs16 = pa.record_batch({"key": d16})
    attrs8b = pa.record_batch({"key": d8b})
    bundles = [
        SegmentBundle({1: logs1, 2: attrs8}, 100, 1),
        SegmentBundle({1: logs1, 2: attrs16, 31: logs1}, 101, 2),
        SegmentBundle({1: logs2, 2: attrs8b}, 102, 3),
        SegmentBundle({2: attrs8}, 103, 4),
        SegmentBundle({}, 104, 5),
    ]
    r = seg.SegmentReader(seg.encode_segment(bundles), "s")
    out = r.bundles()
    assert len(out) == len(bundles)
    for x, y in zip(bundles, out, strict=True):
        _same(x, y)
    assert out[1].slots[2].column(0).type.index_type == pa.uint16()
    assert out[0].slots[2].column(0).type.index_type == pa.uint8()
    # logs1/logs2 are two streams (drift); attrs8 and attrs8b share a fingerprint but
    # not a dictionary, so they are two streams as well; attrs8 is reused in bundle 3
    slot2 = [s for s in r.streams if s.slot_id == 2]
    assert len(slot2) == 3
    assert len({s.schema_fingerprint for s in slot2}) == 2


def test_hydrate_only_requested_slots() -> None:
    a = pa.record_batch({"x": [1]})
    b = pa.record_batch({"y": [2.0]})
    r = seg.SegmentReader(seg.encode_segment([SegmentBundle({0: a, 7: b}, 1, 1)]))
    (only,) = r.bundles(slots=[7])
    assert list(only.slots) == [7]


def test_zero_copy_from_a_memory_map(tmp_path: Path) -> None:
    a = pa.record_batch({"x": pa.array(range(1000), pa.int64())})
    p = tmp_path / "s.qseg"
    p.write_bytes(seg.encode_segment([SegmentBundle({0: a}, 1, 1)]))
    with pa.memory_map(str(p)) as mm:
        buf = mm.read_buffer()
        (b,) = seg.SegmentReader(buf).bundles()
        col = b.slots[0].column(0)
        data_addr = col.buffers()[1].address
        assert buf.address <= data_addr < buf.address + buf.size
        assert b.slots[0].equals(a)


def _sample() -> bytes:
    a = pa.record_batch({"x": pa.array(range(20), pa.int64())})
    d = pa.record_batch({"k": pa.array(["a", "b", "a"]).dictionary_encode()})
    return seg.encode_segment([SegmentBundle({0: a, 3: d}, 1, 1), SegmentBundle({3: d}, 2, 2)])


def test_truncated_and_bad_magic_and_unknown_version_are_named() -> None:
    data = _sample()
    with pytest.raises(CorruptError) as ei:
        seg.decode_segment(data[:10], "data/x.qseg")
    assert ei.value.obj == "data/x.qseg"
    bad = bytearray(data)
    bad[-10] ^= 0xFF
    with pytest.raises(CorruptError, match="magic"):
        seg.decode_segment(bytes(bad))
    # a version bump with a correct CRC: refused as unsupported
    v = bytearray(data)
    struct.pack_into("<H", v, len(v) - 50, 2)
    struct.pack_into("<I", v, len(v) - 4, zlib.crc32(bytes(v[:-4])))
    with pytest.raises(UnsupportedVersionError) as ve:
        seg.decode_segment(bytes(v), "s")
    assert ve.value.offset == len(v) - 50


def test_manifest_pointing_past_the_directory_is_corrupt_even_with_good_crc() -> None:
    data = bytearray(_sample())
    f_at = len(data) - 50
    struct.pack_into("<I", data, f_at + 6, 0)  # bundle_count := 0, disagrees with manifest
    struct.pack_into("<I", data, len(data) - 4, zlib.crc32(bytes(data[:-4])))
    with pytest.raises(CorruptError, match="disagree"):
        seg.decode_segment(bytes(data))
