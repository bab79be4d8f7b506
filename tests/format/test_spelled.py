"""The key form (format/spelled.py): an announcement spelled out in its key reads back
exactly what its body holds, a writer's steady produce() calls fit, a key of the first
form is still read, and a key changed anywhere is refused, never read as another
announcement (I7)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ulid import ULID

from tieredbuf import keys
from tieredbuf.errors import CorruptError
from tieredbuf.format import announce as fa
from tieredbuf.format.manifest import MetadataItem
from tieredbuf.format.spelled import FORM_2, FORM_3, key_form, runs_of

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
    after = draw(st.one_of(st.just(0), st.just(seqs[0] - 1), st.integers(0, seqs[0] - 1)))
    return fa.make(pid, 0, entries, after), created


@given(spellable(), st.integers(80, keys.pending_room("h-a", 1)))
def test_a_key_form_reads_back_exactly_what_the_body_holds(case, room: int) -> None:  # type: ignore[no-untyped-def]
    run, created = case
    body = fa.encode([run], created)
    text = key_form([run], created, body, room)
    if text is None:  # only when it does not fit the room
        assert key_form([run], created, body, 10_000) is not None
        return
    assert len(text) <= room and text.startswith(FORM_3)
    assert keys.pending_key_form(keys.pending_key("h-a", 1, text)) == text
    assert runs_of(text, len(body)) == fa.decode(body)


def _form_two(run: fa.Announcement, created: int) -> tuple[bytes, str]:
    """``run`` as the second form spelled it: form 3 of the run following nothing, less
    the ``0`` it spells for that; its body of version 2."""
    zero = fa.make(run.producer_id, 0, run.entries)
    text = key_form([zero], created, fa.encode([zero], created), 10_000)
    assert text is not None
    head, _, entries = text.rpartition(".")
    assert entries.startswith("0")
    body = fa.encode_without_after([zero], created)
    crc = int.from_bytes(body[-4:], "little")
    created36, _, rest = head[len(FORM_3) :].partition(".")
    pid = rest.partition(".")[2]
    b36 = "0123456789abcdefghijklmnopqrstuvwxyz"
    crc36 = ""
    while True:
        crc, d = divmod(crc, 36)
        crc36 = b36[d] + crc36
        if not crc:
            break
    return body, f"{FORM_2}{created36}.{crc36}.{pid}.{entries[1:]}"


@given(spellable())
def test_a_key_of_the_second_form_is_still_read_as_following_nothing(case) -> None:  # type: ignore[no-untyped-def]
    run, created = case
    body, text = _form_two(run, created)
    got = runs_of(text, len(body))
    assert got == fa.decode(body)
    assert got[0].after == 0


def _steady(objects: int, calls: int, created: int = 1_700_000_000_123) -> fa.Announcement:
    """One writer's data objects of ``calls`` produce() calls each, 1 MiB of 100 B records
    a call (10,485 records), 1-80 ms apart, the last a second before ``created``; a
    metadata item a call (its ingestion time), no payloads: what a producer announces."""
    entries = []
    when = created - 1000 - 81 * objects * calls
    for o in range(objects):
        items = []
        for i in range(calls):
            when += (1, 2, 80, 37, 13)[(o * calls + i) % 5]
            items.append(MetadataItem(10_485 * i, when, b""))
        u = ULID.from_timestamp((created - 1500 + 100 * o) / 1000)
        entries.append(fa.Announced(7 + o, keys.data_key(u), 16_777_216 + o, tuple(items)))
    return fa.make("p-01M8EBSR0ENVK464AS98GNT64X", 0, entries)


def _spelled() -> tuple[bytes, str]:
    """The common case: one data object of a writer's produce() calls."""
    run = _steady(1, 13)
    body = fa.encode([run], 1_700_000_000_123)
    text = key_form([run], 1_700_000_000_123, body, ROOM)
    assert text is not None, "a data object of thirteen produce() calls is spelled"
    return body, text


