"""The one place a write becomes REMOTE: its own entry located in a manifest (I10).

A waiting group is looked at once its writer's watermark in a root covers it (the chain
rule, :mod:`tieredbuf.queue.commit`, keeps a watermark from moving past an append that
is not in); the watermark is never the evidence.  Each of its appends is confirmed by:

1. this hub's own commit, which placed it (``Committed.placed``: sequence and object);
2. an entry in the root or the tree that names one of the data objects its records were
   uploaded to (each a unique ULID key; a refresh for the GC grace rule adds one); or
3. the watermark's own record of exactly this append -- ``(producer seq, sequence)`` of
   the writer's last append -- when its records were uploaded once (so the object at
   that sequence can only be that one).

A covered append that none of these confirms was unlinked before this hub saw its entry
(a consumer dequeued it between two of our polls), or another writer used the producer
id: the group fails with :class:`~tieredbuf.errors.RemoteUnconfirmedError`, never a
REMOTE without a sequence.  A lookup that cannot read a tree node raises, and then
nothing is settled: every group stays waiting for the next look (none is lost between).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tieredbuf.errors import RemoteUnconfirmedError
from tieredbuf.produce.hub_state import Group, HubState
from tieredbuf.queue.commit import locate
from tieredbuf.queue.manifest_queue import Snapshot

log = logging.getLogger(__name__)

Placed = Mapping[str, Mapping[int, tuple[int, str]]]
"""producer id -> {producer seq: (sequence, location)}: what a commit appended."""


@dataclass
class Settled:
    """What one look at a root settles."""

    done: list[tuple[Group, list[tuple[int, str]]]] = field(default_factory=list)
    """Groups confirmed, each entry's (sequence, location)."""
    failed: list[tuple[Group, BaseException]] = field(default_factory=list)
    """Groups covered that cannot be confirmed."""


def settle(snap: Snapshot, waiting: Mapping[str, Sequence[Group]], placed: Placed) -> Settled:
    """Which of the ``waiting`` groups (per writer, in order) ``snap`` and ``placed``
    settle.  Reads tree nodes only to look an entry up (a StoreError then: nothing
    settled)."""
    covered: list[Group] = []
    for pid, groups in waiting.items():
        wm = snap.view.watermarks.get(pid)
        for g in groups:  # in order: a later group cannot be in while an earlier is not
            if wm is None or wm.producer_seq < g.last_seq:
                break
            covered.append(g)
    if not covered:
        return Settled()
    want = {
        loc
        for g in covered
        for e in g.entries
        if e.producer_seq not in placed.get(g.producer_id, {})
        for loc in g.uploads[e.producer_seq]
    }
    found: dict[str, int] = {}
    if want:
        found = locate(snap, want, {g.producer_id for g in covered}, min(g.floor for g in covered))
    out = Settled()
    for g in covered:
        mine = placed.get(g.producer_id, {})
        wm = snap.view.watermarks[g.producer_id]
        seqs: list[tuple[int, str]] = []
        missing: list[int] = []
        for e in g.entries:
            ups = g.uploads[e.producer_seq]
            at = mine.get(e.producer_seq)
            if at is None:
                at = next(((found[u], u) for u in ups if u in found), None)
            if at is None and wm.producer_seq == e.producer_seq and len(ups) == 1:
                at = (wm.last_sequence, ups[0])  # the watermark's record of this very append
            if at is None:
                missing.append(e.producer_seq)
            else:
                seqs.append(at)
        if missing:
            locs = [u for p in missing for u in g.uploads[p]]
            out.failed.append((g, RemoteUnconfirmedError(g.producer_id, missing, locs)))
        else:
            out.done.append((g, seqs))
    return out


class Settler:
    """Settles a hub's waiting groups against a root, and calls their writers back."""

    def __init__(self, state: HubState) -> None:
        self.state = state

    def look(self, snap: Snapshot, placed: Placed | None = None) -> None:
        """Settle what ``snap`` (and this hub's commit that wrote it: ``placed``) shows.
        Raises what a lookup raised; then every group still waits."""
        st = self.state
        with st.cond:
            waiting = {pid: list(gs) for pid, gs in st.waiting.items()}
        result = settle(snap, waiting, placed or {})
        if not result.done and not result.failed:
            return
        finished = {id(g) for g, _ in result.done} | {id(g) for g, _ in result.failed}
        with st.cond:  # withdrawn meanwhile: its writer failed it already
            live = {id(g) for g in st.groups()}
            for pid in list(st.waiting):
                st.waiting[pid] = [g for g in st.waiting[pid] if id(g) not in finished]
                if not st.waiting[pid]:
                    del st.waiting[pid]
            st.cond.notify_all()
        for g, seqs in result.done:
            if id(g) in live:
                st.stats.incr("groups_confirmed")
                call(g, seqs, None)
        for g, err in result.failed:
            if id(g) in live:
                st.stats.incr("groups_unconfirmed")
                log.error("%s", err)
                call(g, None, err)


def call(g: Group, seqs: list[tuple[int, str]] | None, err: BaseException | None) -> None:
    """Tell ``g``'s writer (once): a callback's own failure is logged, never the hub's."""
    try:
        g.done(seqs, err)
    except Exception:
        log.exception("a fan-in completion callback failed")
