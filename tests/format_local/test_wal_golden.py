"""Golden bytes for the WAL header, entries and cursor sidecar, written by hand from
Quiver's layout (docs/format-local.md; struct.pack here, never the encoder), and I7 for
the decoders."""

from __future__ import annotations

import hashlib
import struct
import zlib

import pyarrow as pa
import pytest

from tieredbuf.errors import ConfigHashMismatchError, CorruptError, UnsupportedVersionError
from tieredbuf.format import cursor, wal

CFG = bytes(range(16))


def test_header_is_38_bytes_laid_out_as_quiver_specifies() -> None:
    # {magic: [u8;10], version: u16, header_size: u16, segment_cfg_hash: [u8;16],
    #  wal_position_start: u64}, little-endian
    expected = b"QUIVER\x00WAL" + struct.pack("<HH", 1, 38) + CFG + struct.pack("<Q", 4096)
    assert len(expected) == 38
    assert wal.encode_header(CFG, 4096) == expected
    h = wal.decode_header(expected, "f", CFG)
    assert (h.version, h.header_size, h.segment_cfg_hash, h.wal_position_start) == (
        1,
        38,
        CFG,
        4096,
    )


def test_header_with_larger_header_size_skips_unknown_trailing_fields() -> None:
    raw = b"QUIVER\x00WAL" + struct.pack("<HH", 1, 46) + CFG + struct.pack("<Q", 7) + b"x" * 8
    assert wal.decode_header(raw).header_size == 46


@pytest.mark.parametrize(
    ("raw", "err", "offset"),
    [
        (b"QUIVER\x00WAX" + struct.pack("<HH", 1, 38) + CFG + bytes(8), CorruptError, 0),
        (
            b"QUIVER\x00WAL" + struct.pack("<HH", 2, 38) + CFG + bytes(8),
            UnsupportedVersionError,
            10,
        ),
        (b"QUIVER\x00WAL" + struct.pack("<HH", 1, 30) + CFG + bytes(8), CorruptError, 12),
        (b"QUIVER\x00WAL" + struct.pack("<HH", 1, 38) + CFG, CorruptError, 30),
    ],
)
def test_bad_header_is_named(raw: bytes, err: type[Exception], offset: int) -> None:
    with pytest.raises(err) as ei:
        wal.decode_header(raw, "wal/quiver.wal")
    assert isinstance(ei.value, CorruptError)
    assert ei.value.obj == "wal/quiver.wal"
    assert ei.value.offset == offset


def test_config_hash_mismatch_is_refused_like_an_unknown_version() -> None:
    raw = wal.encode_header(CFG, 0)
    with pytest.raises(ConfigHashMismatchError):
        wal.decode_header(raw, "f", bytes(16))
    assert issubclass(ConfigHashMismatchError, UnsupportedVersionError)


def _frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body + struct.pack("<I", zlib.crc32(body))


def test_empty_record_bundle_entry() -> None:
    # u32 entry_len | u8 entry_type=0 | i64 ts | u64 seq | u64 slot_bitmap | u32 crc32
    body = struct.pack("<BqQQ", 0, -5, 9, 0)
    expected = _frame(body)
    assert len(expected) == 4 + 25 + 4
    assert b"".join(wal.encode_bundle_entry(9, -5, {})) == expected


def test_record_bundle_entry_with_two_slots() -> None:
    b1 = pa.record_batch({"a": pa.array([1, 2, 3], pa.int32())})
    b5 = pa.record_batch({"s": pa.array(["x", "y"]).dictionary_encode()})

    def ipc(b: pa.RecordBatch) -> bytes:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, b.schema) as w:
            w.write_batch(b)
        return bytes(sink.getvalue())

    def fp(b: pa.RecordBatch) -> bytes:
        return hashlib.sha256(b.schema.serialize().to_pybytes()).digest()

    p1, p5 = ipc(b1), ipc(b5)
    body = (
        struct.pack("<BqQ", 0, 1_700_000_000_000_000_000, 42)
        + struct.pack("<Q", (1 << 1) | (1 << 5))
        + struct.pack("<H32sII", 1, fp(b1), 3, len(p1))
        + p1
        + struct.pack("<H32sII", 5, fp(b5), 2, len(p5))
        + p5
    )
    expected = _frame(body)
    got = b"".join(wal.encode_bundle_entry(42, 1_700_000_000_000_000_000, {5: b5, 1: b1}))
    assert got == expected
    e = wal.decode_entry(memoryview(expected), 0, "f")
    assert isinstance(e, wal.BundleEntry)
    assert [s.slot for s in e.slots] == [1, 5]
    back = e.to_bundle()
    assert back[1].equals(b1)
    assert back[5].schema.field("s").type == b5.schema.field("s").type


