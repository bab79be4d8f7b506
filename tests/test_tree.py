"""The M-way manifest tree: rebalancing (I6), dequeue across groups (I5), lookups, GET bound."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.faults import CountingStore
from tests.fuzzing import FUZZ, bits, canonical, cuts, damage, flips
from tieredbuf import keys
from tieredbuf.config import TreeConfig
from tieredbuf.consume.reader import TreeReader
from tieredbuf.errors import DataLossError
from tieredbuf.format import tree as ft
from tieredbuf.format.manifest import (
    ManifestEntry,
    MetadataItem,
    NewEntry,
    encode_entry,
    iter_entries,
)
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.store import open_store


def _e(i: int, size: int = 10) -> NewEntry:
    return NewEntry(f"data/{i}.batch", (MetadataItem(0, 1000 + i, b""),), size)


def _q(store, m: int = 2, **kw) -> ManifestQueue:  # type: ignore[no-untyped-def]
    return ManifestQueue(store, sleep=lambda s: None, tree_config=TreeConfig(m=m, **kw))


def _fill(q: ManifestQueue, n: int, pid: str = "p") -> None:
    for i in range(n):
        q.append([_e(i)], pid, i + 1)


def test_I6_root_holds_at_most_m_per_level_and_groups_cover_the_rest() -> None:
    q = _q(open_store("memory://"), m=2)
    _fill(q, 23)
    snap = q.read()
    assert snap.root.n_entries <= 2
    levels = [r.level for r in snap.root.refs]
    assert levels == sorted(levels, reverse=True)
    for lv in (0, 1):
        assert levels.count(lv) <= 2
    assert [e.sequence for e in snap.entries()] == list(range(23))
    assert [e.location for e in snap.entries()] == [f"data/{i}.batch" for i in range(23)]
    assert snap.total_bytes == 230
    kinds = {keys.parse_group_key(m.key)[2] for m in q.store.list(keys.GROUPS_PREFIX)}  # type: ignore[index]
    assert kinds == {"group", "kgroup", "mgroup"}


def test_sized_entries_carry_each_objects_size_through_every_level() -> None:
    q = _q(open_store("memory://"), m=2)
    for i in range(23):
        q.append([_e(i, size=100 + i)], "p", i + 1)
    q.append([_e(99, size=0)], "p", 24)  # size not recorded: 0
    sized = q.read().sized_entries()
    assert [(e.sequence, n) for e, n in sized] == [(i, 100 + i) for i in range(23)] + [(23, 0)]


def test_I6_root_size_is_bounded_while_the_backlog_grows() -> None:
    q = _q(open_store("memory://"), m=4)
    sizes = []
    for i in range(300):
        q.append([_e(i)], "p", i + 1)
        sizes.append(len(q.store.get(keys.MANIFEST_KEY).data))
    # M=4: at most 4 entries + 4 groups + 4 kgroups + mgroups (300 / 64 of them)
    assert max(sizes[150:]) <= max(sizes[:150]) + 5 * ft.REF_SIZE


def test_I5_dequeue_through_a_group_unlinks_only_fully_consumed_groups() -> None:
    q = _q(open_store("memory://"), m=2)
    _fill(q, 12)
    e = q.initialize("c")
    q.dequeue(4, e)
    snap = q.read()
    assert snap.head == 5 and snap.low == 5 and snap.footer.first_sequence == 5
    assert [x.sequence for x in snap.entries()] == list(range(5, 12))
    # every linked ref still covers sequences >= the head's group
    assert all(r.last >= 4 for r in snap.root.refs)
    q.dequeue(4, e)  # idempotent
    q.dequeue(11, e)
    snap = q.read()
    assert snap.entries() == [] and snap.root.refs == [] and snap.total_bytes == 0


def test_reads_a_plain_rfc_v1_manifest_and_rebalances_it_on_first_write() -> None:
    from tests.format.test_manifest import _rfc_v1_manifest

    store = open_store("memory://")
    store.put(keys.MANIFEST_KEY, _rfc_v1_manifest())
    q = _q(store, m=2)
    assert [e.sequence for e in q.read().entries()] == [5, 6]
    q.append([_e(7)], "p", 1)
    snap = q.read()
    assert snap.view.footer.version == 2 and [e.sequence for e in snap.entries()] == [5, 6, 7]
    assert len(snap.root.refs) == 1 and snap.root.n_entries == 1
    assert snap.footer.epoch == 3


def test_lookup_by_sequence_and_time_touch_at_most_levels_plus_one_objects_cold() -> None:
    inner = open_store("memory://")
    _fill(_q(inner, m=3), 100)  # 100 > 3^3: mgroups, kgroups, groups
    counting = CountingStore(inner)
    q = _q(counting, m=3)
    levels = 3
    for seq in (0, 13, 50, 98, 99):
        counting.reset()
        pos = TreeReader(q).lookup_sequence(seq)
        assert pos.entry is not None and pos.entry.location == f"data/{seq}.batch"
        assert counting.reads <= levels + 1, (seq, counting.counts)
    for seq in (0, 27, 64, 99):
        counting.reset()
        pos = TreeReader(q).lookup_time(1000 + seq)
        assert pos.sequence == seq
        assert counting.reads <= levels + 1
    r = TreeReader(q)
    assert r.lookup_time(5000).at_tail and r.lookup_time(5000).sequence == 100
    assert r.lookup_sequence(250).at_tail


def test_lookup_before_the_first_retained_sequence_raises_or_clamps() -> None:
    q = _q(open_store("memory://"), m=2)
    _fill(q, 10)
    e = q.initialize("c")
    q.dequeue(5, e)
    r = TreeReader(q)
    with pytest.raises(DataLossError):
        r.lookup_sequence(2)
    pos = r.lookup_sequence(2, on_lost="clamp")
    assert pos.sequence == 6 and pos.clamped and pos.entry is not None
    with pytest.raises(DataLossError):
        r.lookup_time(1001)
    assert r.lookup_time(1001, on_lost="clamp").sequence == 6
    # the first kept entry's own millisecond: an unlinked entry may hold records of it
    with pytest.raises(DataLossError):
        r.lookup_time(1006)
    assert r.lookup_time(1006, on_lost="clamp").sequence == 6
    assert r.lookup_time(1007).sequence == 7  # after it: what is kept is whole


def test_lookup_time_reports_a_possible_loss_when_the_first_kept_entry_has_no_time() -> None:
    """An entry with no metadata items says nothing of its records' times: after older
    history was dropped, a look-up landing on it cannot rule a loss out (the same rule
    as the Spark planner's ``startingTimestamp``)."""
    q = _q(open_store("memory://"), m=2)
    for i in range(10):
        q.append([NewEntry(f"data/{i}.batch", (), 10)], "p", i + 1)
    q.dequeue(5, q.initialize("c"))
    r = TreeReader(q)
    with pytest.raises(DataLossError):
        r.lookup_time(1000)
    pos = r.lookup_time(1000, on_lost="clamp")
    assert pos.sequence == 6 and pos.clamped


def test_retention_keeps_acked_history_by_bytes_and_age() -> None:
    now = [10_000]
    store = open_store("memory://")
    q = ManifestQueue(
        store,
        sleep=lambda s: None,
        clock_ms=lambda: now[0],
        tree_config=TreeConfig(m=2, retention_max_bytes=120),
    )
    _fill(q, 10)
    e = q.initialize("c")
    q.dequeue(4, e)
    snap = q.read()
    assert snap.head == 5 and snap.low == 0  # 100 bytes linked: acked history kept
    assert [x.sequence for x in snap.iter_from(snap.low)] == list(range(10))
    for i in range(10, 20):
        q.append([_e(i)], "p", i + 1)
    q.dequeue(19, e)
    snap = q.read()
    assert snap.total_bytes <= 120 and snap.low >= 8 and snap.head == 20
    low = snap.low
    q.apply_retention()  # idempotent
    assert q.read().low == low
    q2 = ManifestQueue(
        store, sleep=lambda s: None, clock_ms=lambda: now[0], tree_config=TreeConfig(m=2)
    )
    now[0] = 1000 + 19 + 1000  # age limit 1019: entry 18 (time 1018) goes, 19 stays
    q2.set_retention(max_age=timedelta(seconds=1))  # replaces the byte rule, applies at once
    assert q2.read().low == 19  # entries with time < 1019 are past the age
    q2.append([_e(20)], "p", 21)  # never acked: the age rule unlinks acked and unacked alike
    now[0] = 1000 + 21 + 1000  # entry 20 (time 1020) is past the age now
    q2.apply_retention()
    snap = q2.read()
    assert snap.low == 21 == snap.head  # retention won over the consumer that lags at 20


@st.composite
def _nodes(draw: st.DrawFn) -> _Node:
    """A node as a writer builds it: level 0 with entries and their stats, or a level
    1/2 node of contiguous child refs one level down."""
    level = draw(st.integers(0, ft.MAX_LEVEL))
    first = draw(st.integers(0, 1 << 40))
    i64 = st.integers(-(1 << 63), (1 << 63) - 1)
    if level == 0:
        n = draw(st.integers(0, 4))
        entries = tuple(
            ManifestEntry(
                first + i,
                draw(st.text(max_size=8)),
                tuple(
                    draw(
                        st.lists(
                            st.builds(MetadataItem, st.integers(0, 99), i64, st.binary(max_size=4)),
                            max_size=2,
                        )
                    )
                ),
            )
            for i in range(n)
        )
        stats = tuple(
            draw(st.lists(st.builds(ft.Stat, st.integers(0, 1 << 40), i64), min_size=n, max_size=n))
        )
        return (0, first, entries, stats, ())
    refs, at = [], first
    for _ in range(draw(st.integers(0, 3))):
        k = draw(st.integers(1, 50))
        refs.append(
            ft.Ref(
                level - 1,
                at,
                at + k - 1,
                k,
                draw(i64),
                draw(i64),
                draw(st.integers(0, 1 << 40)),
                draw(st.binary(min_size=16, max_size=16)),
            )
        )
        at += k
    return (level, first, (), (), tuple(refs))


_Node = tuple[int, int, tuple[ManifestEntry, ...], tuple[ft.Stat, ...], tuple[ft.Ref, ...]]


def _encode_node(x: _Node) -> bytes:
    level, first, entries, stats, refs = x
    region = b"".join(encode_entry(e.sequence, e.location, e.metadata) for e in entries)
    return ft.encode_node(level, first, entries_region=region, stats=stats, refs=refs)


def _decode_node(raw: bytes) -> _Node:
    node = ft.decode_node(raw, obj="g")
    entries = () if node.entries is None else tuple(iter_entries(node.entries))
    return (node.level, node.first, entries, node.stats, node.refs)


@FUZZ
@given(_nodes())
def test_group_nodes_round_trip(x: _Node) -> None:
    assert _decode_node(_encode_node(x)) == x


@FUZZ
@given(_nodes(), cuts, flips, bits)
def test_I7_damaged_group_nodes_decode_to_what_a_writer_writes_or_name_the_offset(
    x: _Node, cut: int, flip: int, bit: int
) -> None:
    canonical(_decode_node, _encode_node, damage(_encode_node(x), cut, flip, bit), "g")


def test_I6_plain_append_copies_refs_and_stats_without_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q = _q(open_store("memory://"), m=4)
    _fill(q, 37)  # refs of two levels; the last cut (at 37) left 1 root entry
    assert q.read().root.n_refs >= 2

    def boom(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("a plain append decoded the refs or stats")

    monkeypatch.setattr(ft, "decode_root_refs", boom)
    monkeypatch.setattr(ft, "stats_from_raw", boom)
    monkeypatch.setattr(ft, "refs_total_bytes", boom)
    q.append([_e(37)], "p", 38)  # 2 root entries: no rebalance
    monkeypatch.undo()
    snap = q.read()
    assert [e.sequence for e in snap.entries()] == list(range(38))
    assert snap.total_bytes == 380


def test_I7_corrupt_refs_in_a_root_are_named_when_decoded() -> None:
    from tieredbuf.errors import CorruptError
    from tieredbuf.format import manifest as fm

    store = open_store("memory://")
    q = _q(store, m=2)
    _fill(q, 9)  # refs: kgroup, group(s)
    view = fm.open_manifest(store.get(keys.MANIFEST_KEY).data)
    assert view.tree is not None
    body = bytearray(view.tree)
    body[20 + ft.REF_SIZE] = 2  # the second ref claims a higher level than the first
    raw = fm.encode_manifest(
        view.entries_bytes, view.footer, view.watermarks, view.owner, bytes(body), view.stats
    )
    store.put(keys.MANIFEST_KEY, raw)
    with pytest.raises(CorruptError) as e:
        q.read().entries()
    assert e.value.obj == keys.MANIFEST_KEY
