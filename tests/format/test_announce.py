"""The announcement codec (format/announce.py): round trip, and every damage named (I7)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

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
    after = draw(st.integers(0, seqs[0] - 1))
    return fa.make(pid, draw(st.integers(-(2**63), 2**63 - 1)), entries, after)


@given(st.lists(announcements(), min_size=1, max_size=4, unique_by=lambda a: a.producer_id))
def test_announcements_of_several_writers_round_trip(runs: list[fa.Announcement]) -> None:
    created = runs[0].created_ms
    got = fa.decode(fa.encode(runs, created))
    assert got == tuple(fa.make(a.producer_id, created, a.entries, a.after) for a in runs)


@given(st.lists(announcements(), min_size=1, max_size=4, unique_by=lambda a: a.producer_id))
def test_a_version_2_announcement_is_still_read_as_following_nothing(
    runs: list[fa.Announcement],
) -> None:
    created = runs[0].created_ms
    raw = fa.encode_without_after(runs, created)
    assert struct.unpack_from("<H", raw, 4) == (2,)
    assert fa.decode(raw) == tuple(fa.make(a.producer_id, created, a.entries) for a in runs)


@given(announcements())
def test_a_version_1_announcement_of_one_writer_is_still_read(a: fa.Announcement) -> None:
    raw = fa.encode_one_run(a)
    assert struct.unpack_from("<H", raw, 4) == (1,)
    assert fa.decode(raw) == (fa.make(a.producer_id, a.created_ms, a.entries),)


def test_I7_a_run_that_follows_an_append_not_below_its_first_is_refused() -> None:
    with pytest.raises(ValueError, match="follows"):
        fa.encode([fa.make("p", 0, [fa.Announced(3, "l", 0, ())], after=3)], 0)
    raw = bytearray(fa.encode([fa.make("p", 0, [fa.Announced(3, "l", 0, ())], after=2)], 0))
    at = 4 + 2 + 8 + 2 + 1 + 1  # the run's after
    raw[at : at + 8] = struct.pack("<Q", 3)
    body = bytes(raw[:-4])
    with pytest.raises(CorruptError, match="follows 3, not below its first 3"):
        fa.decode(body + struct.pack("<I", zlib.crc32(body)), obj="queue/pending/k")


def _one() -> bytes:
    return fa.encode_one_run(
        fa.make("p-1", 5, [fa.Announced(3, "data/x.batch", 7, (MetadataItem(0, 9, b"m"),))])
    )


def _runs() -> list[fa.Announcement]:
    return [
        fa.make("p-1", 5, [fa.Announced(3, "data/x.batch", 7, (MetadataItem(0, 9, b"m"),))], 2),
        fa.make("p-2", 5, [fa.Announced(1, "data/y", 8, ()), fa.Announced(2, "d", 9, ())]),
    ]


def _two() -> bytes:
    return fa.encode_without_after(_runs(), 5)


def _three() -> bytes:
    return fa.encode(_runs(), 5)


@pytest.mark.parametrize("make", [_one, _two, _three], ids=["version 1", "version 2", "version 3"])
@given(st.integers(0, 300), st.integers(1, 255))
def test_I7_every_flipped_byte_or_cut_is_a_corrupt_error_naming_the_object(
    make: Callable[[], bytes], at: int, flip: int
) -> None:
    raw = bytearray(make())
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
        fa.encode([fa.make("p", 0, [fa.Announced(s, "l", 0, ()) for s in seqs])], 0)


def test_one_run_per_writer_in_an_announcement() -> None:
    run = fa.make("p", 0, [fa.Announced(1, "l", 0, ())])
    with pytest.raises(ValueError, match="one run per writer"):
        fa.encode([run, run], 0)
    raw = bytearray(fa.encode([run, fa.make("q", 0, [fa.Announced(1, "l", 0, ())])], 0))
    raw[raw.index(b"\x01q") + 1] = ord("p")  # the second run renamed to the first's writer
    body = bytes(raw[:-4])
    with pytest.raises(CorruptError, match="a second run of 'p'"):
        fa.decode(body + struct.pack("<I", zlib.crc32(body)))


def test_I7_a_run_count_that_cannot_fit_is_refused_before_allocating() -> None:
    raw = bytearray(_two())
    raw[14:16] = struct.pack("<H", 0xFFFF)
    body = bytes(raw[:-4])
    with pytest.raises(CorruptError, match="run count 65535 cannot fit"):
        fa.decode(body + struct.pack("<I", zlib.crc32(body)))
