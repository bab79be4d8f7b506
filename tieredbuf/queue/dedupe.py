"""Find calls made with an idempotency key among the queue's linked entries.

A produce() call made with an idempotency key carries the key's tag in its metadata
item (:mod:`tieredbuf.format.idem`): its digest, a fingerprint of what it wrote and,
for a key that ends in a ULID, the key's own time.  A retry of such a call -- the
service's ``Idempotency-Key``, sent again after an answer was lost -- is told from a
new call by finding the first one's entry here: its sequence and data object are the
retry's answer (a documented duplicate whose original entry is known, I10).

The search starts at the first entry whose ingestion time is :data:`SKEW_MS` before
the key's time (a key with no time: that long before now) and reads to the tail: a
retry comes seconds after its first attempt, so that is a few entries of the root,
read from memory.  Only *linked* entries can be found: one a subscriber dequeued and
the root unlinked (no retention) is gone, and its retry is not recognised.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tieredbuf.format import idem
from tieredbuf.queue import tree
from tieredbuf.queue.snapshot import Snapshot

SKEW_MS = 60_000
"""How far before a key's time (a client's clock) its first entry's ingestion time (an
instance's clock) may be: the clocks of clients and instances agree within this."""


@dataclass(frozen=True, slots=True)
class Found:
    """A keyed call found in the queue."""

    sequence: int
    location: str
    fingerprint: bytes


def find(snap: Snapshot, wanted: Mapping[bytes, int], now_ms: int) -> dict[bytes, Found]:
    """The calls of ``wanted`` (key digest -> the key's time in ms, -1 when it names none)
    that ``snap`` links, by digest (the first found of each)."""
    if not wanted:
        return {}
    since = min(ms if ms >= 0 else now_ms for ms in wanted.values()) - SKEW_MS
    start = tree.find_time(snap.root, since, snap.nodes.load)
    found: dict[bytes, Found] = {}
    for e in snap.iter_from(start):
        for m in e.metadata:
            t = idem.parse(m.payload, obj=e.location)
            if t is not None and t.key_digest in wanted and t.key_digest not in found:
                found[t.key_digest] = Found(e.sequence, e.location, t.fingerprint)
        if len(found) == len(wanted):
            break
    return found
