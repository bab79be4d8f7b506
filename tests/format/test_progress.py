"""Subscriber progress objects: golden bytes, the completeness check, I7."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format import progress as fp

REG = bytes(range(1, 17))
TOK = b"T" * 16
WID = b"W" * 16


def _stream() -> fp.Progress:
    return fp.Progress("etl", REG, False, 3, "c-1", 40, 40, 1000, 2000, lost=5)


def _shared() -> fp.Progress:
    return fp.Progress(
        "jobs",
        REG,
        True,
        0,
        "w",
        10,
        16,
        1000,
        2000,
        done=((12, 13),),
        leases=(
            fp.Lease(10, 1, 9000, TOK),
            fp.Lease(11, 2, 0, TOK),
            fp.Lease(14, 1, 9000, TOK),
            fp.Lease(15, 3, 500, TOK),
        ),
        rejected_total=4,
        rejected=(fp.Rejected(13, 1500, 2, b"bad json"),),
        workers=(fp.WorkerMark(WID, TOK, 1999),),
    )


def test_golden_stream_progress_layout() -> None:
    raw = fp.encode(_stream())
    body = (
        b"TBS1"
        + struct.pack("<HB", 1, 0)
        + b"\x03etl"
        + REG
        + struct.pack("<QH", 3, 3)
        + b"c-1"
        + struct.pack("<QQqqQ", 40, 40, 1000, 2000, 5)
        + struct.pack("<I", 0)
        + struct.pack("<I", 0)
        + struct.pack("<QI", 0, 0)
        + struct.pack("<I", 0)
    )
    assert raw == body + struct.pack("<I", zlib.crc32(body))
    assert fp.decode(raw) == _stream()


def test_shared_progress_round_trips() -> None:
    p = _shared()
    assert fp.decode(fp.encode(p), obj="k") == p


@pytest.mark.parametrize(
    "bad",
    [
        {"claim_cursor": 9},  # cursor below position
        {"done": ((10, 10),)},  # the position itself is not done
        {"done": ((12, 13), (14, 14))},  # adjacent ranges must be merged
        {"leases": ()},  # 10, 11, 14, 15 uncovered
        {"leases": (fp.Lease(12, 1, 0, TOK),)},  # a lease inside a done range
    ],
)
def test_a_state_that_does_not_cover_its_span_is_refused(bad: dict) -> None:  # type: ignore[type-arg]
    import dataclasses

    with pytest.raises(ValueError):
        fp.encode(dataclasses.replace(_shared(), **bad))


def test_I7_bad_magic_version_and_crc_are_named() -> None:
    raw = bytearray(fp.encode(_shared()))
    with pytest.raises(CorruptError, match="crc"):
        fp.decode(bytes(raw[:-1]) + bytes([raw[-1] ^ 1]), obj="p")
    raw2 = bytes(raw[:4]) + struct.pack("<H", 9) + bytes(raw[6:-4])
    with pytest.raises(UnsupportedVersionError):
        fp.decode(raw2 + struct.pack("<I", zlib.crc32(raw2)), obj="p")
    raw3 = b"XXXX" + bytes(raw[4:])
    with pytest.raises(CorruptError, match="magic"):
        fp.decode(raw3, obj="p")


def test_I7_a_count_is_checked_before_anything_is_allocated() -> None:
    body = bytearray(fp.encode(_stream())[:-4])
    at = body.index(struct.pack("<QQqqQ", 40, 40, 1000, 2000, 5)) + 40
    body[at : at + 4] = struct.pack("<I", 0xFFFFFFF0)  # done range count
    with pytest.raises(CorruptError, match="cannot fit") as e:
        fp.decode(bytes(body) + struct.pack("<I", zlib.crc32(body)), obj="p")
    assert e.value.obj == "p"


@settings(max_examples=300, deadline=None)
@given(
    cut=st.integers(0, 400), flip=st.integers(0, 400), bit=st.integers(0, 7), fix_crc=st.booleans()
)
def test_I7_mutated_progress_decodes_or_raises_corrupt(
    cut: int, flip: int, bit: int, fix_crc: bool
) -> None:
    raw = fp.encode(_shared())
    data = bytearray(raw[: cut % (len(raw) + 1)])
    if data:
        data[flip % len(data)] ^= 1 << bit
    if fix_crc and len(data) > 4:  # get past the CRC to exercise every length check
        data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    try:
        fp.decode(bytes(data), obj="p")
    except CorruptError as e:
        assert e.obj == "p"