@pytest.mark.parametrize(("objects", "calls"), [(1, 50), (2, 24), (3, 15)])
def test_a_writers_steady_produce_calls_are_spelled_within_a_file_name(
    objects: int, calls: int
) -> None:
    """At 16 producer processes of 1 MiB calls a data object held 4-48 calls, and an
    announcement one to three objects; the first form spelled 20 calls at most."""
    run = _steady(objects, calls)
    body = fa.encode([run], 1_700_000_000_123)
    text = key_form([run], 1_700_000_000_123, body, ROOM)
    assert text is not None
    assert runs_of(text, len(body)) == fa.decode(body)


def _form_one(run: fa.Announcement, created: int, body: bytes) -> str:
    """``run`` spelled as the first version of the key form did (docs/format.md)."""

    def b36(n: int) -> str:
        return (
            "0"
            if n == 0
            else b36(n // 36).lstrip("0") + "0123456789abcdefghijklmnopqrstuvwxyz"[n % 36]
        )

    spelled = []
    for e in run.entries:
        u = e.location[len(keys.DATA_PREFIX) : len(keys.DATA_PREFIX) + 26]
        parts = [
            f"{b36(e.producer_seq)}-{u}{'b' if e.location.endswith('.batch') else 'q'}{b36(e.size)}"
        ]
        start = 0
        for m in e.metadata:
            ago = created - m.ingestion_time_ms
            parts.append(f"{b36(m.start_index - start)}{'P' if ago >= 0 else 'N'}{b36(abs(ago))}")
            start = m.start_index
        spelled.append("-".join(parts))
    crc = int.from_bytes(body[-4:], "little")
    return f"i{b36(created)}.{b36(crc)}.{run.producer_id}.{'_'.join(spelled)}"


@given(spellable())
def test_a_key_of_the_first_form_is_still_read(case) -> None:  # type: ignore[no-untyped-def]
    run, created = case
    body = fa.encode_without_after([run], created)
    text = _form_one(run, created, body)
    assert not text.startswith((FORM_2, FORM_3))
    assert runs_of(text, len(body)) == fa.decode(body)


def test_only_what_a_key_can_say_exactly_is_spelled() -> None:
    loc = keys.data_key(ULID())
    e = fa.Announced(1, loc, 10, (MetadataItem(0, 5, b""),))
    backwards = (MetadataItem(5, 1, b""), MetadataItem(2, 1, b""))
    for runs in (
        [fa.make("p-1", 0, [e]), fa.make("p-2", 0, [e])],  # two writers
        [fa.make("p-1", 0, [fa.Announced(1, loc, 1, (MetadataItem(0, 9, b"m"),))])],  # payload
        [fa.make("p 1", 0, [e])],  # a producer id a key cannot carry
        [fa.make("p-1", 0, [fa.Announced(1, "data/x.batch", 1, ())])],  # not a data object
        [fa.make("p-1", 0, [fa.Announced(1, loc + "\n", 1, ())])],  # a name no key form makes
        [fa.make("p-1", 0, [fa.Announced(1, loc, 1, backwards)])],  # start indexes back
    ):
        assert key_form(runs, 7, fa.encode(runs, 7), 10_000) is None
    ok = [fa.make("p-1", 0, [e])]
    assert key_form(ok, 7, fa.encode(ok, 7), 10_000) is not None
    assert key_form(ok, 7, fa.encode(ok, 7), 20) is None  # no room


@given(st.integers(0, 10**6), st.sampled_from("0123456789abzqbiPN-_.XYZpAM:"), st.booleans())
def test_I7_a_key_form_changed_anywhere_is_refused_never_read_as_another_announcement(
    at: int, ch: str, first_form: bool
) -> None:
    body, text = _spelled()
    if first_form:
        body = fa.encode_without_after(fa.decode(body), 1_700_000_000_123)
        text = _form_one(fa.decode(body)[0], 1_700_000_000_123, body)
    i = at % len(text)
    changed = text[:i] + ch + text[i + 1 :]
    if changed != text:
        with pytest.raises(CorruptError):
            runs_of(changed, len(body), obj="queue/pending/k")
    with pytest.raises(CorruptError):
        runs_of(text[:i], len(body), obj="queue/pending/k")  # cut short
    with pytest.raises(CorruptError, match="the body has"):
        runs_of(text, len(body) + 1, obj="queue/pending/k")  # another body under it
