"""The announcement codec (format/announce.py): round trip, and every damage named (I7)."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format import announce as fa
from tieredbuf.format.manifest import MetadataItem

_items = st.lists(
    st.builds(
        MetadataItem,
        st.integers(0, 2**32 - 1),
        st.integers(-(2**63), 2**63 - 1),
        st.binary(max_size=20),
    ),
    max_size=3,
)


@st.composite
def announcements(draw):  # type: ignore[no-untyped-def]
    seqs = sorted(set(draw(st.lists(st.integers(1, 2**64 - 1), min_size=1, max_size=6))))
    entries = [
        fa.Announced(
            s,
            draw(st.text(min_size=1, max_size=40)),
            draw(st.integers(0, 2**64 - 1)),
            tuple(draw(_items)),
        )
        for s in seqs
    ]
    pid = draw(st.text(min_size=1, max_size=60).filter(lambda t: len(t.encode()) <= 255))
    return fa.make(pid, draw(st.integers(-(2**63), 2**63 - 1)), entries)


@given(announcements())
def test_announcements_round_trip(a: fa.Announcement) -> None:
    assert fa.decode(fa.encode(a)) == a


def _one() -> bytes:
    return fa.encode(
        fa.make("p-1", 5, [fa.Announced(3, "data/x.batch", 7, (MetadataItem(0, 9, b"m"),))])
    )


@given(st.integers(0, 200), st.integers(1, 255))
def test_I7_every_flipped_byte_or_cut_is_a_corrupt_error_naming_the_object(
    at: int, flip: int
) -> None:
    raw = bytearray(_one())
    bad = bytes(raw[: at % len(raw)])  # truncated
    with pytest.raises(CorruptError, match="queue/pending/k"):
        fa.decode(bad, obj="queue/pending/k")
    raw[at % len(raw)] ^= flip
    with pytest.raises(CorruptError):
        fa.decode(bytes(raw), obj="queue/pending/k")


def test_I7_a_count_that_cannot_fit_is_refused_before_allocating() -> None:
    raw = bytearray(_one())
    head = 4 + 2 + 1 + len(b"p-1") + 8
    raw[head : head + 4] = struct.pack("<I", 2**32 - 1)
    body = bytes(raw[:-4])
    with pytest.raises(CorruptError, match="cannot fit"):
        fa.decode(body + struct.pack("<I", zlib.crc32(body)))


def test_an_unknown_version_is_named() -> None:
    raw = bytearray(_one())
    raw[4:6] = struct.pack("<H", 9)
    body = bytes(raw[:-4])
    with pytest.raises(UnsupportedVersionError):
        fa.decode(body + struct.pack("<I", zlib.crc32(body)))


@pytest.mark.parametrize("seqs", [[2, 2], [3, 1], [0, 1]])
def test_producer_sequences_must_start_at_1_and_strictly_increase(seqs: list[int]) -> None:
    with pytest.raises(ValueError):
        fa.encode(fa.make("p", 0, [fa.Announced(s, "l", 0, ()) for s in seqs]))
