"""The announcement codec (format/announce.py): round trip, and every damage named (I7)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ulid import ULID

from tieredbuf import keys
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


@given(st.lists(announcements(), min_size=1, max_size=4, unique_by=lambda a: a.producer_id))
def test_announcements_of_several_writers_round_trip(runs: list[fa.Announcement]) -> None:
    created = runs[0].created_ms
    got = fa.decode(fa.encode(runs, created))
    assert got == tuple(fa.make(a.producer_id, created, a.entries) for a in runs)


@given(announcements())
def test_a_version_1_announcement_of_one_writer_is_still_read(a: fa.Announcement) -> None:
    raw = fa.encode_one_run(a)
    assert struct.unpack_from("<H", raw, 4) == (1,)
    assert fa.decode(raw) == (a,)


def _one() -> bytes:
    return fa.encode_one_run(
        fa.make("p-1", 5, [fa.Announced(3, "data/x.batch", 7, (MetadataItem(0, 9, b"m"),))])
    )


def _two() -> bytes:
    return fa.encode(
        [
            fa.make("p-1", 5, [fa.Announced(3, "data/x.batch", 7, (MetadataItem(0, 9, b"m"),))]),
            fa.make("p-2", 5, [fa.Announced(1, "data/y", 8, ()), fa.Announced(2, "d", 9, ())]),
        ],
        5,
    )


@pytest.mark.parametrize("make", [_one, _two], ids=["version 1", "version 2"])
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


# --- the key form: a one-writer announcement spelled out in its key --------------------

_pids = st.from_regex(r"[A-Za-z0-9_.:-]{1,40}", fullmatch=True)


@st.composite
def spellable(draw):  # type: ignore[no-untyped-def]
    """One writer's appends without metadata, naming data objects: what a key spells."""
    seqs = sorted(set(draw(st.lists(st.integers(1, 2**64 - 1), min_size=1, max_size=2))))
    entries = [
        fa.Announced(
            s,
            keys.data_key(ULID.from_bytes(draw(st.binary(min_size=16, max_size=16))), suffix),
            draw(st.integers(0, 2**64 - 1)),
            (),
        )
        for s, suffix in zip(
            seqs,
            draw(st.lists(st.sampled_from(keys.DATA_SUFFIXES), min_size=2, max_size=2)),
            strict=False,
        )
    ]
    return fa.make(draw(_pids), 0, entries), draw(st.integers(0, 2**63 - 1))


@given(spellable())
def test_a_key_form_reads_back_exactly_what_the_body_holds(case) -> None:  # type: ignore[no-untyped-def]
    run, created = case
    body = fa.encode([run], created)
    text = fa.key_form([run], created, body)
    if text is None:  # only when it is too long for a key
        spelled = [f"{e.producer_seq}-{'U' * 26}b{e.size}" for e in run.entries]
        assert len(f"i{created}-00000000.{'_'.join(spelled)}.{run.producer_id}") > 200
        return
    assert len(text) <= fa.KEY_FORM_MAX
    assert fa.from_key_form(text) == fa.decode(body)


def _spelled() -> tuple[fa.Announcement, int, bytes, str]:
    loc = keys.data_key(ULID.from_timestamp(1_700_000_000))
    run = fa.make("p-1", 0, [fa.Announced(7, loc, 4096, ()), fa.Announced(9, loc, 1, ())])
    body = fa.encode([run], 1_700_000_000_123)
    text = fa.key_form([run], 1_700_000_000_123, body)
    assert text is not None
    return run, 1_700_000_000_123, body, text


def test_only_one_writers_appends_without_metadata_naming_data_objects_are_spelled() -> None:
    run, created, _, _ = _spelled()
    e = run.entries[0]
    other = fa.make("p-2", 0, [e])
    with_md = fa.make("p-1", 0, [fa.Announced(1, e.location, 1, (MetadataItem(0, 9, b"m"),))])
    for runs in (
        [run, other],  # two writers
        [with_md],  # metadata
        [fa.make("p 1", 0, [e])],  # a producer id a key cannot carry
        [fa.make("p-1", 0, [fa.Announced(1, "data/x.batch", 1, ())])],  # not a data object
        [fa.make("p" * 200, 0, [e])],  # too long
    ):
        assert fa.key_form(runs, created, fa.encode(runs, created)) is None


@given(st.integers(0, 10**6), st.sampled_from("0123456789abcdefqbi-_.XYZp"))
def test_I7_a_key_form_changed_anywhere_is_refused_never_read_as_another_announcement(
    at: int, ch: str
) -> None:
    *_, text = _spelled()
    i = at % len(text)
    changed = text[:i] + ch + text[i + 1 :]
    if changed == text:
        return
    with pytest.raises(CorruptError):
        fa.from_key_form(changed, obj="queue/pending/k")
    with pytest.raises(CorruptError):
        fa.from_key_form(text[:i], obj="queue/pending/k")  # cut short
