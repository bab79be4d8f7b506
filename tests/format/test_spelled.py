"""The key form (format/spelled.py): an announcement spelled out in its key reads back
exactly what its body holds, and a key changed anywhere is refused, never read as
another announcement (I7)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ulid import ULID

from tieredbuf import keys
from tieredbuf.errors import CorruptError
from tieredbuf.format import announce as fa
from tieredbuf.format.manifest import MetadataItem
from tieredbuf.format.spelled import key_form, runs_of

ROOM = 255 - len(f"h-{ULID()}.12.")  # what a hub's 12th announcement leaves for its form


@st.composite
def spellable(draw):  # type: ignore[no-untyped-def]
    """One writer's appends naming data objects, metadata without payloads in
    start-index order: what a key may spell.  Returns (run, created_ms)."""
    created = draw(st.integers(0, 2**62))
    seqs = sorted(set(draw(st.lists(st.integers(1, 2**64 - 1), min_size=1, max_size=3))))
    entries = []
    for s in seqs:
        starts = sorted(draw(st.lists(st.integers(0, 2**32 - 1), max_size=6)))
        items = tuple(
            MetadataItem(i, created - draw(st.integers(-(10**6), 10**9)), b"") for i in starts
        )
        u = ULID.from_bytes(draw(st.binary(min_size=16, max_size=16)))
        loc = keys.data_key(u, draw(st.sampled_from(keys.DATA_SUFFIXES)))
        entries.append(fa.Announced(s, loc, draw(st.integers(0, 2**64 - 1)), items))
    pid = draw(st.from_regex(r"[A-Za-z0-9_.:-]{1,40}", fullmatch=True))
    return fa.make(pid, 0, entries), created


@given(spellable(), st.integers(80, keys.pending_room("h-a", 1)))
def test_a_key_form_reads_back_exactly_what_the_body_holds(case, room: int) -> None:  # type: ignore[no-untyped-def]
    run, created = case
    body = fa.encode([run], created)
    text = key_form([run], created, body, room)
    if text is None:  # only when it does not fit the room
        assert key_form([run], created, body, 10_000) is not None
        return
    assert len(text) <= room
    assert keys.pending_key_form(keys.pending_key("h-a", 1, text)) == text
    assert runs_of(text, len(body)) == fa.decode(body)


def _spelled() -> tuple[bytes, str]:
    """The common case: one data object of a writer's produce() calls, a metadata item
    each (their ingestion times), no payloads."""
    loc = keys.data_key(ULID.from_timestamp(1_700_000_000))
    created = 1_700_000_000_123
    items = tuple(MetadataItem(10_486 * i, created - 900 + 70 * i, b"") for i in range(13))
    run = fa.make("p-01M8EBSR0ENVK464AS98GNT64X", 0, [fa.Announced(7, loc, 13_631_800, items)])
    body = fa.encode([run], created)
    text = key_form([run], created, body, ROOM)
    assert text is not None, "a data object of thirteen produce() calls is spelled"
    return body, text


def test_only_what_a_key_can_say_exactly_is_spelled() -> None:
    loc = keys.data_key(ULID())
    e = fa.Announced(1, loc, 10, (MetadataItem(0, 5, b""),))
    backwards = (MetadataItem(5, 1, b""), MetadataItem(2, 1, b""))
    for runs in (
        [fa.make("p-1", 0, [e]), fa.make("p-2", 0, [e])],  # two writers
        [fa.make("p-1", 0, [fa.Announced(1, loc, 1, (MetadataItem(0, 9, b"m"),))])],  # payload
        [fa.make("p 1", 0, [e])],  # a producer id a key cannot carry
        [fa.make("p-1", 0, [fa.Announced(1, "data/x.batch", 1, ())])],  # not a data object
        [fa.make("p-1", 0, [fa.Announced(1, loc, 1, backwards)])],  # start indexes back
    ):
        assert key_form(runs, 7, fa.encode(runs, 7), 10_000) is None
    ok = [fa.make("p-1", 0, [e])]
    assert key_form(ok, 7, fa.encode(ok, 7), 10_000) is not None
    assert key_form(ok, 7, fa.encode(ok, 7), 20) is None  # no room


@given(st.integers(0, 10**6), st.sampled_from("0123456789abzqbiPN-_.XYZp"))
def test_I7_a_key_form_changed_anywhere_is_refused_never_read_as_another_announcement(
    at: int, ch: str
) -> None:
    body, text = _spelled()
    i = at % len(text)
    changed = text[:i] + ch + text[i + 1 :]
    if changed != text:
        with pytest.raises(CorruptError):
            runs_of(changed, len(body), obj="queue/pending/k")
    with pytest.raises(CorruptError):
        runs_of(text[:i], len(body), obj="queue/pending/k")  # cut short
    with pytest.raises(CorruptError, match="the body has"):
        runs_of(text, len(body) + 1, obj="queue/pending/k")  # another body under it
