"""Data objects for readers (consume/fetch.py): parallel ranged GETs for large objects,
read-ahead bounded by entries and bytes, and never an object of another size than the
manifest recorded (I10)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from ulid import ULID

import tieredbuf
from tests.faults import CountingStore
from tieredbuf import keys
from tieredbuf.consume.fetch import RANGE_PART, STREAMS, ReadAhead
from tieredbuf.errors import DamagedObjectError, MissingObjectError
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import ManifestEntry, MetadataItem, NewEntry
from tieredbuf.store import open_store


def _entry(store: Any, seq: int, body: bytes) -> ManifestEntry:
    key = keys.data_key(ULID())
    store.put(key, body, mode="create")
    return ManifestEntry(seq, key, ())


def test_a_large_object_is_read_in_parallel_ranges_and_reassembled(any_url) -> None:  # type: ignore[no-untyped-def]
    url, opts = any_url
    store = CountingStore(tieredbuf.open(url, **opts).store)
    body = os.urandom(10_000)
    e = _entry(store, 0, body)
    store.reset()
    with ThreadPoolExecutor(4) as pool:
        ahead = ReadAhead(store, pool, 4, 20_000, part=3000)
        assert ahead.take(e, len(body)) == body
    # 3000+3000+3000+1000, read into one buffer; each response says the object's size
    assert store.of("data") == {"get_range": 4}


def test_I10_a_recorded_size_that_does_not_match_fails_the_read_never_served(any_url) -> None:  # type: ignore[no-untyped-def]
    url, opts = any_url
    store = CountingStore(tieredbuf.open(url, **opts).store)
    body = os.urandom(10_000)
    e = _entry(store, 0, body)
    with ThreadPoolExecutor(4) as pool:
        for recorded in (7000, 14_000):  # the object is longer, or shorter, than recorded
            for budget in (20_000, 100_000):  # ranged parts with a HEAD, or one GET
                ahead = ReadAhead(store, pool, 4, budget, part=3000)
                assert ahead.ranged(recorded) == (budget == 20_000)
                with pytest.raises(DamagedObjectError) as ei:
                    ahead.take(e, recorded)
                err = ei.value
                assert (err.obj, err.sequence, err.recorded, err.found) == (
                    e.location,
                    0,
                    recorded,
                    10_000,
                )
                assert f"is 10000 bytes, the manifest recorded {recorded}" in str(err)
                assert err.offset == min(recorded, 10_000)
    assert "get" in store.of("data")  # the unranged reads


def test_a_missing_large_object_is_data_loss_not_a_short_read() -> None:
    store = open_store("memory://")
    e = ManifestEntry(3, keys.data_key(ULID()), ())
    with ThreadPoolExecutor(4) as pool:
        ahead = ReadAhead(store, pool, 4, 20_000, part=3000)
        with pytest.raises(MissingObjectError, match="sequence 3"):
            ahead.take(e, 10_000)


def test_ranged_parts_only_where_read_ahead_cannot_keep_enough_streams_busy() -> None:
    store = open_store("memory://")
    with ThreadPoolExecutor(4) as pool:
        ahead = ReadAhead(store, pool, 8, 128 << 20)
        assert not ahead.ranged(32 << 20)  # four fit in the budget: whole
        assert ahead.ranged((32 << 20) + 100)  # three would: each in parallel ranges
        assert not ahead.ranged(RANGE_PART)  # one part: never ranged
        assert ReadAhead(store, pool, STREAMS - 1, 1 << 40).ranged(2 * RANGE_PART)
        assert ReadAhead(store, pool, 0, 1 << 40).ranged(2 * RANGE_PART)  # no read-ahead


def test_read_ahead_starts_another_object_only_while_under_its_byte_budget() -> None:
    store = CountingStore(open_store("memory://"))
    sized = [(_entry(store, i, b"x" * 400), 400) for i in range(6)]
    store.reset()
    with ThreadPoolExecutor(4) as pool:
        ahead = ReadAhead(store, pool, 5, 1000)
        ahead.want(sized)
        assert [s for s in range(6) if s in ahead] == [0, 1]  # 800: a third would pass 1,000
        tight = ReadAhead(store, pool, 5, 100)
        tight.want(sized)
        assert [s for s in range(6) if s in tight] == []  # over the budget alone: not ahead
        assert tight.take(*sized[0]) == b"x" * 400  # fetched when the reader asks for it
        off = ReadAhead(store, pool, 0, 1000)
        off.want(sized)
        assert [s for s in range(6) if s in off] == []  # read_ahead=0: nothing ahead
        assert ahead.take(*sized[0]) == b"x" * 400
        ahead.want(sized[1:])
        assert [s for s in range(6) if s in ahead] == [1, 2]


def test_a_consumer_reads_a_large_entry_in_ranged_gets() -> None:
    store = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(store)
    body = encode_batch([os.urandom(2 * RANGE_PART + 1000)])
    key = keys.data_key(ULID())
    store.put(key, body, mode="create")
    meta = (MetadataItem(0, time.time_ns() // 10**6, b""),)
    buf.queue.append([NewEntry(key, meta, len(body))], "p", 1)
    c = buf.consumer(read_ahead=0)
    c.initialize()
    store.reset()
    b = c.next_batch()
    assert b is not None and b.data == body
    parts = -(-len(body) // RANGE_PART)
    assert store.of("data") == {"get_range": parts}  # no HEAD: the parts tell the size
    c.close()
