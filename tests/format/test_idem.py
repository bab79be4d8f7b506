"""Idempotency tags (format/idem.py): a keyed call's tag in front of its metadata payload,
read back exactly, damage named (I7), and taken off for readers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ulid import ULID

import tieredbuf
from tieredbuf.errors import CorruptError
from tieredbuf.format import idem


@given(
    st.text(min_size=1, max_size=60).filter(lambda k: len(k.encode()) <= 255),
    st.binary(min_size=16, max_size=16),
    st.binary(max_size=50),
)
def test_a_tag_reads_back_exactly(key: str, fp: bytes, payload: bytes) -> None:
    t = idem.parse(idem.tag(key, fp, payload))
    assert t == idem.Tag(idem.digest(key), fp, idem.key_ms(key), payload)
    assert idem.own(idem.tag(key, fp, payload)) == payload


def test_a_ulid_key_names_its_time_and_another_key_none() -> None:
    u = ULID()
    assert idem.key_ms(f"order-{u}") == u.milliseconds
    assert idem.key_ms("order-17") == -1


def test_an_untagged_payload_is_the_calls_own() -> None:
    assert idem.parse(b"plain") is None and idem.own(b"plain") == b"plain"


@pytest.mark.parametrize("cut", range(len(idem.MAGIC), idem.HEADER))
def test_I7_a_tag_cut_short_is_named(cut: int) -> None:
    raw = idem.tag("k", b"f" * 16, b"m")[:cut]
    with pytest.raises(CorruptError, match="idempotency tag"):
        idem.parse(raw, obj="data/x.batch")


def test_readers_see_a_keyed_calls_own_metadata(tmp_path: object) -> None:
    buf = tieredbuf.open(f"file://{tmp_path}/b")
    with buf.producer() as p:
        p.produce([b"r"], b"m", idempotency_key=str(ULID())).wait(timeout=60)
    e = buf.entries()[0]
    assert idem.parse(e.metadata[0].payload) is not None  # in the manifest: tagged
    batch = tieredbuf.ConsumedBatch(e.sequence, e.location, e.metadata, buf.read_object(e))
    assert [m.payload for m in batch.metadata] == [b"m"]  # to a reader: its own
