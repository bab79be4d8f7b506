"""The M-way manifest tree in memory: pure decisions, with node I/O passed in.

A root is ``[refs oldest first, levels never rising][root entries]`` covering the
contiguous sequences ``linked_first .. next_sequence - 1``; ``low`` is the first
readable sequence, ``head`` the first queued (not dequeued) one:
``linked_first <= low <= head <= next_sequence``.

Pure decisions: :func:`cuts` (when to rebalance), :func:`decide` (what retention
or a dequeue unlinks), the bisections in :mod:`tieredbuf.queue.tree_read`.  The
only I/O goes through the ``load`` / ``put`` callables a caller passes in.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from tieredbuf.errors import CorruptError
from tieredbuf.format import manifest as fm
from tieredbuf.format import tree as ft
from tieredbuf.format._reader import Reader

Load = Callable[[ft.Ref], ft.Node]
"""Fetch the node a ref points at (cached, retried)."""
Put = Callable[[int, int, bytes], bytes]
"""Write a new node ``(level, first_seq, data)`` under a fresh key; returns its ULID bytes."""


def cuts(count: int, m: int) -> int:
    """How many chunks of the oldest ``m`` to move one level down so at most ``m`` remain."""
    return max(0, (count - 1) // m)


@dataclass(frozen=True, slots=True)
class Policy:
    """What a trim may unlink: acked history only, and with retention only past its limits."""

    head: int
    retain: bool
    age_limit_ms: int | None = None
    """Entries whose ingestion time is older than this may go (None: no age rule)."""
    max_bytes: int | None = None
    """Unlink oldest while the linked bytes exceed this (None: no size rule)."""


class Decision(enum.Enum):
    DROP = "drop"
    KEEP = "keep"
    DESCEND = "descend"


def decide(p: Policy, first: int, last: int, nbytes: int, min_t: int, max_t: int,
           total: int, leaf: bool) -> Decision:
    """Drop, keep or (for a node) look inside the oldest linked element.

    Without retention every acked element goes (RFC dequeue).  With retention an
    acked element goes when it is older than the age limit or while the linked
    total exceeds ``max_bytes``.  A node is dropped whole only when every element
    inside it would be; otherwise it is opened when its first element might go.
    """
    if first >= p.head:
        return Decision.KEEP
    if not p.retain:
        if last < p.head:
            return Decision.DROP
        return Decision.KEEP if leaf else Decision.DESCEND
    old_all = p.age_limit_ms is not None and max_t < p.age_limit_ms
    if leaf:
        big = p.max_bytes is not None and total > p.max_bytes
        return Decision.DROP if last < p.head and (old_all or big) else Decision.KEEP
    big_all = p.max_bytes is not None and total - nbytes > p.max_bytes
    if last < p.head and (old_all or big_all):
        return Decision.DROP
    old_first = p.age_limit_ms is not None and min_t < p.age_limit_ms
    big_first = p.max_bytes is not None and total > p.max_bytes
    return Decision.DESCEND if old_first or big_first else Decision.KEEP


@dataclass(slots=True)
class Root:
    """A decoded root (or a draft of the next one, during one CAS attempt)."""

    region: bytes | memoryview
    n_entries: int
    next_seq: int
    epoch: int
    watermarks: dict[str, fm.Watermark]
    owner: str | None
    low: int
    head: int
    refs: list[ft.Ref]
    stats: list[ft.Stat]
    version: int = fm.V2
    nodes_written: list[tuple[int, int]] = field(default_factory=list)
    """(level, first_seq) of each node written while building this draft."""

    @property
    def entries_first(self) -> int:
        return self.next_seq - self.n_entries

    @property
    def linked_first(self) -> int:
        return self.refs[0].first if self.refs else self.entries_first

    @property
    def total_bytes(self) -> int:
        """Bytes of every data object linked from the tree (exact by construction)."""
        return sum(r.total_bytes for r in self.refs) + sum(s.size for s in self.stats)

    def entries_view(self) -> fm.ManifestView:
        f = fm.Footer(self.n_entries, self.next_seq, self.epoch, fm.V2)
        return fm.ManifestView(bytes(self.region), f, len(self.region))

    def copy(self) -> Root:
        return Root(self.region, self.n_entries, self.next_seq, self.epoch,
                    dict(self.watermarks), self.owner, self.low, self.head, list(self.refs),
                    list(self.stats), self.version)

    def encode(self) -> bytes:
        state = ft.TreeState(self.low, self.head, tuple(self.refs))
        footer = fm.Footer(self.n_entries, self.next_seq, self.epoch, fm.V2)
        return fm.encode_manifest(self.region, footer, self.watermarks, self.owner,
                                  ft.encode_tree(state), ft.encode_stats(self.stats))


def decode_root(view: fm.ManifestView, default_time_ms: int = 0) -> Root:
    """The tree behind a root view; a flat (v1 / older v2) manifest reads as a tree of one level.

    A flat manifest has no sizes (0) and its times come from decoding its entries once.
    """
    f = view.footer
    if view.tree is not None:
        st = ft.decode_tree(view.tree, view.obj)
        low, head, refs = st.low, st.head, list(st.refs)
    else:
        low = head = f.first_sequence
        refs = []
    if view.stats is not None:
        stats = list(ft.decode_stats(view.stats, view.obj))
        if len(stats) != f.entry_count:
            raise CorruptError(fm.WHAT, view.obj, 0,
                                  f"{len(stats)} stats for {f.entry_count} entries")
    else:
        stats = [ft.Stat(0, ft.entry_time(e.metadata, default_time_ms))
                 for e in fm.iter_entries(view)]
    root = Root(view.entries_bytes, f.entry_count, f.next_sequence, f.epoch,
                dict(view.watermarks), view.owner, low, head, refs, stats, f.version)
    if refs and refs[-1].last + 1 != root.entries_first:
        raise CorruptError(fm.WHAT, view.obj, 0, "refs and root entries are not contiguous")
    if not root.linked_first <= low <= head <= f.next_sequence:
        raise CorruptError(fm.WHAT, view.obj, 0, f"bad bounds low={low} head={head}")
    return root


# --- writing: append, rebalance, trim ------------------------------------------


def append_entries(root: Root, new: Sequence[fm.NewEntry], now_ms: int) -> int:
    """Append ``new`` after the root's entries (never decoding them); returns the first sequence."""
    first = root.next_seq
    enc = [fm.encode_entry(first + i, n.location, n.metadata) for i, n in enumerate(new)]
    root.region = b"".join((root.region, *enc))
    root.stats.extend(ft.Stat(n.size, ft.entry_time(n.metadata, now_ms)) for n in new)
    root.n_entries += len(new)
    root.next_seq += len(new)
    return first


