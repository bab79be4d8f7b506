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
"""The announcement keys tieredbuf read before the key form: what it still reads now."""


def test_an_announcement_key_carries_its_key_form_where_an_older_reader_still_reads_it() -> None:
    u = ULID()
    spelled = f"i1700000000123-0badcafe.7-{u}b4096.p-1.x"
    k = keys.pending_key(f"h-{u}", 3, spelled)
    assert keys.parse_pending_key(k) == (f"h-{u}", 3)
    assert keys.pending_key_form(k) == spelled
    assert len(k.rsplit("/", 1)[1]) <= 255  # a local file system's longest name
    assert _OLDER_READER.match(k)  # its body is read, and committed, by an older holder
    plain = keys.pending_key(f"h-{u}", 3)
    assert keys.parse_pending_key(plain) == (f"h-{u}", 3)
    assert keys.pending_key_form(plain) is None
    for bad in ("x", "i12-0badcafe", f"i1-0badcafe.7-{u}b1.p 1"):
        with pytest.raises(ValueError):
            keys.pending_key(f"h-{u}", 3, bad)
    with pytest.raises(ValueError):  # the announcer's end must be the first dot
        keys.pending_key("h.dot", 3, spelled)
