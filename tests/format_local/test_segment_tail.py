"""The .qseg tail parsed from ranged reads (parse_segment_tail and friends): it agrees
with SegmentReader on golden, generated and damaged bytes, needs at most two suffix
GETs, and damage it cannot tell from data (no CRC covers a ranged read) is read exactly
as the whole-object reader reads it; everything else is CorruptError (I7)."""

from __future__ import annotations

import dataclasses
import struct

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.format_local.test_fuzz import segment_bundles
from tests.fuzzing import FUZZ
from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format import segment as seg
from tieredbuf.format import segment_tail as segt
from tieredbuf.format.segment import SegmentBundle

_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _sample() -> bytes:
    a = pa.record_batch({"x": pa.array([1, 2, 3], pa.int64())})
    b = pa.record_batch({"x": pa.array([4], pa.int32()), "s": pa.array(["q"])})
    d = pa.record_batch({"s": pa.array(["u", "v"]).dictionary_encode()})
    return seg.encode_segment(
        [
            SegmentBundle({0: a, 3: d}, 10, 100),
            SegmentBundle({0: b}, 11, 101),
            SegmentBundle({0: a}, 12, 102),
            SegmentBundle({3: d}, 13, 103),
        ]
    )


SEG = _sample()
READER = seg.SegmentReader(SEG, "s")
TAIL_N = segt.segment_tail_size(SEG, "s")


def _suffix(n: int) -> bytes:
    return SEG[-n:] if n < len(SEG) else SEG


def test_tail_agrees_with_the_reader() -> None:
    t = segt.parse_segment_tail(_suffix(TAIL_N), "s")
    assert t.size == len(SEG)
    assert t.streams == READER.streams
    dir_off = struct.unpack_from("<HIIQ", SEG, len(SEG) - 16 - 34)[3]
    assert t.tail_offset == dir_off == len(SEG) - TAIL_N
    bundles = READER.bundles()
    assert [(b.ingestion_ts_nanos, b.sequence) for b in t.bundles] == [
        (b.ingestion_ts_nanos, b.sequence) for b in bundles
    ]
    assert [sorted(s for s, _, _ in b.refs) for b in t.bundles] == [
        sorted(b.slots) for b in bundles
    ]
    # file_size given explicitly: same answer; a longer suffix: same answer
    assert segt.parse_segment_tail(_suffix(TAIL_N), "s", len(SEG)) == t
    assert segt.parse_segment_tail(SEG, "s") == t


def test_streams_rebuild_every_bundle_with_its_index() -> None:
    t = segt.parse_segment_tail(_suffix(TAIL_N), "s")
    got: dict[tuple[int, int], pa.RecordBatch] = {}
    for s in t.streams:
        body = SEG[s.byte_offset : s.byte_offset + s.byte_length]
        n = segt.stream_schema_size(body[:16], s, "s")
        schema = segt.parse_stream_schema(body[:n], s, "s")
        chunks = segt.decode_stream(body, s, "s")
        assert all(c.schema.equals(schema) for c in chunks)
        for chunk, b in zip(chunks, t.stream_bundles(s.stream_id), strict=True):
            assert (b, s.slot_id) not in got
            got[(b, s.slot_id)] = chunk
    for i, bundle in enumerate(READER.bundles()):
        for slot, batch in bundle.slots.items():
            assert got.pop((i, slot)).equals(batch)
    assert not got


def test_two_suffix_gets_at_most() -> None:
    big = seg.encode_segment(
        SegmentBundle({0: pa.record_batch({"x": pa.array([i])})}, i, i) for i in range(3000)
    )
    first = big[-segt.SEGMENT_TAIL_GUESS :]
    need = segt.segment_tail_size(first, "b")
    assert need > len(first)  # the manifest of 3000 bundles outgrows the guess
    with pytest.raises(CorruptError, match="misses the sections"):
        segt.parse_segment_tail(first, "b")
    t = segt.parse_segment_tail(big[-need:], "b")
    assert len(t.bundles) == 3000 and t.size == len(big)
    assert segt.segment_tail_size(SEG[-segt.SEGMENT_TAIL_GUESS :]) == TAIL_N  # small: one GET


def test_empty_segment_tail() -> None:
    empty = seg.encode_segment([])
    t = segt.parse_segment_tail(empty[-segt.segment_tail_size(empty) :])
    assert t.size == len(empty) and t.streams == () and t.bundles == () and t.tail_offset == 0