def _cut_region(root: Root, k: int) -> tuple[bytes, int]:
    """(bytes of the first ``k`` root entries, byte offset where entry ``k`` starts)."""
    off = fm.skip_entries(root.entries_view(), k)
    return bytes(root.region[:off]), off


def rebalance(root: Root, m: int, put: Put) -> None:
    """Move the oldest ``m`` of any over-full level into new nodes until every level has <= m."""
    k = cuts(root.n_entries, m)
    if k:
        view = root.entries_view()
        offs = [0]
        for _ in range(k):
            offs.append(_skip_from(view, offs[-1], m))
        new_refs = []
        for i in range(k):
            first = root.entries_first + i * m
            stats = root.stats[i * m : (i + 1) * m]
            data = ft.encode_node(0, first, entries_region=view.raw[offs[i] : offs[i + 1]],
                                  stats=stats)
            new_refs.append(ft.ref_for(0, first, stats, None, put(0, first, data)))
            root.nodes_written.append((0, first))
        root.region = view.raw[offs[k] :]
        root.stats = root.stats[k * m :]
        root.n_entries -= k * m
        root.refs.extend(new_refs)
    for level in range(ft.MAX_LEVEL):
        idx = [i for i, r in enumerate(root.refs) if r.level == level]
        k = cuts(len(idx), m)
        if not k:
            continue
        start = idx[0]
        made = []
        for i in range(k):
            children = root.refs[start + i * m : start + (i + 1) * m]
            first = children[0].first
            data = ft.encode_node(level + 1, first, refs=children)
            made.append(ft.ref_for(level + 1, first, None, children, put(level + 1, first, data)))
            root.nodes_written.append((level + 1, first))
        root.refs[start : start + k * m] = made


def _skip_from(view: fm.ManifestView, start: int, k: int) -> int:
    r = Reader(view.raw, fm.WHAT, view.obj, start, view.entries_end)
    for i in range(k):
        r.take(r.u32(f"entry {i} length"), f"entry {i}")
    return r.pos


def _trim_refs(refs: Sequence[ft.Ref], p: Policy, total: int, load: Load,
               put: Put, root: Root) -> tuple[list[ft.Ref], int, bool]:
    """Trim the front of a ref list; returns (remaining refs, total after, stopped early)."""
    out = list(refs)
    i = 0
    while i < len(out):
        r = out[i]
        d = decide(p, r.first, r.last, r.total_bytes, r.min_time_ms, r.max_time_ms, total,
                   leaf=r.level == 0)
        if d is Decision.DROP:
            total -= r.total_bytes
            i += 1
            continue
        if d is Decision.DESCEND:
            node = load(r)
            kids, total, _ = _trim_refs(node.refs, p, total, load, put, root)
            if not kids:
                i += 1
                continue
            if len(kids) != len(node.refs) or kids[0] != node.refs[0]:
                data = ft.encode_node(r.level, kids[0].first, refs=kids)
                ulid = put(r.level, kids[0].first, data)
                root.nodes_written.append((r.level, kids[0].first))
                out[i] = ft.ref_for(r.level, kids[0].first, None, kids, ulid)
        return out[i:], total, True
    return [], total, False


