"""RFC 0001 data batch format: golden bytes built by hand from the RFC, and I7 fuzzing."""

from __future__ import annotations

import struct

import pyarrow as pa
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzzing import FUZZ, bits, cuts, damage, decoded_or_named, flips
from tieredbuf.config import Compression
from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format.batch import decode_batch, encode_batch


def test_golden_uncompressed_batch_matches_rfc_layout() -> None:
    # record 0: [len u32 LE][data]; record 1: ...; footer: type u8, count u32, version u16
    expected = (
        b"\x03\x00\x00\x00"
        + b"abc"
        + b"\x00\x00\x00\x00"  # an empty record
        + b"\x02\x00\x00\x00"
        + b"xy"
        + b"\x00"
        + b"\x03\x00\x00\x00"
        + b"\x01\x00"
    )
    assert encode_batch([b"abc", b"", b"xy"]) == expected
    assert decode_batch(expected) == [b"abc", b"", b"xy"]


def test_golden_zstd_batch_compresses_the_whole_block_at_level_3_with_its_checksum() -> None:
    block = struct.pack("<I", 5) + b"hello" + struct.pack("<I", 5) + b"world"
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(block)
    expected = frame + b"\x01\x02\x00\x00\x00\x01\x00"
    assert encode_batch([b"hello", b"world"], Compression.ZSTD) == expected
    assert decode_batch(expected) == [b"hello", b"world"]
    params = zstandard.get_frame_parameters(frame)
    assert params.has_checksum and params.content_size == len(block)
    # the last 4 bytes of the frame: XXH64 of the content, low 32 bits (RFC 8878 3.1.1)
    assert len(frame) == len(zstandard.ZstdCompressor(level=3).compress(block)) + 4


def test_I10_a_changed_byte_of_a_zstd_batch_is_refused_by_its_checksum_never_decoded() -> None:
    """Every single-byte change inside the frame of a zstd batch is a CorruptError naming
    the object: the frame checksum catches what decodes to other records."""
    recs = [f"record {i} ".encode() * 8 for i in range(20)]
    good = encode_batch(recs, Compression.ZSTD)
    frame_len = len(good) - 7
    served_wrong = []
    for at in range(frame_len):
        bad = good[:at] + bytes([good[at] ^ 0x01]) + good[at + 1 :]
        try:
            got = decode_batch(bad, obj="data/Z.batch")
        except CorruptError as e:
            assert e.obj == "data/Z.batch"
            continue
        if got != recs:
            served_wrong.append(at)
    assert served_wrong == []


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


# --- zstd record blocks: every shape RFC 8878 allows (frames written by hand) -----------

_RECORDS = [b"hello", b"", b"world!"]
_BLOCK = b"".join(struct.pack("<I", len(r)) + r for r in _RECORDS)
_ZSTD_FOOTER = b"\x01" + struct.pack("<I", len(_RECORDS)) + b"\x01\x00"


def _raw_frame(data: bytes, *, content_size: bool = False, checksum: bool = False) -> bytes:
    """One zstd frame holding ``data`` as a single raw block, byte by byte (RFC 8878
    3.1.1): magic, Frame_Header_Descriptor, Window_Descriptor (1 KiB), optional
    Frame_Content_Size (8 bytes), Block_Header (Last_Block=1, Block_Type=0 raw,
    Block_Size), the bytes, optional Content_Checksum (low 4 bytes of XXH64: zstandard
    computes it, since a checksum is not something to hand-write)."""
    assert len(data) <= 1024
    fhd = (0xC0 if content_size else 0) | (0x04 if checksum else 0)
    head = b"\x28\xb5\x2f\xfd" + bytes([fhd, 0x00])
    if content_size:
        head += struct.pack("<Q", len(data))
    block = struct.pack("<I", 1 | (len(data) << 3))[:3] + data
    frame = head + block
    if checksum:
        real = zstandard.ZstdCompressor(write_checksum=True, write_content_size=False)
        frame += real.compress(data)[-4:]
    return frame


def test_golden_zstd_frame_without_content_size_is_accepted() -> None:
    """A streaming encoder cannot know the size up front: its frame header leaves
    Frame_Content_Size out (zstandard reports 2**64 - 1).  Such a block decodes."""
    frame = _raw_frame(_BLOCK)
    assert zstandard.get_frame_parameters(frame).content_size == zstandard.CONTENTSIZE_UNKNOWN
    assert decode_batch(frame + _ZSTD_FOOTER) == _RECORDS


