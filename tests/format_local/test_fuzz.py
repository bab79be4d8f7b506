"""I7 by property for the local-tier codecs (WAL files, cursor and sequence sidecars,
.qseg segments): generated values round-trip exactly, and damaged bytes either decode
to what the encoder writes or raise CorruptError naming an offset inside the input
(the rules are in tests/fuzzing.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.fuzzing import FUZZ, bits, cuts, damage, decoded_or_named, flips
from tieredbuf.format import cursor, segment, wal

CFG = b"\x11" * 16
u64 = st.integers(0, (1 << 64) - 1)
i64 = st.integers(-(1 << 63), (1 << 63) - 1)


@st.composite
def arrow_batches(draw: st.DrawFn) -> pa.RecordBatch:
    """Small batches of the shapes bundles carry: ints, strings, dictionaries with
    different key types, structs, lists (with nulls)."""
    n = draw(st.integers(0, 5))
    kind = draw(st.sampled_from(["int", "str", "dict8", "dict16", "struct", "list"]))
    ints = draw(st.lists(st.none() | st.integers(-1000, 1000), min_size=n, max_size=n))
    strs = draw(st.lists(st.none() | st.text(max_size=4), min_size=n, max_size=n))
    if kind == "int":
        return pa.record_batch({"x": pa.array(ints, pa.int64())})
    if kind == "str":
        return pa.record_batch({"s": pa.array(strs, pa.string())})
    if kind in ("dict8", "dict16"):
        key = pa.int8() if kind == "dict8" else pa.uint16()
        col = pa.array(strs, pa.string()).dictionary_encode().cast(pa.dictionary(key, pa.string()))
        return pa.record_batch({"k": col})
    if kind == "struct":
        col = pa.StructArray.from_arrays(
            [pa.array(ints, pa.int32()), pa.array(strs)], names=["a", "b"]
        )
        return pa.record_batch({"st": col})
    return pa.record_batch(
        {"l": pa.array([None if v is None else [v, v] for v in ints], pa.list_(pa.int64()))}
    )


bundles_st = st.dictionaries(st.integers(0, wal.MAX_SLOTS - 1), arrow_batches(), max_size=3)


def _same_bundle(a: dict[int, pa.RecordBatch], b: dict[int, pa.RecordBatch]) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].schema.equals(b[k].schema, check_metadata=True) and a[k].equals(b[k]) for k in a
    )


# --- WAL ------------------------------------------------------------------------

WalItem = tuple[int, int, "dict[int, pa.RecordBatch] | tuple[list[bytes], bytes]"]

wal_items = st.lists(
    st.tuples(
        u64,
        i64,
        bundles_st | st.tuples(st.lists(st.binary(max_size=20), max_size=4), st.binary(max_size=8)),
    ),
    max_size=4,
)


def _encode_wal(start: int, items: list[WalItem]) -> tuple[bytes, list[int]]:
    """The file, and the offset where each entry ends (the header's end first)."""
    data = wal.encode_header(CFG, start)
    bounds = [len(data)]
    for seq, ts, body in items:
        if isinstance(body, dict):
            parts = wal.encode_bundle_entry(seq, ts, body)
        else:
            parts = wal.encode_records_entry(seq, ts, body[0], body[1])
        data += b"".join(bytes(p) for p in parts)
        bounds.append(len(data))
    return data, bounds


def _decode_wal(data: bytes) -> tuple[int, list[WalItem]]:
    header, entries = wal.decode_wal(data, "f", CFG)
    out: list[WalItem] = []
    for e in entries:
        if isinstance(e, wal.BundleEntry):
            out.append((e.sequence, e.ingestion_ts_nanos, e.to_bundle("f")))
        else:
            assert isinstance(e, wal.RecordsEntry)
            out.append((e.sequence, e.ingestion_ts_nanos, (list(e.records), e.metadata)))
    return header.wal_position_start, out


def _same_items(a: list[WalItem], b: list[WalItem]) -> bool:
    return len(a) == len(b) and all(
        x[:2] == y[:2]
        and (
            _same_bundle(x[2], y[2])
            if isinstance(x[2], dict) and isinstance(y[2], dict)
            else x[2] == y[2]
        )
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.slow
@FUZZ
@given(u64, wal_items)
def test_wal_files_round_trip(start: int, items: list[WalItem]) -> None:
    data, _ = _encode_wal(start, items)
    got_start, got = _decode_wal(data)
    assert got_start == start and _same_items(got, items)


@pytest.mark.slow
@FUZZ
@given(u64, wal_items, cuts)
def test_I7_a_cut_wal_is_exactly_an_entry_prefix_or_torn_at_the_cut_entry(
    start: int, items: list[WalItem], cut: int
) -> None:
    data, bounds = _encode_wal(start, items)
    n = cut % (len(data) + 1)
    got = decoded_or_named(_decode_wal, data[:n], "f")
    if got is None:
        assert n not in bounds
        if n >= bounds[0]:
            res = wal.scan(data[:n], "f", CFG)
            assert res.status == "torn" and res.good_end == max(b for b in bounds if b <= n)
        return
    assert n in bounds
    assert got[0] == start and _same_items(got[1], items[: bounds.index(n)])


@pytest.mark.slow
@FUZZ
@given(u64, wal_items, flips, bits)
def test_I7_any_bit_flip_in_a_wal_is_named(
    start: int, items: list[WalItem], flip: int, bit: int
) -> None:
    """Every entry byte is under its CRC and every header field is checked, except
    wal_position_start (bytes 30..38): Quiver's header has no checksum, so a flip there
    is undetectable by design and left out of this property."""
    data, _ = _encode_wal(start, items)
    assume(not 30 <= flip % len(data) < 38)
    bad = damage(data, 0, flip, bit, keep_length=True)
    assert decoded_or_named(_decode_wal, bad, "f") is None, "a flipped bit went unnoticed"


@FUZZ
@given(st.binary(max_size=300), u64)
def test_I7_scanning_arbitrary_bytes_is_consistent(junk: bytes, start: int) -> None:
    """scan() on anything: a header error, or entries that are exactly what a strict
    decode of the bytes up to ``good_end`` gives, with the damage (if any) named in the
    frame that starts there."""
    for data in (junk, wal.encode_header(CFG, start) + junk):
        res = decoded_or_named(lambda b: wal.scan(b, "f"), data, "f")
        if res is None:
            continue
        assert res.header.header_size <= res.good_end <= len(data)
        assert wal.decode_wal(data[: res.good_end], "f")[1] == res.entries
        if res.status == "clean":
            assert res.good_end == len(data) and res.error is None
        else:
            assert res.error is not None and res.good_end <= res.error.offset <= len(data)


# --- cursor and sequence sidecars ---------------------------------------------------

_SIDECARS = [
    (cursor.encode_cursor, cursor.decode_cursor),
    (cursor.encode_sequence, cursor.decode_sequence),
]


@FUZZ
@given(st.sampled_from(_SIDECARS), u64, cuts, flips, bits)
def test_I7_sidecars_round_trip_and_any_damage_is_named(
    codec: tuple[object, object], value: int, cut: int, flip: int, bit: int
) -> None:
    encode, decode = codec
    data = encode(value)  # type: ignore[operator]
    assert decode(data, "c") == value  # type: ignore[operator]
    for bad in (damage(data, cut, flip, bit, keep_length=True), data[: cut % len(data)]):
        got = decoded_or_named(lambda b: decode(b, "c"), bad, "c")  # type: ignore[operator]
        assert got is None, "damage went unnoticed"


# --- segments ---------------------------------------------------------------------

segment_bundles = st.lists(st.builds(segment.SegmentBundle, bundles_st, i64, u64), max_size=4)


def _decode_seg(data: bytes, verify_crc: bool = True) -> list[segment.SegmentBundle]:
    return segment.SegmentReader(data, "s", verify_crc=verify_crc).bundles()


def _same_segment(a: list[segment.SegmentBundle], b: list[segment.SegmentBundle]) -> bool:
    return len(a) == len(b) and all(
        (x.ingestion_ts_nanos, x.sequence) == (y.ingestion_ts_nanos, y.sequence)
        and _same_bundle(dict(x.slots), dict(y.slots))
        for x, y in zip(a, b, strict=True)
    )


@FUZZ
@given(segment_bundles)
@pytest.mark.slow
def test_segments_round_trip(bundles: list[segment.SegmentBundle]) -> None:
    assert _same_segment(_decode_seg(segment.encode_segment(bundles)), bundles)


@FUZZ
@given(segment_bundles, cuts, flips, bits)
@pytest.mark.slow
def test_I7_a_cut_or_flipped_segment_is_always_named(
    bundles: list[segment.SegmentBundle], cut: int, flip: int, bit: int
) -> None:
    """The CRC covers every byte: any cut or single-bit flip is CorruptError."""
    data = segment.encode_segment(bundles)
    for bad in (data[: cut % len(data)], damage(data, 0, flip, bit, keep_length=True)):
        assert decoded_or_named(_decode_seg, bad, "s") is None, "damage went unnoticed"


@FUZZ
@given(segment_bundles, flips, bits)
@pytest.mark.slow
def test_I7_a_flip_the_crc_is_not_asked_to_catch_decodes_to_a_writable_segment(
    bundles: list[segment.SegmentBundle], flip: int, bit: int
) -> None:
    """With the CRC check off (a reader that trusts its disk), a flip is still either
    named, or reads as bundles the writer could have written: writing them again and
    reading back gives the same bundles."""
    bad = damage(segment.encode_segment(bundles), 0, flip, bit, keep_length=True)
    got = decoded_or_named(lambda b: _decode_seg(b, verify_crc=False), bad, "s")
    if got is not None:
        assert _same_segment(_decode_seg(segment.encode_segment(got)), got)
