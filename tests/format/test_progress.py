"""Subscriber progress objects: golden bytes, the completeness check, I7."""

from __future__ import annotations

import dataclasses
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


def _v1_shared_bytes() -> bytes:
    """A shared queue's object as version 1 wrote it (no lease or rejected flags)."""
    body = (
        b"TBS1"
        + struct.pack("<HB", 1, 1)
        + b"\x04jobs"
        + REG
        + struct.pack("<QH", 0, 1)
        + b"w"
        + struct.pack("<QQqqQ", 10, 13, 1000, 2000, 0)
        + struct.pack("<I", 1)
        + struct.pack("<QQ", 12, 12)
        + struct.pack("<I", 2)
        + struct.pack("<QHq16s", 10, 1, 9000, TOK)  # held until 9000
        + struct.pack("<QHq16s", 11, 2, 0, TOK)  # handed back (defer)
        + struct.pack("<QI", 1, 1)
        + struct.pack("<QqHH", 12, 1500, 2, 3)
        + b"bad"
        + struct.pack("<I", 1)
        + struct.pack("<16s16sq", WID, TOK, 1999)
    )
    return body + struct.pack("<I", zlib.crc32(body))


def test_a_version_1_shared_object_is_still_read() -> None:
    """docs/format.md: version 1 lease records read as flags 0 (held) or BACK (expires_ms
    0: handed back); version 1 dead letters are not KEPT."""
    p = fp.decode(_v1_shared_bytes(), obj="old")
    assert p.leases == (
        fp.Lease(10, 1, 9000, TOK, 0),
        fp.Lease(11, 2, 0, TOK, fp.BACK),
    )
    assert p.rejected == (fp.Rejected(12, 1500, 2, b"bad", 0),)
    assert fp.needed(p) == 10
    raw = fp.encode(p)  # written back as version 2
    assert struct.unpack_from("<H", raw, 4) == (2,)
    assert fp.decode(raw) == p


def test_golden_version_2_lease_and_rejected_records() -> None:
    p = fp.Progress(
        "jobs",
        REG,
        True,
        0,
        "w",
        10,
        12,
        1000,
        2000,
        done=((11, 11),),
        leases=(fp.Lease(10, 3, 7000, TOK, fp.OUT | fp.SUSPECT),),
        rejected_total=1,
        rejected=(fp.Rejected(11, 1500, 3, b"x", fp.KEPT),),
    )
    raw = fp.encode(p)
    assert raw[4:7] == struct.pack("<HB", 2, 1)
    assert struct.pack("<QHBq16s", 10, 3, 0x05, 7000, TOK) in raw
    assert struct.pack("<QqHBH", 11, 1500, 3, 0x01, 1) + b"x" in raw
    assert fp.decode(raw) == p
    assert fp.needed(p) == 10  # the kept dead letter 11 is above the position


def test_a_kept_dead_letter_below_the_position_is_what_the_subscriber_needs() -> None:
    p = fp.Progress(
        "jobs",
        REG,
        True,
        0,
        "w",
        20,
        20,
        1000,
        2000,
        rejected_total=2,
        rejected=(fp.Rejected(7, 1, 1, b"", fp.KEPT), fp.Rejected(9, 1, 1, b"", 0)),
    )
    assert fp.needed(p) == 7
    assert fp.needed(dataclasses.replace(p, rejected=p.rejected[1:])) == 20


def test_I7_unknown_lease_or_rejected_flags_are_refused() -> None:
    good = fp.encode(_shared())
    at = good.index(struct.pack("<QHBq16s", 10, 1, 0, 9000, TOK)) + 10
    bad = bytearray(good[:-4])
    bad[at] = 0x80
    with pytest.raises(CorruptError, match="flags"):
        fp.decode(bytes(bad) + struct.pack("<I", zlib.crc32(bytes(bad))), obj="p")
    with pytest.raises(ValueError, match="flags"):
        fp.encode(dataclasses.replace(_shared(), leases=(fp.Lease(10, 1, 0, TOK, 0x40),)))