def test_records_entry_tieredbuf_extension() -> None:
    # type 2: u32 metadata_len, metadata, u32 record_count, (u32 len, bytes)*
    body = (
        struct.pack("<BqQ", 2, 123, 7)
        + struct.pack("<I", 2)
        + b"md"
        + struct.pack("<I", 2)
        + struct.pack("<I", 1)
        + b"a"
        + struct.pack("<I", 0)
    )
    expected = _frame(body)
    assert b"".join(wal.encode_records_entry(7, 123, [b"a", b""], b"md")) == expected
    e = wal.decode_entry(memoryview(expected), 0)
    assert isinstance(e, wal.RecordsEntry)
    assert (e.sequence, e.ingestion_ts_nanos, e.records, e.metadata) == (7, 123, (b"a", b""), b"md")


def test_unknown_entry_type_is_skipped_by_length() -> None:
    unknown = _frame(struct.pack("<BqQ", 9, 1, 1) + b"future payload")
    known = _frame(struct.pack("<BqQQ", 0, 2, 2, 0))
    res = wal.scan(wal.encode_header(CFG, 0) + unknown + known, "f")
    assert res.status == "clean"
    assert isinstance(res.entries[0], wal.UnknownEntry)
    assert res.entries[0].entry_type == 9
    assert isinstance(res.entries[1], wal.BundleEntry)
    assert res.entries[1].sequence == 2


def test_logical_positions_exclude_the_header() -> None:
    e1 = _frame(struct.pack("<BqQQ", 0, 1, 1, 0))
    e2 = _frame(struct.pack("<BqQQ", 0, 1, 2, 0))
    res = wal.scan(wal.encode_header(CFG, 1000) + e1 + e2)
    assert list(wal.iter_positions(res.header, res.entries)) == [(1000, 1033), (1033, 1066)]


def test_crc_error_mid_file_is_corrupt_but_damaged_last_entry_is_torn() -> None:
    e1 = bytearray(_frame(struct.pack("<BqQQ", 0, 1, 1, 0)))
    e2 = _frame(struct.pack("<BqQQ", 0, 1, 2, 0))
    e1[10] ^= 0x40
    head = wal.encode_header(CFG, 0)
    mid = wal.scan(head + bytes(e1) + e2, "f")
    assert (mid.status, mid.good_end, len(mid.entries)) == ("corrupt", 38, 0)
    assert mid.error is not None and mid.error.offset == 38
    tail = wal.scan(head + e2 + bytes(e1), "f")
    assert (tail.status, tail.good_end, len(tail.entries)) == ("torn", 38 + 33, 1)
    partial = wal.scan(head + e2 + e2[:7])
    assert (partial.status, partial.good_end) == ("torn", 38 + 33)
    zeros = wal.scan(head + e2 + bytes(4096))
    assert (zeros.status, zeros.good_end) == ("torn", 38 + 33)
    with pytest.raises(CorruptError):
        wal.decode_wal(head + e2 + e2[:7], "f")


def test_valid_crc_over_garbage_arrow_payload_is_corrupt_not_arrow_error() -> None:
    body = (
        struct.pack("<BqQQ", 0, 1, 1, 1) + struct.pack("<H32sII", 0, bytes(32), 1, 8) + b"notarrow"
    )
    e = wal.decode_entry(memoryview(_frame(body)), 0, "f")
    assert isinstance(e, wal.BundleEntry)
    with pytest.raises(CorruptError):
        e.to_bundle("f")


