"""Root section 7 (subscriber registry): golden bytes, the implied registry, I7."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredbuf.errors import ConfigError, CorruptError
from tieredbuf.format import manifest as fm
from tieredbuf.format import registry as freg
from tieredbuf.format._reader import Reader
from tieredbuf.queue import tree

REG = bytes(range(1, 17))


def _regs() -> dict[str, freg.Registration]:
    return {
        "etl": freg.Registration("etl", REG, freg.FLAG_SHARED, 7),
        "default": freg.Registration("default", freg.ZERO_REG, 0, 3),
    }


def test_golden_section_7_layout() -> None:
    body = freg.encode(_regs())
    expected = (
        struct.pack("<I", 2)
        + b"\x07default"
        + bytes(16)
        + b"\x00"
        + struct.pack("<Q", 3)  # sorted by name
        + b"\x03etl"
        + REG
        + b"\x01"
        + struct.pack("<Q", 7)
    )
    assert body == expected
    raw = fm.encode_manifest(b"", fm.Footer(0, 9, 1, 2), {}, None, subscribers=_regs())
    assert struct.pack("<HI", 7, len(body)) + body in raw
    assert fm.open_manifest(raw).subscribers == _regs()


def test_a_registry_equal_to_the_implied_one_is_not_written() -> None:
    """A buffer with only the default consumer keeps its exact pre-registry bytes."""
    view = fm.open_manifest(
        fm.encode_manifest(b"", fm.Footer(0, 5, 2, 2), {}, "c", tree=b"", stats=None)
    )
    root = tree.Root(b"", 0, 5, 2, {}, "c", 5, 5, b"", b"")
    assert root.registry == {"default": freg.Registration("default", freg.ZERO_REG, 0, 5)}
    assert fm.open_manifest(root.encode()).subscribers is None
    root.registry["etl"] = freg.Registration("etl", REG, 0, 5)
    assert fm.open_manifest(root.encode()).subscribers == root.registry
    empty = tree.Root(b"", 0, 5, 0, {}, None, 5, 5, b"", b"")
    assert empty.registry == {} and fm.open_manifest(empty.encode()).subscribers is None
    removed = tree.Root(b"", 0, 5, 3, {}, None, 5, 5, b"", b"", registry={})
    assert fm.open_manifest(removed.encode()).subscribers == {}  # epoch > 0, default removed
    assert view.subscribers is None


def test_head_is_the_slowest_subscriber_clamped_into_low_and_next() -> None:
    r = _regs()
    assert freg.head_of(r, low=0, next_seq=9, head=0) == 3
    assert freg.head_of(r, low=5, next_seq=9, head=5) == 5  # retention passed "default"
    assert freg.head_of(r, low=0, next_seq=2, head=0) == 2
    assert freg.head_of({}, low=4, next_seq=9, head=6) == 6  # nobody acks: the head stays


@pytest.mark.parametrize("name", ["", "a.b", "a/b", "x" * 65, "é", "a b", 7])
def test_bad_subscriber_names_are_a_config_error(name: object) -> None:
    with pytest.raises(ConfigError, match="bad subscriber name"):
        freg.check_name(name)


def _decode(body: bytes) -> dict[str, freg.Registration]:
    r = Reader(body, "queue manifest", "m")
    out = freg.decode(r)
    if r.remaining():
        raise CorruptError("queue manifest", "m", r.pos, "trailing")
    return out


@pytest.mark.parametrize(
    "bad",
    [
        struct.pack("<I", 5000),  # over the cap
        struct.pack("<I", 2) + b"\x03etl" + REG + b"\x00" + bytes(8),  # count cannot fit
        struct.pack("<I", 1) + b"\x03e.l" + REG + b"\x00" + bytes(8),  # bad name
        struct.pack("<I", 1) + b"\x03etl" + REG + b"\x02" + bytes(8),  # unknown flag
        struct.pack("<I", 1) + b"\x03etl" + bytes(16) + b"\x00" + bytes(8),  # zero id, not default
        struct.pack("<I", 1) + b"\x07default" + REG + b"\x00" + bytes(8),  # default with an id
        struct.pack("<I", 2)
        + b"\x01b"
        + REG
        + b"\x00"
        + bytes(8)
        + b"\x01a"
        + REG
        + b"\x00"
        + bytes(8),  # out of order
    ],
)
def test_I7_bad_registry_bodies_are_named(bad: bytes) -> None:
    with pytest.raises(CorruptError) as e:
        _decode(bad)
    assert e.value.obj == "m"


@settings(max_examples=300, deadline=None)
@given(cut=st.integers(0, 200), flip=st.integers(0, 200), bit=st.integers(0, 7))
def test_I7_mutated_registry_roots_decode_or_raise_corrupt(cut: int, flip: int, bit: int) -> None:
    raw = fm.encode_manifest(b"", fm.Footer(0, 9, 1, 2), {}, None, subscribers=_regs())
    data = bytearray(raw[: cut % (len(raw) + 1)])
    if data:
        data[flip % len(data)] ^= 1 << bit
    try:
        fm.open_manifest(bytes(data), obj="q")
    except CorruptError as e:
        assert e.obj == "q"