def test_a_real_streaming_encoders_block_is_accepted() -> None:
    import io

    sink = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(sink, closefd=False) as w:
        for r in _RECORDS:  # written piece by piece, as a streaming producer would
            w.write(struct.pack("<I", len(r)))
            w.write(r)
    block = sink.getvalue()
    assert zstandard.get_frame_parameters(block).content_size == zstandard.CONTENTSIZE_UNKNOWN
    assert decode_batch(block + _ZSTD_FOOTER) == _RECORDS


def test_golden_several_frames_and_a_skippable_frame_are_one_block() -> None:
    """RFC 8878: a zstd stream is frames one after another; skippable frames (magic
    0x184D2A5?) carry no content.  The record block is the frames' contents joined, so a
    record may even straddle two frames."""
    cut = 7  # inside record 0's data
    skippable = struct.pack("<II", 0x184D2A53, 3) + b"xyz"
    data = (
        _raw_frame(_BLOCK[:cut], content_size=True)
        + skippable
        + _raw_frame(_BLOCK[cut:], checksum=True)
    ) + _ZSTD_FOOTER
    assert decode_batch(data) == _RECORDS
    two = zstandard.ZstdCompressor(level=3)
    data = two.compress(_BLOCK[:cut]) + two.compress(_BLOCK[cut:]) + _ZSTD_FOOTER
    assert decode_batch(data) == _RECORDS


def test_golden_rle_block_frame_is_accepted() -> None:
    # one record of 600 x "a": [len][RLE block of 600 bytes of 0x61]
    rle = struct.pack("<I", 1 | (1 << 1) | (600 << 3))[:3] + b"a"
    frames = (
        _raw_frame(struct.pack("<I", 600), content_size=True) + b"\x28\xb5\x2f\xfd\x00\x00" + rle
    )
    data = frames + b"\x01" + struct.pack("<I", 1) + b"\x01\x00"
    assert decode_batch(data) == [b"a" * 600]


@pytest.mark.parametrize(
    ("name", "block", "offset", "match"),
    [
        ("empty block", b"", 0, "no frame"),
        ("not zstd", b"garbage!", 0, "not a zstd frame"),
        (
            "second frame not zstd",
            _raw_frame(_BLOCK) + b"garbage!",
            len(_raw_frame(_BLOCK)),
            "not a zstd frame",
        ),
        (
            "trailing partial frame",
            _raw_frame(_BLOCK) + b"\x28\xb5",
            len(_raw_frame(_BLOCK)),
            "trailing bytes",
        ),
        ("frame cut short", _raw_frame(_BLOCK)[:-3], 0, "runs past the block"),
        (
            "skippable frame cut short",
            struct.pack("<II", 0x184D2A50, 99) + b"abc",
            0,
            "runs past the block",
        ),
        (
            "reserved block type",
            b"\x28\xb5\x2f\xfd\x00\x00" + bytes([0x07, 0, 0]),
            6,
            "reserved type",
        ),
        (
            "dictionary frame",
            b"\x28\xb5\x2f\xfd\x01\x00\x07" + bytes([0x01, 0, 0]),
            0,
            "dictionary 7",
        ),
        ("bad checksum", _raw_frame(_BLOCK, checksum=True)[:-1] + b"\x00", 0, "zstd frame"),
        (
            "declared size is a lie",
            _raw_frame(_BLOCK, content_size=True)[:6]
            + struct.pack("<Q", len(_BLOCK) + 1)
            + _raw_frame(_BLOCK, content_size=True)[14:],
            0,
            "zstd frame",
        ),
    ],
)
def test_I7_bad_zstd_blocks_are_named_at_the_frame(
    name: str, block: bytes, offset: int, match: str
) -> None:
    with pytest.raises(CorruptError, match=match) as e:
        decode_batch(block + _ZSTD_FOOTER, obj="data/Z.batch")
    assert e.value.obj == "data/Z.batch" and e.value.offset == offset, name


def test_I7_zstd_frame_declaring_more_than_the_cap_is_refused_before_decoding() -> None:
    huge = b"\x28\xb5\x2f\xfd\xc0\x00" + struct.pack("<Q", (1 << 31) + 1)
    huge += struct.pack("<I", 1 | (1 << 1) | (16 << 3))[:3] + b"a"
    with pytest.raises(CorruptError, match="declares 2147483649 bytes") as e:
        decode_batch(_raw_frame(_BLOCK) + huge + _ZSTD_FOOTER)
    assert e.value.offset == len(_raw_frame(_BLOCK))


