"""Request bodies of POST /v1/produce (pure parsers): generated bodies parse back to
what was sent, and a damaged body is either a clean 400 (BadBody saying where) or a
body a client could have sent -- never another exception."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.format_local.test_fuzz import arrow_batches
from tests.fuzzing import FUZZ, bits, cuts, damage, flips
from tests.service.util import arrow_stream
from tieredbuf.service import bodies


def _bad_or(parse: object, body: bytes) -> object | None:
    try:
        return parse(body)  # type: ignore[operator]
    except bodies.BadBody as e:
        assert str(e)
        return None


@FUZZ
@given(st.lists(st.binary(max_size=30), min_size=1, max_size=6), cuts, flips, bits)
def test_length_prefixed_bodies_round_trip_and_damage_is_a_400_or_a_body(
    records: list[bytes], cut: int, flip: int, bit: int
) -> None:
    body = bodies.encode_length_prefixed(records)
    assert bodies.parse_length_prefixed(body).records == records
    got = _bad_or(bodies.parse_length_prefixed, damage(body, cut, flip, bit))
    if got is not None:
        assert isinstance(got, bodies.Records)
        assert bodies.encode_length_prefixed(got.records) == damage(body, cut, flip, bit)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
    max_leaves=6,
)


@FUZZ
@given(st.lists(_json, min_size=1, max_size=5), cuts, flips, bits)
def test_ndjson_bodies_round_trip_and_damage_is_a_400_or_json_lines(
    values: list[object], cut: int, flip: int, bit: int
) -> None:
    lines = [json.dumps(v).encode() for v in values]
    body = b"\n".join(lines) + b"\n"
    assert bodies.parse_ndjson(body).records == lines
    bad = damage(body, cut, flip, bit)
    got = _bad_or(bodies.parse_ndjson, bad)
    if got is not None:
        assert isinstance(got, bodies.Records)
        kept = [ln.removesuffix(b"\r") for ln in bad.split(b"\n")]
        assert got.records == [ln for ln in kept if ln.strip()]
        for r in got.records:
            json.loads(r)


@pytest.mark.slow
@FUZZ
@given(st.lists(arrow_batches(), min_size=1, max_size=3), cuts, flips, bits)
def test_arrow_bodies_round_trip_and_damage_is_a_400_or_a_valid_bundle(
    batches: list[pa.RecordBatch], cut: int, flip: int, bit: int
) -> None:
    batches = [b for b in batches if b.schema.equals(batches[0].schema)]
    body = arrow_stream(batches)
    got = bodies.parse_arrow_stream(body)
    assert got.batches == len(batches)
    assert got.batch.equals(pa.concat_batches(batches))
    bad = _bad_or(bodies.parse_arrow_stream, damage(body, cut, flip, bit))
    if bad is not None:
        assert isinstance(bad, bodies.Bundle)
        bad.batch.validate(full=True)
        again = bodies.parse_arrow_stream(arrow_stream([bad.batch]))
        assert again.batch.equals(bad.batch)


@pytest.mark.parametrize("second", [{"x": pa.array([2])}, {"y": pa.array(["s"])}])
def test_two_arrow_streams_back_to_back_are_a_400_not_half_a_body(
    second: dict[str, pa.Array],
) -> None:
    """The IPC reader stops at the first stream's end-of-stream marker: accepting that
    would stage the first stream and silently drop the second."""
    a = arrow_stream([pa.record_batch({"x": pa.array([1])})])
    b = arrow_stream([pa.record_batch(second)])
    with pytest.raises(bodies.BadBody, match=f"{len(b)} bytes after the Arrow stream"):
        bodies.parse_arrow_stream(a + b)


@pytest.mark.parametrize("nest", ["list", "struct of list", "dictionary of list"])
def test_a_list_column_whose_offsets_pass_validate_but_point_past_its_values_is_a_400(
    nest: str,
) -> None:
    """pyarrow's validate(full=True) accepts an empty list array whose one offset is 1
    over no values; flatten() on it aborts the process (found by the segment fuzzer).
    It is refused at the door, so no consumer ever reads one back."""
    import struct

    bad = pa.Array.from_buffers(
        pa.list_(pa.int64()),
        0,
        [None, pa.py_buffer(struct.pack("<i", 1))],
        children=[pa.array([], pa.int64())],
    )
    col: pa.Array = bad
    if nest == "struct of list":
        col = pa.StructArray.from_arrays([bad], names=["inner"])
    elif nest == "dictionary of list":
        col = pa.DictionaryArray.from_arrays(pa.array([], pa.int8()), bad)
    body = arrow_stream([pa.record_batch([col], names=["c"])])
    with pytest.raises(bodies.BadBody, match=r"list offsets 1\.\.1 outside its 0 values"):
        bodies.parse_arrow_stream(body)


@pytest.mark.parametrize(
    ("ctype", "body", "limit", "too_many"),
    [
        (bodies.NDJSON, b"1\n2\n3\n", 3, False),
        (bodies.NDJSON, b"1\n2\n3", 3, False),
        (bodies.NDJSON, b"1\n2\n3\n4", 3, True),
        (bodies.NDJSON, b"1\n\n2\n", 2, True),  # a blank line counts: lines are counted
        (bodies.OCTET_STREAM, bodies.encode_length_prefixed([b"a", b"", b"c"]), 3, False),
        (bodies.OCTET_STREAM, bodies.encode_length_prefixed([b""] * 4), 3, True),
        (bodies.OCTET_STREAM, b"\xff\x00\x00\x00", 0, True),  # one (damaged) frame over 0
    ],
)
def test_the_record_count_is_checked_on_the_bytes_before_any_record_is_made(
    ctype: str,
    body: bytes,
    limit: int,
    too_many: bool,
) -> None:
    if too_many:
        with pytest.raises(bodies.TooLarge, match=f"more than {limit} records"):
            bodies.check_record_count(ctype, bytearray(body), limit)
        with pytest.raises(bodies.TooLarge):
            bodies.parse(ctype, body, max_records=limit)
    else:
        bodies.check_record_count(ctype, bytearray(body), limit)


@pytest.mark.slow
@FUZZ
@given(
    st.lists(arrow_batches(), min_size=1, max_size=3),
    st.sampled_from([None, "zstd", "lz4"]),
    cuts,
    flips,
    bits,
)
def test_an_arrow_streams_declared_size_is_its_limit_and_damage_is_a_400_413_or_a_bundle(
    batches: list[pa.RecordBatch], codec: str | None, cut: int, flip: int, bit: int
) -> None:
    """format/ipc_size.py reads what a stream declares from its flatbuffer metadata: at
    exactly those limits the stream is accepted, one byte or part under it is 413, and
    damaged bytes are a 400, a 413 or a valid bundle -- never another exception."""
    from tieredbuf.format.ipc_size import declared

    batches = [b for b in batches if b.schema.equals(batches[0].schema)]
    body = arrow_stream(batches, compression=codec)
    got = declared(pa.py_buffer(body), 1 << 40, 1 << 40)
    assert got.parts >= 2 * len(batches) + 1  # the schema's fields, each batch, its arrays
    ok = bodies.parse_arrow_stream(body, got.decoded, got.parts)
    assert ok.batches == len(batches)
    if got.decoded:
        with pytest.raises(bodies.TooLarge, match="decodes to more than"):
            bodies.parse_arrow_stream(body, got.decoded - 1, got.parts)
    with pytest.raises(bodies.TooLarge, match="fields, batches and arrays"):
        bodies.parse_arrow_stream(body, got.decoded, got.parts - 1)
    try:
        bad = bodies.parse_arrow_stream(damage(body, cut, flip, bit), 1 << 20, 10_000)
    except (bodies.BadBody, bodies.TooLarge) as e:
        assert str(e)
    else:
        bad.batch.validate(full=True)
