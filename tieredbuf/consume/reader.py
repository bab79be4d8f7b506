"""Lookups by sequence and ingestion time, and continuous readers over the manifest tree.

A lookup costs at most one GET per tree level below the (cached) root: a
bisection in the root, then in each node on the path (rabbitmq-stream-s3's
reader).  A :class:`ContinuousReader` streams entries from any sequence or time
across groups, the root and new appends, in order, with no gap and no
duplicate, while writers append, rebalance, apply retention and GC reaps
(Danube's "durable history, then the live tail" reader): it tracks the next
expected sequence, reads immutable groups from any root that linked them, and
re-reads the root only when it reaches that root's tail or a group it needs
was reaped.  Readers never fence and never write.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from tieredbuf.errors import DataLossError, ObjectNotFoundError
from tieredbuf.format import tree as ft
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.queue import tree
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot
from tieredbuf.queue.nodes import NodeStore

OnLost = Literal["raise", "clamp"]
"""Before the first retained sequence: raise DataLossError, or start at the first retained."""


@dataclass(frozen=True, slots=True)
class Position:
    """Where a lookup landed."""

    sequence: int
    """The sequence found (or the first retained one, when clamped)."""
    entry: ManifestEntry | None
    """Its entry; None at the live tail (``sequence`` is the next to be appended)."""
    clamped: bool = False
    """True when the asked-for data was gone and ``on_lost="clamp"`` moved forward."""

    @property
    def at_tail(self) -> bool:
        return self.entry is None


def _lost(asked: str, low: int) -> DataLossError:
    return DataLossError(
        f"{asked} is before the first retained sequence {low} (dequeued or unlinked by retention)"
    )


class TreeReader:
    """Lookups against a cached root; :meth:`refresh` re-reads it."""

    def __init__(self, queue: ManifestQueue, nodes: NodeStore | None = None) -> None:
        self.queue = queue
        self.nodes = nodes or NodeStore(queue.store, retry=queue.retry, stats=queue.stats)
        self._snap: Snapshot | None = None

    def refresh(self) -> Snapshot:
        self._snap = self.queue.read()
        return self._snap

    @property
    def snapshot(self) -> Snapshot:
        return self._snap if self._snap is not None else self.refresh()

    def _at(self, snap: Snapshot, seq: int, clamped: bool) -> Position:
        entry = tree.find_sequence(snap.root, seq, self.nodes.load)
        return Position(seq, entry, clamped)

    def lookup_sequence(self, seq: int, *, on_lost: OnLost = "raise") -> Position:
        """Entry ``seq``; past the tail: the live tail; before the first retained: ``on_lost``."""
        snap = self.snapshot
        if seq >= snap.root.next_seq:
            snap = self.refresh()
        if seq < snap.low:
            if on_lost == "raise":
                raise _lost(f"sequence {seq}", snap.low)
            return self._at(snap, snap.low, True)
        return self._at(snap, min(seq, snap.root.next_seq), False)

    def lookup_time(self, time_ms: int, *, on_lost: OnLost = "raise") -> Position:
        """The first entry whose ingestion time is >= ``time_ms`` (the live tail if none).

        When that entry is before the first retained sequence (the history of that
        time was unlinked), ``on_lost`` decides: raise DataLossError or clamp.
        """
        snap = self.snapshot
        seq = tree.find_time(snap.root, time_ms, self.nodes.load)
        pos = self._at(snap, max(seq, snap.low), False)
        lost = seq < snap.low or (
            seq == snap.low and snap.low > 0 and ft.first_kept_may_hide(pos.entry, time_ms)
        )
        if lost:
            if on_lost == "raise":
                raise _lost(f"time {time_ms}", snap.low)
            return Position(pos.sequence, pos.entry, True)
        return pos


class ContinuousReader:
    """Streams entries from a start position to the tail and on, as appends land."""

    def __init__(
        self,
        queue: ManifestQueue,
        *,
        start_sequence: int | None = None,
        start_time_ms: int | None = None,
        on_lost: OnLost = "raise",
        batch: int = 1024,
        nodes: NodeStore | None = None,
    ) -> None:
        if start_sequence is not None and start_time_ms is not None:
            raise ValueError("give start_sequence or start_time_ms, not both")
        self.queue = queue
        self.on_lost: OnLost = on_lost
        self.batch = batch
        self._lookups = TreeReader(queue, nodes)
        self.nodes = self._lookups.nodes
        if start_time_ms is not None:
            pos = self._lookups.lookup_time(start_time_ms, on_lost=on_lost)
            self.next_sequence = pos.sequence
        elif start_sequence is None:
            self.next_sequence = self._lookups.snapshot.low
        else:
            self.next_sequence = start_sequence
        self._snap: Snapshot | None = self._lookups.snapshot
        self.lost = 0
        """Sequences skipped by ``on_lost="clamp"``."""

    def poll(self, max_entries: int | None = None) -> list[ManifestEntry]:
        """The next entries in order (empty when caught up with the tail)."""
        return [e for e, _ in self.poll_sized(max_entries)]

    def poll_sized(self, max_entries: int | None = None) -> list[tuple[ManifestEntry, int]]:
        """:meth:`poll` with each entry's data object size as the manifest recorded it (0:
        none recorded): what ``Buffer.read_object`` checks the object against."""
        limit = max_entries or self.batch
        fresh = False
        while True:
            snap = self._snap
            if snap is None or self.next_sequence >= snap.root.next_seq:
                if fresh:
                    return []
                snap, fresh = self.queue.read(), True
                self._snap = snap
            if self.next_sequence < snap.low:
                if not fresh:
                    self._snap = None
                    continue
                if self.on_lost == "raise":
                    raise _lost(f"sequence {self.next_sequence}", snap.low)
                self.lost += snap.low - self.next_sequence
                self.next_sequence = snap.low
            try:
                it = tree.iter_sized_from(snap.root, self.next_sequence, self.nodes.load)
                out = list(itertools.islice(it, limit))
            except ObjectNotFoundError:
                if fresh:
                    # one more fresh read: retention may have unlinked it since
                    again = self.queue.read()
                    if self.next_sequence >= again.low and again.root.refs == snap.root.refs:
                        raise DataLossError(
                            f"a group linked from the current root is missing "
                            f"(reading sequence {self.next_sequence})"
                        ) from None
                    self._snap = again
                    continue
                self._snap = None  # a stale root's group was unlinked and reaped
                continue
            if out:
                if out[0][0].sequence != self.next_sequence or any(
                    b.sequence != a.sequence + 1 for (a, _), (b, _) in itertools.pairwise(out)
                ):
                    raise DataLossError(f"gap in the manifest at sequence {self.next_sequence}")
                self.next_sequence = out[-1][0].sequence + 1
            return out

    def __iter__(self) -> Iterator[ManifestEntry]:
        """Everything from the current position to the tail as of now (then stops)."""
        while True:
            got = self.poll()
            if not got:
                return
            yield from got