def trim(root: Root, p: Policy, load: Load, put: Put) -> None:
    """Unlink what ``p`` allows from the front of the tree, rewriting a partly kept node."""
    total = root.total_bytes
    refs, total, stopped = _trim_refs(root.refs, p, total, load, put, root)
    root.refs = refs
    if not stopped:
        j = 0
        while j < root.n_entries:
            s = root.stats[j]
            seq = root.entries_first + j
            if decide(p, seq, seq, s.size, s.time_ms, s.time_ms, total, True) is not Decision.DROP:
                break
            total -= s.size
            j += 1
        if j:
            _, off = _cut_region(root, j)
            root.region = root.region[off:]
            root.stats = root.stats[j:]
            root.n_entries -= j
    floor = root.linked_first if p.retain else root.head
    root.low = max(root.low, floor)


# --- reading ---------------------------------------------------------------------


def entry_at(view: fm.ManifestView, index: int) -> fm.ManifestEntry:
    """Decode only entry ``index`` of a flat entry region."""
    off = fm.skip_entries(view, index)
    n = int.from_bytes(view.raw[off : off + 4], "little")
    f = fm.Footer(1, view.footer.first_sequence + index + 1, 0, fm.V2)
    one = fm.ManifestView(bytes(view.raw[off : off + 4 + n]), f, 4 + n, obj=view.obj)
    return next(fm.iter_entries(one))


def iter_view_from(view: fm.ManifestView, start: int) -> list[fm.ManifestEntry]:
    """Entries of a flat region with sequence >= ``start``."""
    first = view.footer.first_sequence
    k = max(0, start - first)
    if k >= view.footer.entry_count:
        return []
    off = fm.skip_entries(view, k)
    f = fm.Footer(view.footer.entry_count - k, view.footer.next_sequence, 0, fm.V2)
    rest = fm.ManifestView(bytes(view.raw[off : view.entries_end]), f, view.entries_end - off,
                           obj=view.obj)
    return list(fm.iter_entries(rest))


def ref_index(refs: Sequence[ft.Ref], seq: int) -> int:
    """Index of the ref covering ``seq`` (len(refs) when past the last)."""
    return bisect.bisect_left([r.last for r in refs], seq)


def first_at_or_after_time(times: Sequence[int], t: int) -> int:
    """Index of the first item whose time is >= ``t``: bisection over the running maximum."""
    run: list[int] = []
    hi = -(1 << 63)
    for x in times:
        hi = max(hi, x)
        run.append(hi)
    return bisect.bisect_left(run, t)


def iter_from(root: Root, start: int, load: Load) -> Iterator[fm.ManifestEntry]:
    """Every linked entry with sequence >= ``start``, in order, loading one node at a time."""
    yield from _iter_refs(root.refs, start, load)
    yield from iter_view_from(root.entries_view(), start)


def _iter_refs(refs: Sequence[ft.Ref], start: int, load: Load) -> Iterator[fm.ManifestEntry]:
    for r in refs[ref_index(refs, start):]:
        node = load(r)
        if node.level == 0:
            assert node.entries is not None
            yield from iter_view_from(node.entries, start)
        else:
            yield from _iter_refs(node.refs, start, load)


def find_sequence(root: Root, seq: int, load: Load) -> fm.ManifestEntry | None:
    """The entry ``seq`` (one node GET per level); None outside the linked range."""
    if seq >= root.next_seq or seq < root.linked_first:
        return None
    if seq >= root.entries_first:
        return entry_at(root.entries_view(), seq - root.entries_first)
    refs: Sequence[ft.Ref] = root.refs
    while True:
        node = load(refs[ref_index(refs, seq)])
        if node.level == 0:
            assert node.entries is not None
            return entry_at(node.entries, seq - node.first)
        refs = node.refs


def find_time(root: Root, t: int, load: Load) -> int:
    """First linked sequence with ingestion time >= ``t`` (next_seq if none); one GET per level."""
    i = first_at_or_after_time([r.max_time_ms for r in root.refs], t)
    if i == len(root.refs):
        j = first_at_or_after_time([s.time_ms for s in root.stats], t)
        return root.entries_first + j
    refs: Sequence[ft.Ref] = root.refs
    r = refs[i]
    while True:
        node = load(r)
        if node.level == 0:
            j = first_at_or_after_time([s.time_ms for s in node.stats], t)
            return node.first + j
        refs = node.refs
        r = refs[first_at_or_after_time([x.max_time_ms for x in refs], t)]
