"""Queue manifest: RFC 0001 v1 golden bytes by hand, the v2 extension, and I7 fuzzing."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import FUZZ, bits, canonical, cuts, damage, flips
from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format import manifest as m
from tieredbuf.format import tree as ft


def _rfc_v1_manifest() -> bytes:
    """Two entries and a footer, written field by field from the RFC text."""
    loc0 = b"data/01J5T4R3KXBMZ7QV9N2WG8YDHP.batch"
    e0_body = (
        struct.pack("<Q", 5)  # sequence
        + struct.pack("<H", len(loc0))
        + loc0  # location
        + struct.pack("<I", 2)  # metadata_count
        + struct.pack("<I", 0)
        + struct.pack("<q", 1_700_000_000_000)
        + struct.pack("<I", 2)
        + b"m0"
        + struct.pack("<I", 3)
        + struct.pack("<q", 1_700_000_000_001)
        + struct.pack("<I", 0)
    )
    # entry_len = 8 + 2 + location_len + 4 + sum(4 + 8 + 4 + payload_len)
    assert len(e0_body) == 8 + 2 + len(loc0) + 4 + (16 + 2) + (16 + 0)
    loc1 = b"data/b.batch"
    e1_body = struct.pack("<Q", 6) + struct.pack("<H", len(loc1)) + loc1 + struct.pack("<I", 0)
    # entry_count u32, next_sequence u64, epoch u64, version u16
    footer = struct.pack("<I", 2) + struct.pack("<Q", 7) + struct.pack("<Q", 3)
    footer += struct.pack("<H", 1)
    assert len(footer) == 22
    return (
        struct.pack("<I", len(e0_body))
        + e0_body
        + struct.pack("<I", len(e1_body))
        + e1_body
        + footer
    )


def test_golden_rfc_v1_manifest_decodes() -> None:
    view = m.open_manifest(_rfc_v1_manifest(), obj="queue/manifest")
    assert view.footer == m.Footer(entry_count=2, next_sequence=7, epoch=3, version=1)
    entries = list(m.iter_entries(view))
    assert [e.sequence for e in entries] == [5, 6]
    assert entries[0].location == "data/01J5T4R3KXBMZ7QV9N2WG8YDHP.batch"
    assert entries[0].metadata == (
        m.MetadataItem(0, 1_700_000_000_000, b"m0"),
        m.MetadataItem(3, 1_700_000_000_001, b""),
    )
    assert entries[1].metadata == ()


def test_encode_entry_matches_rfc_bytes() -> None:
    raw = _rfc_v1_manifest()
    e0_len = struct.unpack_from("<I", raw, 0)[0]
    meta = (m.MetadataItem(0, 1_700_000_000_000, b"m0"), m.MetadataItem(3, 1_700_000_000_001, b""))
    assert m.encode_entry(5, "data/01J5T4R3KXBMZ7QV9N2WG8YDHP.batch", meta) == raw[: 4 + e0_len]


def test_v1_manifest_upgrades_to_v2_on_append_and_keeps_entry_bytes() -> None:
    raw = _rfc_v1_manifest()
    view = m.open_manifest(raw)
    wm = {"p": m.Watermark("p", 1, 7, 123)}
    new_raw, first = m.append(view, [m.NewEntry("data/c.batch", ())], wm)
    assert first == 7
    assert new_raw.startswith(raw[:-22])  # existing entries copied, not re-encoded
    v2 = m.open_manifest(new_raw)
    assert v2.footer == m.Footer(3, 8, 3, 2)
    assert v2.watermarks == wm
    assert [e.sequence for e in m.iter_entries(v2)] == [5, 6, 7]


def test_golden_v2_extension_layout() -> None:
    view = m.empty_manifest()
    raw = m.with_epoch(view, 4, "c1")
    raw, _ = m.append(m.open_manifest(raw), [], {"ab": m.Watermark("ab", 9, 0, -1)})
    wm_body = struct.pack("<I", 1) + b"\x02ab" + struct.pack("<QQq", 9, 0, -1)
    sections = struct.pack("<HI", 1, len(wm_body)) + wm_body + struct.pack("<HI", 2, 2) + b"c1"
    expected = (
        sections + struct.pack("<I", len(sections)) + b"TBX2" + struct.pack("<IQQH", 0, 0, 4, 2)
    )
    assert raw == expected


def test_dequeue_removes_through_sequence_and_keeps_next_sequence() -> None:
    view = m.open_manifest(_rfc_v1_manifest())
    after = m.open_manifest(m.dequeue(view, 5))
    assert after.footer.entry_count == 1 and after.footer.next_sequence == 7
    assert [e.sequence for e in m.iter_entries(after)] == [6]
    assert m.open_manifest(m.dequeue(view, 2)).footer.entry_count == 2  # before first: no-op
    assert m.open_manifest(m.dequeue(view, 99)).footer.entry_count == 0


def test_prune_watermarks_drops_idle_then_oldest() -> None:
    wms = {f"p{i}": m.Watermark(f"p{i}", 1, i, updated_ms=i * 10) for i in range(6)}
    kept = m.prune_watermarks(wms, now_ms=50, ttl_ms=25, cap=2)
    assert set(kept) == {"p5", "p4"}


def test_I7_unknown_version_and_truncation_are_named() -> None:
    raw = _rfc_v1_manifest()
    with pytest.raises(UnsupportedVersionError) as e:
        m.open_manifest(raw[:-2] + b"\x09\x00", obj="queue/manifest")
    assert "queue/manifest" in str(e.value)
    with pytest.raises(CorruptError, match="truncated"):
        m.open_manifest(raw[:10])
    # cut inside entry 1: footer says 2 entries but the region is short
    cut = raw[:60] + raw[-22:]
    with pytest.raises(CorruptError):
        list(m.iter_entries(m.open_manifest(cut)))


def test_I7_unknown_extension_tag_is_refused() -> None:
    sections = struct.pack("<HI", 77, 0)
    raw = sections + struct.pack("<I", len(sections)) + b"TBX2" + struct.pack("<IQQH", 0, 0, 0, 2)
    with pytest.raises(CorruptError, match="unknown extension section tag 77"):
        m.open_manifest(raw)


def test_golden_buffer_section_layout_and_checks() -> None:
    """Section 6: buffer id (16 bytes), created_ms i64, gc_grace_ms u64; exactly 32 bytes."""
    bid = bytes(range(16))
    info = m.BufferInfo(bid, 1_800_000_000_000, 600_000)
    raw = m.encode_manifest(b"", m.Footer(0, 0, 0, 2), {}, None, buffer=info)
    body = bid + struct.pack("<qQ", 1_800_000_000_000, 600_000)
    sections = struct.pack("<HI", 6, 32) + body
    assert raw == sections + struct.pack("<I", len(sections)) + b"TBX2" + struct.pack(
        "<IQQH", 0, 0, 0, 2
    )
    assert m.open_manifest(raw).buffer == info
    for bad in (body[:31], body + b"\x00"):  # short, or a trailing byte
        s = struct.pack("<HI", 6, len(bad)) + bad
        with pytest.raises(CorruptError):
            m.open_manifest(
                s + struct.pack("<I", len(s)) + b"TBX2" + struct.pack("<IQQH", 0, 0, 0, 2)
            )
    huge = bid + struct.pack("<qQ", 0, 1 << 63)
    s = struct.pack("<HI", 6, 32) + huge
    with pytest.raises(CorruptError, match="gc_grace_ms"):
        m.open_manifest(s + struct.pack("<I", len(s)) + b"TBX2" + struct.pack("<IQQH", 0, 0, 0, 2))
    # the flat (RFC-style) helpers refuse a root with the section: they would drop it
    with pytest.raises(ValueError, match="tree root"):
        m.append(m.open_manifest(raw), [], {})


u64 = st.integers(0, (1 << 64) - 1)
i64 = st.integers(-(1 << 63), (1 << 63) - 1)
_text = st.text(st.characters(codec="utf-8"), max_size=10)
_meta = st.builds(m.MetadataItem, st.integers(0, (1 << 32) - 1), i64, st.binary(max_size=6))


@st.composite
def _trees(draw: st.DrawFn) -> ft.TreeState:
    first = draw(st.integers(0, 1 << 40))
    refs = []
    levels = sorted(draw(st.lists(st.integers(0, 2), max_size=4)), reverse=True)
    for level in levels:
        count = draw(st.integers(1, 1000))
        refs.append(
            ft.Ref(
                level,
                first,
                first + count - 1,
                count,
                draw(i64),
                draw(i64),
                draw(u64),
                draw(st.binary(min_size=16, max_size=16)),
            )
        )
        first += count
    low = draw(st.integers(0, first))
    return ft.TreeState(low, draw(st.integers(low, first + 5)), tuple(refs))


Decoded = tuple[
    m.Footer,
    list[m.ManifestEntry],
    dict[str, m.Watermark],
    "str | None",
    "ft.TreeState | None",
    "tuple[ft.Stat, ...] | None",
    "m.RetentionPolicy | None",
    "m.BufferInfo | None",
]


@st.composite
def _manifests(draw: st.DrawFn) -> Decoded:
    entries = draw(st.lists(st.tuples(_text, st.lists(_meta, max_size=3)), max_size=4))
    nxt = draw(st.integers(len(entries), 1 << 50))
    first = nxt - len(entries)
    decoded = [m.ManifestEntry(first + i, loc, tuple(md)) for i, (loc, md) in enumerate(entries)]
    if draw(st.booleans()):  # RFC v1: entries and footer only
        return (
            m.Footer(len(entries), nxt, draw(u64), m.V1),
            decoded,
            {},
            None,
            None,
            None,
            None,
            None,
        )
    pids = draw(
        st.lists(
            st.text(st.characters(codec="utf-8"), max_size=8).filter(
                lambda t: len(t.encode()) <= 255
            ),
            unique=True,
            max_size=4,
        )
    )
    wms = {p: m.Watermark(p, draw(u64), draw(u64), draw(i64)) for p in pids}
    stats = draw(st.none() | st.lists(st.builds(ft.Stat, u64, i64), max_size=4).map(tuple))
    retention = draw(
        st.none()
        | st.builds(
            m.RetentionPolicy,
            st.none() | st.integers(0, (1 << 63) - 1),
            st.none() | st.integers(0, (1 << 63) - 1),
        )
    )
    buffer = draw(
        st.none()
        | st.builds(
            m.BufferInfo, st.binary(min_size=16, max_size=16), i64, st.integers(0, (1 << 63) - 1)
        )
    )
    return (
        m.Footer(len(entries), nxt, draw(u64), m.V2),
        decoded,
        wms,
        draw(st.none() | _text),
        draw(st.none() | _trees()),
        stats,
        retention,
        buffer,
    )


def _encode(x: Decoded) -> bytes:
    footer, entries, wms, owner, tree, stats, retention, buffer = x
    region = b"".join(m.encode_entry(e.sequence, e.location, e.metadata) for e in entries)
    if footer.version == m.V1:
        return region + m.encode_footer(footer)
    return m.encode_manifest(
        region,
        footer,
        wms,
        owner,
        None if tree is None else ft.encode_tree(tree),
        None if stats is None else ft.encode_stats(stats),
        retention,
        buffer,
    )


def _decode(raw: bytes, obj: str = "q") -> Decoded:
    """Everything in a root: footer, entries and every extension section."""
    v = m.open_manifest(raw, obj=obj)
    return (
        v.footer,
        list(m.iter_entries(v)),
        v.watermarks,
        v.owner,
        None if v.tree is None else ft.decode_tree(v.tree, obj),
        None if v.stats is None else ft.decode_stats(v.stats, obj),
        v.retention,
        v.buffer,
    )


@pytest.mark.slow
@FUZZ
@given(_manifests())
def test_manifests_round_trip(x: Decoded) -> None:
    assert _decode(_encode(x)) == x


@pytest.mark.slow
@FUZZ
@given(_manifests(), cuts, flips, bits)
def test_I7_damaged_manifests_decode_to_what_a_writer_writes_or_name_the_offset(
    x: Decoded, cut: int, flip: int, bit: int
) -> None:
    bad = damage(_encode(x), cut, flip, bit)
    canonical(_decode, _encode, bad, "q")


def test_I7_watermarks_out_of_order_or_repeated_are_refused() -> None:
    good = m.encode_manifest(
        b"", m.Footer(0, 0, 0, m.V2), {p: m.Watermark(p, 1, 2, 3) for p in ("a", "b")}, None
    )
    assert set(m.open_manifest(good).watermarks) == {"a", "b"}
    for pids in (b"ba", b"aa"):
        bad = bytearray(good)
        at = good.index(b"\x01a")
        bad[at + 1], bad[at + 1 + 1 + 24 + 1] = pids[0], pids[1]
        with pytest.raises(CorruptError, match="out of order or repeated") as e:
            m.open_manifest(bytes(bad), obj="q")
        assert e.value.offset == at + 1 + 1 + 24  # the second id's length byte


def test_I7_the_fast_skip_to_a_position_names_a_bad_length() -> None:
    """skip_entries walks lengths unchecked (a reader skips up to M entries of a group to
    reach its position) and falls back to the checked walk, which names the bad byte."""
    from tieredbuf.errors import CorruptError
    from tieredbuf.format import manifest as fm

    region = b"".join(fm.encode_entry(i, f"data/{i}.batch", ()) for i in range(5))
    view = fm.ManifestView(region, fm.Footer(5, 5, 0, 2), len(region), obj="queue/manifest")
    offsets = [fm.skip_entries(view, k) for k in range(6)]
    assert offsets[-1] == len(region) and offsets == sorted(offsets)
    assert fm.skip_entries(view, 2, offsets[1]) == offsets[3]
    bad = bytearray(region)
    bad[offsets[2] : offsets[2] + 4] = (10**6).to_bytes(4, "little")
    broken = fm.ManifestView(bytes(bad), view.footer, len(bad), obj="queue/manifest")
    with pytest.raises(CorruptError, match="queue/manifest") as e:
        fm.skip_entries(broken, 4)
    assert e.value.offset == offsets[2] + 4 or "entry 2" in str(e.value)