def test_bad_tails_are_named() -> None:
    with pytest.raises(CorruptError, match="truncated") as e:
        segt.parse_segment_tail(SEG[-20:], "s")
    assert e.value.obj == "s"
    bad = bytearray(SEG)
    bad[-12:-4] = b"NOTQUIVR"
    with pytest.raises(CorruptError, match="magic"):
        segt.segment_tail_size(bytes(bad), "s")
    v2 = bytearray(SEG)
    struct.pack_into("<H", v2, len(SEG) - 16 - 34, 2)
    with pytest.raises(UnsupportedVersionError):
        segt.parse_segment_tail(bytes(v2), "s")
    with pytest.raises(CorruptError, match="cannot hold"):
        segt.parse_segment_tail(SEG[-TAIL_N:], "s", file_size=10)
    s0 = READER.streams[0]
    with pytest.raises(CorruptError, match="magic"):
        segt.stream_schema_size(b"\0" * 16, s0, "s")
    body = SEG[s0.byte_offset : s0.byte_offset + s0.byte_length]
    with pytest.raises(CorruptError, match="schema needs"):
        segt.parse_stream_schema(body[:20], s0, "s")
    with pytest.raises(CorruptError, match="fingerprint"):
        segt.parse_stream_schema(body, READER.streams[1], "s")
    with pytest.raises(CorruptError, match="directory says"):
        segt.decode_stream(body[:-1], s0, "s")
    with pytest.raises(CorruptError, match="disagrees"):
        segt.decode_stream(body, dataclasses.replace(s0, chunk_count=9), "s")


def _parse_all(tail: bytes, file_size: int | None = None) -> segt.SegmentTail:
    t = segt.parse_segment_tail(tail, "s", file_size)
    every = segt.bundles_by_stream(t)
    assert every == {s.stream_id: t.stream_bundles(s.stream_id) for s in t.streams}
    return t


def _agrees_with_the_reader(data: bytes) -> None:
    """parse_segment_tail (the ranged-read path) and SegmentReader without its CRC check
    (the whole-object path) read the same bytes the same way: both name damage, or both
    give the same directory and the same bundle refs."""
    try:
        r = seg.SegmentReader(data, "s", verify_crc=False)
    except CorruptError as e:
        assert 0 <= e.offset <= len(data)
        with pytest.raises(CorruptError) as te:
            segt.parse_segment_tail(data, "s", len(data))
        assert 0 <= te.value.offset <= len(data), te.value
        return
    t = _parse_all(data, len(data))
    assert t.streams == r.streams
    assert [(b.refs, b.ingestion_ts_nanos, b.sequence) for b in t.bundles] == r._manifest


@_SETTINGS
@given(st.integers(min_value=0, max_value=TAIL_N - 1))
def test_tail_truncation_is_always_corrupt(n: int) -> None:
    """A suffix shorter than segment_tail_size() says is refused, never misread."""
    with pytest.raises(CorruptError) as e:
        _parse_all(SEG[len(SEG) - n :] if n else b"")
    assert e.value.obj == "s"


@_SETTINGS
@given(st.integers(min_value=0, max_value=TAIL_N - 1), st.integers(min_value=0, max_value=7))
@example(2156, 0)  # found: a chunk index turned into another's; the reader delivered it twice
def test_tail_bit_flip_is_named_or_read_as_the_whole_object_reader_reads_it(
    i: int, bit: int
) -> None:
    """No CRC covers a ranged read: a flip in the tail either raises CorruptError or
    yields exactly what the whole-object reader makes of the same bytes."""
    data = bytearray(SEG)
    data[len(SEG) - TAIL_N + i] ^= 1 << bit
    _agrees_with_the_reader(bytes(data))


@FUZZ
@given(segment_bundles)
@pytest.mark.slow
def test_generated_segments_tail_agrees_with_the_reader(
    bundles: list[SegmentBundle],
) -> None:
    data = seg.encode_segment(bundles)
    _agrees_with_the_reader(data)
    need = segt.segment_tail_size(data[-max(64, len(data) // 2) :])
    assert segt.parse_segment_tail(data[-need:], "s") == _parse_all(data, len(data))


@_SETTINGS
@given(
    st.integers(min_value=0, max_value=len(SEG) - TAIL_N - 1), st.integers(min_value=0, max_value=7)
)
def test_stream_bit_flip_is_named_or_decodes_as_the_whole_object_reader_does(
    i: int, bit: int
) -> None:
    """A flip in the stream data region: a ranged stream read names it inside the
    stream, or decodes the chunks exactly as the whole-object reader does."""
    data = bytearray(SEG)
    data[i] ^= 1 << bit
    r = seg.SegmentReader(bytes(data), "s", verify_crc=False)  # the tail is untouched
    for s in READER.streams:
        body = bytes(data[s.byte_offset : s.byte_offset + s.byte_length])
        try:
            segt.parse_stream_schema(body, s, "s")
            got = segt.decode_stream(body, s, "s")
        except CorruptError as e:
            assert e.obj == "s" and s.byte_offset <= e.offset < s.byte_offset + s.byte_length
            continue
        whole = [r._chunk(s.stream_id, c) for c in range(s.chunk_count)]
        assert [b.to_pylist() for b in got] == [b.to_pylist() for b in whole]
