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
from dataclasses import dataclass

from tieredbuf.errors import CorruptError
from tieredbuf.format import manifest as fm
from tieredbuf.format import registry as freg
from tieredbuf.format import tree as ft

Load = Callable[[ft.Ref], ft.Node]
"""Fetch the node a ref points at (cached, retried)."""
Put = Callable[[int, int, bytes], bytes]
"""Write a new node ``(level, first_seq, data)`` under a fresh key; returns its ULID bytes."""


def cuts(count: int, m: int) -> int:
    """How many chunks of the oldest ``m`` to move one level down so at most ``m`` remain."""
    return max(0, (count - 1) // m)


@dataclass(frozen=True, slots=True)
class Policy:
    """What a trim may unlink: without retention what every subscriber is past (before the
    head); with retention whatever is past its limits, acked or not (retention wins over a
    stalled subscriber, as Kafka's does; that subscriber is then told: DataLossError)."""

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

    Without retention every element before the head goes (RFC dequeue: every
    subscriber is past it).  With retention an element goes when it is older than
    the age limit or while the linked total exceeds ``max_bytes``, whether or not
    every subscriber acked it.  A node is dropped whole only when every element
    inside it would be; otherwise it is opened when its first element might go.
    """
    if not p.retain:
        if first >= p.head:
            return Decision.KEEP
        if last < p.head:
            return Decision.DROP
        return Decision.KEEP if leaf else Decision.DESCEND
    old_all = p.age_limit_ms is not None and max_t < p.age_limit_ms
    if leaf:
        big = p.max_bytes is not None and total > p.max_bytes
        return Decision.DROP if old_all or big else Decision.KEEP
    big_all = p.max_bytes is not None and total - nbytes > p.max_bytes
    if old_all or big_all:
        return Decision.DROP
    old_first = p.age_limit_ms is not None and min_t < p.age_limit_ms
    big_first = p.max_bytes is not None and total > p.max_bytes
    return Decision.DESCEND if old_first or big_first else Decision.KEEP


class Root:
    """A decoded root (or a draft of the next one, during one CAS attempt).

    The refs and stats are kept as the raw bytes of sections 3 and 4 and decoded
    only on demand (:attr:`refs`, :attr:`stats`): a plain append copies them as
    bytes, exactly as it copies the entry region, so its cost does not grow with
    the backlog (I6).  :attr:`refs` and :attr:`stats` are read-only views; assign a
    new list to change them.
    """

    __slots__ = (
        "_refs",
        "_refs_raw",
        "_refs_total",
        "_stats",
        "_stats_raw",
        "buffer",
        "epoch",
        "head",
        "lease",
        "low",
        "n_entries",
        "next_seq",
        "nodes_written",
        "obj",
        "owner",
        "region",
        "registry",
        "retention",
        "version",
        "watermarks",
    )

    def __init__(self, region: bytes | memoryview, n_entries: int, next_seq: int, epoch: int,
                 watermarks: dict[str, fm.Watermark], owner: str | None, low: int, head: int,
                 refs_raw: bytes, stats_raw: bytes, version: int = fm.V2,
                 obj: str | None = None, retention: fm.RetentionPolicy | None = None,
                 buffer: fm.BufferInfo | None = None,
                 registry: dict[str, freg.Registration] | None = None,
                 lease: fm.CommitLease | None = None) -> None:
        self.region = region
        self.n_entries = n_entries
        self.next_seq = next_seq
        self.epoch = epoch
        self.watermarks = watermarks
        self.owner = owner
        self.low = low
        self.head = head
        self.version = version
        self.obj = obj
        self.retention = retention
        """Section 5: the buffer's retention policy (None: never set, no retention)."""
        self.buffer = buffer
        """Section 6: the buffer's id, creation time and GC grace (None: not written yet)."""
        self.registry: dict[str, freg.Registration] = (
            freg.implied(epoch, head) if registry is None else dict(registry))
        """Section 7, resolved: every registered subscriber (implied when the section is absent)."""
        self.lease = lease
        """Section 8: the commit lease of fan-in (None: never taken)."""
        self.nodes_written: list[tuple[int, int]] = []
        """(level, first_seq) of each node written while building this draft."""
        self._refs: list[ft.Ref] | None = None
        self._refs_raw: bytes | None = refs_raw
        self._stats: list[ft.Stat] | None = None
        self._stats_raw: bytes | None = stats_raw
        self._refs_total: int | None = None

    # --- refs -------------------------------------------------------------------

    @property
    def refs(self) -> list[ft.Ref]:
        """The root's refs, oldest first (decoded and checked on first use)."""
        if self._refs is None:
            assert self._refs_raw is not None
            self._refs = list(ft.decode_root_refs(self._refs_raw, self.obj))
        return self._refs

    @refs.setter
    def refs(self, refs: list[ft.Ref]) -> None:
        self._refs, self._refs_raw, self._refs_total = list(refs), None, None

    @property
    def refs_raw(self) -> bytes:
        if self._refs_raw is None:
            assert self._refs is not None
            self._refs_raw = ft.encode_refs(self._refs)
        return self._refs_raw

    @property
    def n_refs(self) -> int:
        return len(self._refs) if self._refs is not None else len(self.refs_raw) // ft.REF_SIZE

    def ref_at(self, i: int) -> ft.Ref:
        return self._refs[i] if self._refs is not None else ft.ref_at(self.refs_raw, i)

    def ref_levels(self) -> bytes:
        """One byte per ref: its level."""
        if self._refs is not None:
            return bytes(r.level for r in self._refs)
        return ft.ref_levels(self.refs_raw)

    def extend_refs(self, new: Sequence[ft.Ref]) -> None:
        raw = self.refs_raw + ft.encode_refs(list(new))
        if self._refs is not None:
            self._refs.extend(new)
        if self._refs_total is not None:
            self._refs_total += sum(r.total_bytes for r in new)
        self._refs_raw = raw

    # --- stats ------------------------------------------------------------------

    @property
    def stats(self) -> list[ft.Stat]:
        """One stat per root entry (decoded on first use)."""
        if self._stats is None:
            assert self._stats_raw is not None
            self._stats = list(ft.stats_from_raw(self._stats_raw))
        return self._stats

    @stats.setter
    def stats(self, stats: list[ft.Stat]) -> None:
        self._stats, self._stats_raw = list(stats), None

    @property
    def stats_raw(self) -> bytes:
        if self._stats_raw is None:
            assert self._stats is not None
            self._stats_raw = ft.pack_stats(self._stats)
        return self._stats_raw

    def stat_at(self, i: int) -> ft.Stat:
        return self._stats[i] if self._stats is not None else ft.stat_at(self.stats_raw, i)

    def extend_stats(self, new: Sequence[ft.Stat]) -> None:
        raw = self.stats_raw + ft.pack_stats(list(new))
        if self._stats is not None:
            self._stats.extend(new)
        self._stats_raw = raw

    def drop_stats(self, k: int) -> None:
        """Forget the stats of the first ``k`` root entries."""
        raw = self.stats_raw[k * ft.STAT_SIZE :]
        if self._stats is not None:
            del self._stats[:k]
        self._stats_raw = raw

    # --- derived ----------------------------------------------------------------

    @property
    def entries_first(self) -> int:
        return self.next_seq - self.n_entries

    @property
    def linked_first(self) -> int:
        return self.ref_at(0).first if self.n_refs else self.entries_first

    def refs_total_bytes(self) -> int:
        if self._refs_total is None:
            self._refs_total = (sum(r.total_bytes for r in self._refs) if self._refs is not None
                                else ft.refs_total_bytes(self.refs_raw))
        return self._refs_total

    @property
    def total_bytes(self) -> int:
        """Bytes of every data object linked from the tree (exact by construction)."""
        return self.refs_total_bytes() + ft.stats_total_bytes(self.stats_raw)

    def entries_view(self) -> fm.ManifestView:
        f = fm.Footer(self.n_entries, self.next_seq, self.epoch, fm.V2)
        return fm.ManifestView(bytes(self.region), f, len(self.region), obj=self.obj)

    def copy(self) -> Root:
        c = Root(self.region, self.n_entries, self.next_seq, self.epoch, dict(self.watermarks),
                 self.owner, self.low, self.head, b"", b"", self.version, self.obj,
                 self.retention, self.buffer, self.registry, self.lease)
        c._refs_raw, c._stats_raw, c._refs_total = self._refs_raw, self._stats_raw, self._refs_total
        c._refs = None if self._refs is None else list(self._refs)
        c._stats = None if self._stats is None else list(self._stats)
        return c

    def same_links(self, other: Root) -> bool:
        """True when both roots link the same refs and root entries from the same low."""
        return (self.low, self.n_entries, self.entries_first) == (
            other.low, other.n_entries, other.entries_first) and self.refs_raw == other.refs_raw

    def settle_head(self) -> None:
        """head = the slowest registered subscriber's published position (clamped into
        ``[low, next_seq]``); unchanged with nobody registered."""
        self.head = freg.head_of(self.registry, self.low, self.next_seq, self.head)

    def encode(self) -> bytes:
        """The root's bytes; section 7 only when the registry is not the implied one (so a
        buffer with only the default consumer keeps its RFC-era bytes)."""
        footer = fm.Footer(self.n_entries, self.next_seq, self.epoch, fm.V2)
        regs = None if self.registry == freg.implied(self.epoch, self.head) else self.registry
        return fm.encode_manifest(self.region, footer, self.watermarks, self.owner,
                                  ft.encode_tree_raw(self.low, self.head, self.refs_raw),
                                  ft.encode_stats_raw(self.stats_raw), self.retention,
                                  self.buffer, regs, self.lease)


def decode_root(view: fm.ManifestView, default_time_ms: int = 0) -> Root:
    """The tree behind a root view; a flat (v1 / older v2) manifest reads as a tree of one level.

    Refs and stats stay raw (their lengths checked; refs are decoded and checked on first
    use).  A flat manifest has no sizes (0) and its times come from decoding its entries once.
    """
    f = view.footer
    if view.tree is not None:
        low, head, refs_raw = ft.split_tree(view.tree, view.obj)
    else:
        low = head = f.first_sequence
        refs_raw = b""
    if view.stats is not None:
        stats_raw = ft.split_stats(view.stats, view.obj)
        n_stats = len(stats_raw) // ft.STAT_SIZE
        if n_stats != f.entry_count:
            raise CorruptError(fm.WHAT, view.obj, 0, f"{n_stats} stats for {f.entry_count} entries")
    else:
        stats_raw = ft.pack_stats([ft.Stat(0, ft.entry_time(e.metadata, default_time_ms))
                                   for e in fm.iter_entries(view)])
    root = Root(view.entries_bytes, f.entry_count, f.next_sequence, f.epoch,
                dict(view.watermarks), view.owner, low, head, refs_raw, stats_raw, f.version,
                view.obj, view.retention, view.buffer, view.subscribers, view.lease)
    if root.n_refs and root.ref_at(-1).last + 1 != root.entries_first:
        raise CorruptError(fm.WHAT, view.obj, 0, "refs and root entries are not contiguous")
    if not root.linked_first <= low <= head <= f.next_sequence:
        raise CorruptError(fm.WHAT, view.obj, 0, f"bad bounds low={low} head={head}")
    return root


# --- writing: append, rebalance, trim ------------------------------------------


def append_entries(root: Root, new: Sequence[fm.NewEntry], now_ms: int) -> int:
    """Append ``new`` after the root's entries (never decoding them, nor the refs and stats);
    returns the first sequence."""
    first = root.next_seq
    enc = [fm.encode_entry(first + i, n.location, n.metadata) for i, n in enumerate(new)]
    root.region = b"".join((root.region, *enc))
    root.extend_stats([ft.Stat(n.size, ft.entry_time(n.metadata, now_ms)) for n in new])
    root.n_entries += len(new)
    root.next_seq += len(new)
    return first


def _cut_region(root: Root, k: int) -> tuple[bytes, int]:
    """(bytes of the first ``k`` root entries, byte offset where entry ``k`` starts)."""
    off = fm.skip_entries(root.entries_view(), k)
    return bytes(root.region[:off]), off


def rebalance(root: Root, m: int, put: Put) -> None:
    """Move the oldest ``m`` of any over-full level into new nodes until every level has <= m.

    Touches the refs and stats only when a level is over-full (amortised O(1) per entry).
    """
    k = cuts(root.n_entries, m)
    if k:
        view = root.entries_view()
        raw_stats = root.stats_raw
        offs = [0]
        for _ in range(k):
            offs.append(fm.skip_entries(view, m, offs[-1]))
        new_refs = []
        for i in range(k):
            first = root.entries_first + i * m
            chunk = raw_stats[i * m * ft.STAT_SIZE : (i + 1) * m * ft.STAT_SIZE]
            data = ft.encode_node(0, first, entries_region=view.raw[offs[i] : offs[i + 1]],
                                  stats_raw=chunk)
            stats = ft.stats_from_raw(chunk)
            new_refs.append(ft.ref_for(0, first, stats, None, put(0, first, data)))
            root.nodes_written.append((0, first))
        root.region = view.raw[offs[k] :]
        root.drop_stats(k * m)
        root.n_entries -= k * m
        root.extend_refs(new_refs)
    for level in range(ft.MAX_LEVEL):
        levels = root.ref_levels()
        k = cuts(levels.count(level), m)
        if not k:
            continue
        start = levels.index(level)
        refs = list(root.refs)
        made = []
        for i in range(k):
            children = refs[start + i * m : start + (i + 1) * m]
            first = children[0].first
            data = ft.encode_node(level + 1, first, refs=children)
            made.append(ft.ref_for(level + 1, first, None, children, put(level + 1, first, data)))
            root.nodes_written.append((level + 1, first))
        refs[start : start + k * m] = made
        root.refs = refs


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
    """Unlink what ``p`` allows from the front of the tree, rewriting a partly kept node.

    Decodes the refs only when the oldest one may go (or must be opened): a write that
    unlinks nothing copies them as bytes.
    """
    total = root.total_bytes if p.max_bytes is not None else 0
    stopped = False
    if root.n_refs:
        r0 = root.ref_at(0)
        if decide(p, r0.first, r0.last, r0.total_bytes, r0.min_time_ms, r0.max_time_ms, total,
                  leaf=r0.level == 0) is Decision.KEEP:
            stopped = True
        else:
            before = root.refs
            refs, total, stopped = _trim_refs(before, p, total, load, put, root)
            if len(refs) != len(before) or refs[0] is not before[0]:
                root.refs = refs
    if not stopped:
        j = 0
        while j < root.n_entries:
            s = root.stat_at(j)
            seq = root.entries_first + j
            if decide(p, seq, seq, s.size, s.time_ms, s.time_ms, total, True) is not Decision.DROP:
                break
            total -= s.size
            j += 1
        if j:
            _, off = _cut_region(root, j)
            root.region = root.region[off:]
            root.drop_stats(j)
            root.n_entries -= j
    floor = root.linked_first if p.retain else root.head
    root.low = max(root.low, floor)
    root.head = max(root.head, root.low)  # retention passed a stalled subscriber


# --- reading ---------------------------------------------------------------------


def entry_at(view: fm.ManifestView, index: int) -> fm.ManifestEntry:
    """Decode only entry ``index`` of a flat entry region."""
    off = fm.skip_entries(view, index)
    n = int.from_bytes(view.raw[off : off + 4], "little")
    f = fm.Footer(1, view.footer.first_sequence + index + 1, 0, fm.V2)
    one = fm.ManifestView(bytes(view.raw[off : off + 4 + n]), f, 4 + n, obj=view.obj)
    return next(fm.iter_entries(one))


def iter_view_from(view: fm.ManifestView, start: int) -> Iterator[fm.ManifestEntry]:
    """Entries of a flat region with sequence >= ``start``, decoded lazily."""
    first = view.footer.first_sequence
    k = max(0, start - first)
    if k >= view.footer.entry_count:
        return iter(())
    off = fm.skip_entries(view, k)
    f = fm.Footer(view.footer.entry_count - k, view.footer.next_sequence, 0, fm.V2)
    rest = fm.ManifestView(bytes(view.raw[off : view.entries_end]), f, view.entries_end - off,
                           obj=view.obj)
    return fm.iter_entries(rest)


def ref_index(refs: Sequence[ft.Ref], seq: int) -> int:
    """Index of the ref covering ``seq`` (len(refs) when past the last)."""
    return bisect.bisect_left(refs, seq, key=lambda r: r.last)


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
    return (e for e, _ in iter_sized_from(root, start, load))


def iter_sized_from(
    root: Root, start: int, load: Load
) -> Iterator[tuple[fm.ManifestEntry, int]]:
    """:func:`iter_from` with each entry's object size from the stats (0: unknown), lazy:
    finding ``start`` costs one bisection per level (the root's refs are decoded and
    checked once per root, I7: at most 2M of them whatever the backlog, I6), a node is
    loaded when the walk reaches it, and only what the caller consumes is decoded."""
    if start < root.entries_first and root.n_refs:
        refs = root.refs
        for r in refs[ref_index(refs, start):]:
            yield from _iter_node(r, start, load)
    first = root.entries_first
    for e in iter_view_from(root.entries_view(), start):
        yield e, _size(root.stat_at, root.n_entries, e.sequence - first)


def _size(stat_at: Callable[[int], ft.Stat], n: int, i: int) -> int:
    return stat_at(i).size if i < n else 0


def _iter_node(r: ft.Ref, start: int, load: Load) -> Iterator[tuple[fm.ManifestEntry, int]]:
    node = load(r)
    if node.level == 0:
        assert node.entries is not None
        stats = node.stats
        for e in iter_view_from(node.entries, start):
            i = e.sequence - node.first
            yield e, stats[i].size if i < len(stats) else 0
        return
    for c in node.refs[ref_index(node.refs, start):]:
        yield from _iter_node(c, start, load)


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


def find_end_before(root: Root, t: int, load: Load) -> int:
    """1 + the last linked sequence whose entry time (its newest record) is < ``t``;
    ``linked_first`` when there is none.  One GET per level below the root.

    Every entry past it has its newest record at or after ``t`` (late entries included:
    this is not a bisection over append order but a search for the *last* old one,
    through the refs' ``min_time_ms``)."""
    for j in range(root.n_entries - 1, -1, -1):
        if root.stat_at(j).time_ms < t:
            return root.entries_first + j + 1
    for r in reversed(root.refs):
        if r.min_time_ms < t:
            return _last_before(r, t, load) + 1
    return root.linked_first


def _last_before(r: ft.Ref, t: int, load: Load) -> int:
    while True:
        node = load(r)
        if node.level == 0:
            for j in range(node.count - 1, -1, -1):
                if node.stats[j].time_ms < t:
                    return node.first + j
            break
        child = next((c for c in reversed(node.refs) if c.min_time_ms < t), None)
        if child is None:
            break
        r = child
    raise CorruptError(ft.WHAT_NODE, None, 0, f"ref {r.first}..{r.last} has min_time_ms "
                       f"{r.min_time_ms} but no entry older than {t}")


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