def test_records_entry_with_impossible_count_is_rejected_before_allocating() -> None:
    body = struct.pack("<BqQ", 2, 1, 1) + struct.pack("<I", 0) + struct.pack("<I", 0xFFFF_FFFF)
    with pytest.raises(CorruptError, match="cannot fit"):
        wal.decode_entry(memoryview(_frame(body)), 0, "f")


# --- cursor sidecar ---------------------------------------------------------------


def test_cursor_sidecar_is_24_bytes_laid_out_as_quiver_specifies() -> None:
    body = b"QUIVER\x00T" + struct.pack("<HHQ", 1, 24, 0x0102030405060708)
    expected = body + struct.pack("<I", zlib.crc32(body))
    assert len(expected) == 24
    assert cursor.encode_cursor(0x0102030405060708) == expected
    assert cursor.decode_cursor(expected) == 0x0102030405060708


def test_cursor_v2_with_trailing_fields_is_read_by_a_v1_reader() -> None:
    body = b"QUIVER\x00T" + struct.pack("<HHQ", 2, 32, 99) + b"newfield"
    raw = body + struct.pack("<I", zlib.crc32(body))
    assert cursor.decode_cursor(raw) == 99


def test_cursor_damage_is_named() -> None:
    raw = bytearray(cursor.encode_cursor(5))
    raw[15] ^= 1
    with pytest.raises(CorruptError) as ei:
        cursor.decode_cursor(bytes(raw), "wal/quiver.wal.cursor")
    assert ei.value.obj == "wal/quiver.wal.cursor"
    assert ei.value.offset == 20
    with pytest.raises(CorruptError):
        cursor.decode_cursor(cursor.encode_sequence(5))  # wrong magic


# --- CRC of a body encoded before its sequence is known -------------------------------


@pytest.mark.parametrize("blen", [0, 1, 7, 4096, 70_001, 1 << 20])
def test_crc32_combine_matches_zlib_over_the_concatenation(blen: int) -> None:
    head, body = bytes(range(17)), bytes((i * 7) & 0xFF for i in range(blen))
    expected = zlib.crc32(head + body)
    assert wal.crc32_combine(zlib.crc32(head), zlib.crc32(body), blen) == expected
    assert wal.crc32_combine_py(zlib.crc32(head), zlib.crc32(body), blen) == expected


def test_a_body_encoded_outside_the_lock_frames_to_the_golden_bytes() -> None:
    """records_body + frame_entry (the stage's split) == the hand-packed layout."""
    recs = [b"x" * n for n in (0, 1, 300, 5000)] * 5  # > 8 parts: the coalesced path
    body = (
        struct.pack("<BqQ", 2, 123, 7)
        + struct.pack("<I", 2)
        + b"md"
        + struct.pack("<I", len(recs))
        + b"".join(struct.pack("<I", len(r)) + r for r in recs)
    )
    entry = wal.records_body(recs, b"md")
    assert b"".join(wal.frame_entry(7, 123, entry)) == _frame(body)
    assert b"".join(wal.frame_entry(7, 123, entry)) == b"".join(
        wal.encode_records_entry(7, 123, recs, b"md")
    )


@pytest.mark.parametrize("count", [4096, 4097, 20_000])
def test_a_body_of_many_records_is_coalesced_run_by_run_to_the_same_bytes(count: int) -> None:
    """More than 8192 parts are joined run by run into one buffer (no 80 bytes per
    part held by one big join): the same bytes, the same CRC, the same record block."""
    recs = [b"r%d" % i for i in range(count)]
    entry = wal.records_body(recs, b"md")
    assert len(entry.parts) == 1
    joined = b"".join(struct.pack("<I", len(r)) + r for r in recs)
    assert bytes(entry.parts[0]) == struct.pack("<I", 2) + b"md" + struct.pack("<I", count) + joined
    assert entry.crc == zlib.crc32(bytes(entry.parts[0]))
    block = wal.records_block(entry, b"md")
    assert block is not None and bytes(block) == joined
    assert b"".join(wal.frame_entry(7, 123, entry)) == b"".join(
        wal.encode_records_entry(7, 123, recs, b"md")
    )
