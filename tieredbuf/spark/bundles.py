"""``.qseg`` objects read with small ranged GETs on the driver (no data there).

:func:`segment_tail` fetches an object's tail -- stream directory, batch manifest,
footer and trailer -- in at most two suffix GETs and parses it with
:func:`tieredbuf.format.segment.parse_segment_tail`.  :func:`slot_schemas` adds,
once per schema fingerprint seen, the head of one stream's Arrow IPC file, where its
schema message sits.  Data objects are immutable (fresh ULID keys, create-if-absent),
so parsed tails are cached per process: schema inference and planning share them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

import pyarrow as pa

from tieredbuf import keys
from tieredbuf.format import segment as seg
from tieredbuf.format import segment_tail as segt
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.store.base import Store

_CACHE_MAX = 4096
_cache: OrderedDict[tuple[str, str], segt.SegmentTail] = OrderedDict()
_cache_lock = threading.Lock()
_SCHEMA_HEAD_GUESS = 4 << 10


def segment_tail(store: Store, loc: str) -> segt.SegmentTail:
    """The parsed tail of the ``.qseg`` object ``loc`` (CorruptError on bad bytes)."""
    key = (store.url, loc)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    tail = store.get_suffix(loc, segt.SEGMENT_TAIL_GUESS)
    need = segt.segment_tail_size(tail, loc)
    if need > len(tail):
        tail = store.get_suffix(loc, need)
    parsed = segt.parse_segment_tail(tail, loc)
    with _cache_lock:
        _cache[key] = parsed
        while len(_cache) > _CACHE_MAX:
            _cache.popitem(last=False)
    return parsed


def _stream_schema(store: Store, loc: str, s: seg.StreamInfo) -> pa.Schema:
    end = s.byte_offset + s.byte_length
    head = store.get_range(loc, s.byte_offset, min(end, s.byte_offset + _SCHEMA_HEAD_GUESS))
    need = segt.stream_schema_size(head, s, loc)
    if need > len(head):
        head = store.get_range(loc, s.byte_offset, s.byte_offset + need)
    return segt.parse_stream_schema(head, s, loc)


def slot_schemas(store: Store, entries: Iterable[ManifestEntry], slot: int) -> list[pa.Schema]:
    """Every distinct schema ``slot`` takes in the ``.qseg`` objects of ``entries``."""
    seen: dict[bytes, pa.Schema] = {}
    for e in entries:
        if not e.location.endswith(keys.SEGMENT_SUFFIX):
            continue
        for s in segment_tail(store, e.location).streams:
            if s.slot_id == slot and s.schema_fingerprint not in seen:
                seen[s.schema_fingerprint] = _stream_schema(store, e.location, s)
    return list(seen.values())
