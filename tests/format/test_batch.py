"""RFC 0001 data batch format: golden bytes built by hand from the RFC, and I7 fuzzing."""

from __future__ import annotations

import struct

import pyarrow as pa
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredbuf.config import Compression
from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format.batch import decode_batch, encode_batch


def test_golden_uncompressed_batch_matches_rfc_layout() -> None:
    # record 0: [len u32 LE][data]; record 1: ...; footer: type u8, count u32, version u16
    expected = (
        b"\x03\x00\x00\x00" + b"abc"
        + b"\x00\x00\x00\x00"  # an empty record
        + b"\x02\x00\x00\x00" + b"xy"
        + b"\x00" + b"\x03\x00\x00\x00" + b"\x01\x00"
    )
    assert encode_batch([b"abc", b"", b"xy"]) == expected
    assert decode_batch(expected) == [b"abc", b"", b"xy"]


def test_golden_zstd_batch_compresses_the_whole_block_at_level_3() -> None:
    block = struct.pack("<I", 5) + b"hello" + struct.pack("<I", 5) + b"world"
    expected = zstandard.ZstdCompressor(level=3).compress(block) + b"\x01\x02\x00\x00\x00\x01\x00"
    assert encode_batch([b"hello", b"world"], Compression.ZSTD) == expected
    assert decode_batch(expected) == [b"hello", b"world"]


def test_empty_batch_is_only_a_footer() -> None:
    assert encode_batch([]) == b"\x00\x00\x00\x00\x00\x01\x00"
    assert decode_batch(b"\x00\x00\x00\x00\x00\x01\x00") == []


def test_I7_unknown_version_is_named() -> None:
    bad = encode_batch([b"a"])[:-2] + b"\x02\x00"
    with pytest.raises(UnsupportedVersionError) as e:
        decode_batch(bad, obj="data/X.batch")
    assert "data/X.batch" in str(e.value) and e.value.offset == len(bad) - 2


def test_I7_oversized_length_is_rejected_without_allocating() -> None:
    bad = struct.pack("<I", 0xFFFF_FFF0) + b"abc" + b"\x00\x01\x00\x00\x00\x01\x00"
    with pytest.raises(CorruptError) as e:
        decode_batch(bad, obj="data/Y.batch")
    assert e.value.offset == 4 and "record 0 data" in str(e.value)


def test_I7_huge_record_count_is_rejected_before_allocating() -> None:
    bad = b"\x00" + struct.pack("<I", 0xFFFF_FFFF) + b"\x01\x00"
    with pytest.raises(CorruptError, match="cannot fit"):
        decode_batch(bad)


def test_I7_unknown_compression_and_corrupt_zstd_are_named() -> None:
    with pytest.raises(CorruptError, match="compression type 7"):
        decode_batch(b"\x07\x00\x00\x00\x00\x01\x00")
    with pytest.raises(CorruptError, match="zstd"):
        decode_batch(b"garbage!" + b"\x01\x01\x00\x00\x00\x01\x00")


def test_I7_trailing_garbage_is_rejected() -> None:
    good = encode_batch([b"ab"])
    bad = good[:-7] + b"zz" + good[-7:]
    with pytest.raises(CorruptError, match="trailing"):
        decode_batch(bad)


@settings(max_examples=300, deadline=None)
@given(
    records=st.lists(st.binary(max_size=40), max_size=8),
    zstd=st.booleans(),
    cut=st.integers(min_value=0, max_value=10_000),
    flip=st.integers(min_value=0, max_value=10_000),
)
def test_I7_truncated_or_flipped_batches_decode_or_raise_corrupt(
    records: list[bytes], zstd: bool, cut: int, flip: int
) -> None:
    data = bytearray(encode_batch(records, Compression.ZSTD if zstd else Compression.NONE))
    assert decode_batch(bytes(data)) == records
    mutated = bytearray(data[: cut % (len(data) + 1)])
    if mutated:
        mutated[flip % len(mutated)] ^= 0x5A
    try:
        decode_batch(bytes(mutated), obj="o")
    except CorruptError as e:
        assert e.obj == "o"


@settings(max_examples=200, deadline=None)
@given(
    records=st.lists(st.binary(max_size=40), max_size=12),
    zstd=st.booleans(),
    cut=st.integers(min_value=0, max_value=10_000),
    flip=st.integers(min_value=0, max_value=10_000),
)
def test_I7_arrow_decoder_agrees_with_decode_batch_on_good_and_bad_bytes(
    records: list[bytes], zstd: bool, cut: int, flip: int
) -> None:
    from tieredbuf.format.batch import decode_batch_arrow, encode_batch_parts

    comp = Compression.ZSTD if zstd else Compression.NONE
    data = encode_batch(records, comp)
    assert b"".join(encode_batch_parts(records, comp)) == data
    assert decode_batch_arrow(data).to_pylist() == records
    _assert_arrow_agrees(data[: cut % (len(data) + 1)], flip)


def _assert_arrow_agrees(data: bytes, flip: int) -> None:
    """``data`` with one byte flipped decodes (or fails) in decode_batch_arrow exactly
    as it does in decode_batch."""
    from tieredbuf.format.batch import decode_batch_arrow

    mutated = bytearray(data)
    if mutated:
        mutated[flip % len(mutated)] ^= 0x5A
    try:
        expected: list[bytes] | CorruptError = decode_batch(bytes(mutated), obj="o")
    except CorruptError as e:
        expected = e
    if isinstance(expected, CorruptError):
        with pytest.raises(CorruptError) as got:
            decode_batch_arrow(bytes(mutated), obj="o")
        assert got.value.obj == "o"
    else:
        assert decode_batch_arrow(bytes(mutated), obj="o").to_pylist() == expected


@settings(max_examples=200, deadline=None)
@given(
    width=st.integers(min_value=0, max_value=12),
    count=st.integers(min_value=1, max_value=10),
    seed=st.binary(min_size=12, max_size=12),
    cut=st.integers(min_value=0, max_value=10_000),
    flip=st.integers(min_value=0, max_value=10_000),
)
def test_I7_arrow_decoder_fixed_width_path_agrees_with_decode_batch(
    width: int, count: int, seed: bytes, cut: int, flip: int
) -> None:
    """Records of one length take the reshape path; mutated ones must still decode
    (or fail) exactly as decode_batch does."""
    from tieredbuf.format.batch import decode_batch_arrow

    records = [bytes((b + i) % 256 for b in seed[:width]) for i in range(count)]
    data = encode_batch(records)
    got = decode_batch_arrow(data)
    assert got.to_pylist() == records and got.type == pa.binary()
    _assert_arrow_agrees(data[: cut % (len(data) + 1)] if cut % 3 == 0 else data, flip)