def test_I7_unsized_zstd_frames_are_cut_off_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap (2 GiB) bounds the sum over frames, including frames that do not say
    their size; a smaller cap stands in for it here so the test allocates little."""
    import tieredbuf.format.batch as fb

    monkeypatch.setattr(fb, "MAX_DECOMPRESSED", 4096)
    big = zstandard.ZstdCompressor(write_content_size=False).compress(b"\x00" * 100_000)
    with pytest.raises(CorruptError, match="inflates past 4096") as e:
        decode_batch(_raw_frame(_BLOCK) + big + _ZSTD_FOOTER)
    assert e.value.offset == len(_raw_frame(_BLOCK))
    sized = zstandard.ZstdCompressor().compress(b"\x00" * 4090)
    with pytest.raises(CorruptError, match="declares 4090 bytes"):
        decode_batch(_raw_frame(_BLOCK) + sized + _ZSTD_FOOTER)


def test_I7_a_fault_in_a_zstd_blocks_records_is_named_inside_the_object() -> None:
    """A zstd block whose records stop short of the count: the fault lies at an offset
    of the decompressed bytes, which can lie past the object's end (the fuzzer found
    offset 103 in a 101-byte batch).  The error names the compressed block (offset 0)
    and says where in its decompressed bytes."""
    block = struct.pack("<I", 200) + bytes(200)  # one record; the footer says two
    damaged = zstandard.ZstdCompressor(level=3).compress(block) + struct.pack("<BIH", 1, 2, 1)
    assert len(damaged) < len(block)
    with pytest.raises(CorruptError) as got:
        decode_batch(damaged, obj="o")
    assert 0 <= got.value.offset < len(damaged)
    assert "decompressed block, at its offset 204: truncated: record 1 length" in str(got.value)


def test_I7_trailing_garbage_is_rejected() -> None:
    good = encode_batch([b"ab"])
    bad = good[:-7] + b"zz" + good[-7:]
    with pytest.raises(CorruptError, match="trailing"):
        decode_batch(bad)


records_st = st.lists(st.binary(max_size=40), max_size=8)


@FUZZ
@given(records=records_st, zstd=st.booleans(), cut=cuts, flip=flips, bit=bits)
def test_I7_damaged_batches_decode_to_what_the_encoder_writes_or_name_the_offset(
    records: list[bytes], zstd: bool, cut: int, flip: int, bit: int
) -> None:
    comp = Compression.ZSTD if zstd else Compression.NONE
    data = encode_batch(records, comp)
    assert decode_batch(data) == records
    bad = damage(data, cut, flip, bit)
    got = decoded_or_named(lambda b: decode_batch(b, obj="o"), bad, "o")
    if got is None:
        return
    if bad[-7] == Compression.NONE:
        assert encode_batch(got) == bad, "an uncompressed batch has one encoding"
    else:
        assert bad[-7] == Compression.ZSTD
        assert decode_batch(encode_batch(got, Compression.ZSTD)) == got
    from tieredbuf.format.batch import decode_batch_arrow

    assert decode_batch_arrow(bad, obj="o").to_pylist() == got


@st.composite
def _zstd_shapes(draw: st.DrawFn) -> tuple[list[bytes], bytes]:
    """Records, and a record block split into frames of every shape zstd allows."""
    records = draw(st.lists(st.binary(max_size=300), max_size=10))
    block = b"".join(struct.pack("<I", len(r)) + r for r in records)
    cuts_ = sorted(draw(st.lists(st.integers(0, len(block)), max_size=3)))
    frames = []
    for lo, hi in zip([0, *cuts_], [*cuts_, len(block)], strict=True):
        size, check = draw(st.booleans()), draw(st.booleans())
        enc = zstandard.ZstdCompressor(
            level=draw(st.integers(1, 5)), write_checksum=check, write_content_size=size
        )
        if draw(st.booleans()):
            frames.append(enc.compress(block[lo:hi]))
        else:
            obj = enc.compressobj()  # streaming: no content size in the header
            frames.append(obj.compress(block[lo:hi]) + obj.flush())
        if draw(st.booleans()):
            junk = draw(st.binary(max_size=8))
            frames.append(
                struct.pack("<II", 0x184D2A50 | draw(st.integers(0, 15)), len(junk)) + junk
            )
    return records, b"".join(frames) + b"\x01" + struct.pack("<IH", len(records), 1)


@FUZZ
@given(_zstd_shapes())
def test_zstd_blocks_of_any_frame_shape_decode_to_their_records(
    shape: tuple[list[bytes], bytes],
) -> None:
    from tieredbuf.format.batch import decode_batch_arrow

    records, data = shape
    assert decode_batch(data) == records
    assert decode_batch_arrow(data).to_pylist() == records


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
        assert 0 <= expected.offset <= len(mutated)
        with pytest.raises(CorruptError) as got:
            decode_batch_arrow(bytes(mutated), obj="o")
        assert got.value.obj == "o" and 0 <= got.value.offset <= len(mutated)
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
