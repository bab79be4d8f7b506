"""Object key names: round trips, and the parsers GC deletes by accept only what writers
make."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ulid import ULID

from tests.fuzzing import FUZZ
from tieredbuf import keys


def test_data_key_round_trips_and_rejects_foreign_names() -> None:
    u = ULID()
    k = keys.data_key(u)
    assert k == f"data/{u}.batch"
    assert keys.parse_data_key(k) == u
    assert keys.parse_data_key(keys.data_key(u, ".qseg")) == u
    assert keys.parse_data_key("data/notaulid.batch") is None
    assert keys.parse_data_key(f"data/{u}.tmp") is None
    assert keys.parse_data_key(f"other/{u}.batch") is None


def test_a_key_with_a_trailing_newline_is_no_key_of_ours() -> None:
    """``$`` matches before a final newline: each parser must take the whole key (GC
    deletes by them; a commit checks its locations with them)."""
    u = ULID()
    assert keys.parse_data_key(keys.data_key(u) + "\n") is None
    assert keys.parse_group_key(keys.group_key(5, u, "group") + "\n") is None
    assert keys.parse_progress_key(keys.progress_key("jobs", u) + "\n") is None
    for k in (keys.pending_key("h-1", 3), keys.legacy_pending_key("p-1", 3)):
        assert keys.parse_pending_key(k) is not None
        assert keys.parse_pending_key(k + "\n") is None
    assert keys.pending_key_form(keys.pending_key("h-1", 3, "i_x") + "\n") is None
    with pytest.raises(ValueError):
        keys.pending_key("h-1", 3, "i_x\n")


def test_numbers_in_keys_are_ascii_digits() -> None:
    """``\\d`` takes any Unicode digit, and int() reads them: a group or announcement
    key numbered in Arabic-Indic digits is no key tieredbuf writes."""
    arabic = "".join(chr(0x660 + int(c)) for c in "00000000000000000005")
    u = ULID()
    assert keys.parse_group_key(f"queue/groups/{arabic}.{u}.group") is None
    assert keys.parse_pending_key(f"queue/pending/p-1.{arabic}") is None
    assert keys.parse_pending_key(f"queue/pending/h-1.{chr(0x665)}.b") is None


def test_group_key_sorts_by_first_sequence() -> None:
    a = keys.group_key(5, ULID(), "group")
    b = keys.group_key(40, ULID(), "kgroup")
    assert a < b
    parsed = keys.parse_group_key(b)
    assert parsed is not None and parsed[0] == 40 and parsed[2] == "kgroup"


@FUZZ
@given(
    st.binary(min_size=16, max_size=16),
    st.sampled_from(keys.DATA_SUFFIXES),
    st.integers(0, 10**20 - 1),
    st.sampled_from(keys.GROUP_KINDS),
    st.text(max_size=60),
)
def test_key_parsers_round_trip_and_accept_only_the_names_writers_make(
    raw: bytes, suffix: str, first: int, kind: str, junk: str
) -> None:
    """GC deletes by these parsers: a key they accept is exactly one tieredbuf writes."""
    u = ULID.from_bytes(raw)
    assert keys.parse_data_key(keys.data_key(u, suffix)) == u
    assert keys.parse_group_key(keys.group_key(first, u, kind)) == (first, u, kind)
    for k in (junk, keys.data_key(u, suffix)[:-1] + junk, "data/" + junk):
        got = keys.parse_data_key(k)
        if got is not None:
            assert k in (keys.data_key(got, s) for s in keys.DATA_SUFFIXES)
    for k in (junk, keys.group_key(first, u, kind)[: len(junk)] + junk):
        g = keys.parse_group_key(k)
        if g is not None:
            assert keys.group_key(*g) == k


_OLDER_READER = re.compile(r"^queue/pending/(~?[A-Za-z0-9_.:-]{1,510})\.(\d{20})$")
"""The announcement keys tieredbuf read before the key form."""


def test_an_older_reader_never_matches_an_announcement_key_of_this_version() -> None:
    """An older holder must commit all of a hub's announcements or none: committing a
    later one past one it skipped would move the writer's watermark over appends never
    appended.  So every key a hub writes now -- spelled out or not -- is one an older
    reader does not match; this version still reads the older layout."""
    u = ULID()
    spelled = f"i1700000000123-0badcafe.p-1.12345678901234567890.7-{u}b4096"
    k = keys.pending_key(f"h-{u}", 3, spelled)
    assert keys.parse_pending_key(k) == (f"h-{u}", 3)
    assert keys.pending_key_form(k) == spelled
    plain = keys.pending_key(f"h-{u}", 3)
    assert plain.endswith(".3.b")
    assert keys.parse_pending_key(plain) == (f"h-{u}", 3)
    assert keys.pending_key_form(plain) is None
    for key in (k, plain):
        assert not _OLDER_READER.match(key)
        assert len(key.rsplit("/", 1)[1]) <= 255  # a local file system's longest name
    for producer in ("p.with.dots", "svc.1.ingest"):  # the second also fits the newer layout
        old = keys.legacy_pending_key(producer, 12)
        assert _OLDER_READER.match(old) and keys.parse_pending_key(old) == (producer, 12)
        assert keys.pending_key_form(old) is None
    for announcer, form in (
        (f"h-{u}", "x"),  # not a form
        (f"h-{u}", "i1.p." + "0" * 20),  # would end as an older reader's key does
        (f"h-{u}", "i" + "1" * keys.pending_room(f"h-{u}", 3)),  # too long for a file name
        ("h.dot", spelled),  # the announcer ends at the first dot
    ):
        with pytest.raises(ValueError):
            keys.pending_key(announcer, 3, form)
