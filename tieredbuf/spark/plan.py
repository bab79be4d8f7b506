"""Driver side of the ``tieredbuf`` source: which sequences to read, as partitions.

Everything goes through the manifest tree from one root read (one GET; the root
is bounded, I6): a position by sequence or by ingestion time costs one node GET
per tree level below the root (none for cached nodes), and a range is listed by
loading only the nodes that hold it, lazily.  A plan therefore costs
O(levels + objects planned), never O(backlog): no dict of every queued entry, no
GET of every group.

Ranges:

* ``earliest`` is the first sequence the buffer keeps (``low``: with retention,
  acked history is kept and readable), ``latest`` the next one to be appended.  A
  wanted sequence below ``low`` is gone: DataLossError, or with
  ``failOnDataLoss=false`` the plan starts at ``low`` and counts what it skipped.
* A batch time window ``[t0, t1)`` reads from the first object holding a record at
  or after ``t0`` (:func:`tieredbuf.queue.tree.find_time`) to just after the *last*
  object still holding a record before ``t1`` -- late records (an older ingestion
  time appended later: a drained stage, a skewed clock) included -- and filters per
  record, so adjacent windows return every record exactly once.  Objects after
  the last one whose newest record is before ``t1``
  (:func:`tieredbuf.queue.tree.find_end_before`, one GET per level) have their
  newest record at or after ``t1``; the oldest record of each is read from its
  manifest metadata (records) or its tail (bundles) to catch the ones that still
  straddle ``t1``.  That scan is the one part of planning that grows: with the
  objects appended after the window.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import tieredbuf
from tieredbuf import keys
from tieredbuf.errors import (
    BufferNotFoundError,
    ConfigError,
    CorruptError,
    DataLossError,
    ObjectNotFoundError,
)
from tieredbuf.format import manifest as fm
from tieredbuf.format import tree as ft
from tieredbuf.format.segment import StreamInfo
from tieredbuf.format.segment_tail import bundles_by_stream
from tieredbuf.queue import tree
from tieredbuf.queue.manifest_queue import Snapshot
from tieredbuf.spark import arrow as ta
from tieredbuf.spark import options as opt
from tieredbuf.spark.bundles import segment_tail
from tieredbuf.spark.executor import ObjectPartition, StreamSlice
from tieredbuf.store.base import Store

log = logging.getLogger(__name__)

PLAN_THREADS = 16
SCAN_CHUNK = 256
"""Objects whose oldest record is checked together (their tails fetched in parallel)."""

Sized = tuple[fm.ManifestEntry, int]
"""An entry and its data object's size in bytes (0: not recorded)."""


def read_snapshot(buf: tieredbuf.Buffer) -> Snapshot:
    """One root read; a URL with no buffer is an error, never an empty queue."""
    snap = buf.snapshot()
    if not snap.exists:
        raise BufferNotFoundError(buf.url, "a reader never creates one")
    return snap


# --- listing a range lazily ----------------------------------------------------------


def collect(snap: Snapshot, start: int, end: int) -> list[Sized]:
    """The entries ``start <= sequence < end`` (``start >= snap.low``) with their sizes."""
    out: list[Sized] = []
    if end <= start:
        return out
    for e, size in tree.iter_sized_from(snap.root, start, snap.nodes.load):
        if e.sequence >= end:
            break
        out.append((e, size))
    return out


def collect_fresh(
    buf: tieredbuf.Buffer, snap: Snapshot, start: int, end: int, ro: opt.ReadOptions
) -> tuple[list[Sized], int, Snapshot]:
    """:func:`collect`, re-reading the root once when a node it links was reaped
    meanwhile (unlinked by a dequeue or retention, then deleted by GC).

    Returns (entries, sequences lost before ``start``, the snapshot used)."""
    for attempt in range(2):
        first = lost_floor(start, snap.low, ro)
        lost = first - start
        try:
            return collect(snap, first, end), lost, snap
        except ObjectNotFoundError:
            if attempt:
                raise DataLossError(
                    f"a manifest group linked from the current root of {buf.url} is "
                    f"missing (reading sequences {first}..{end - 1})"
                ) from None
            snap = read_snapshot(buf)
    raise AssertionError("unreachable")


# --- positions -----------------------------------------------------------------------


def lost_floor(start: int, low: int, ro: opt.ReadOptions, why: str | None = None) -> int:
    """Where to start when ``start`` may be below the first kept sequence ``low``;
    ``why``: the data loss error's message (default: the sequences are gone)."""
    if start >= low:
        return start
    if ro.fail_on_data_loss:
        raise DataLossError(
            why
            or f"sequences {start}..{low - 1} of {ro.url} were already dequeued or unlinked "
            f"by retention (the buffer keeps {low} onwards); set failOnDataLoss=false to "
            "skip them"
        )
    log.warning(
        "tieredbuf: skipping sequences %d..%d of %s, no longer in the buffer "
        "(failOnDataLoss=false)",
        start,
        low - 1,
        ro.url,
    )
    return low


def resolve_bound(bound: str | int | None, snap: Snapshot, default: str) -> int:
    """``earliest`` (the first kept sequence), ``latest`` (the next to be appended) or n."""
    b = default if bound is None else bound
    if b == opt.EARLIEST:
        return snap.low
    if b == opt.LATEST:
        return snap.root.next_seq
    assert isinstance(b, int)
    return b


def time_start(snap: Snapshot, t_ms: int, ro: opt.ReadOptions) -> int:
    """The first object holding a record ingested at or after ``t_ms`` (one GET per
    level); below the kept history it is a data loss (see :func:`lost_floor`).

    When the first kept object is itself not older than ``t_ms`` (the same millisecond
    included) and history was dropped before it, records of that time may be gone: the
    same rule as ``buf.lookup_time``.
    """
    root = snap.root
    seq = tree.find_time(root, t_ms, snap.nodes.load)
    why = None
    if seq <= snap.low and snap.low > 0 and snap.low < root.next_seq:
        e = tree.find_sequence(root, snap.low, snap.nodes.load)
        if ft.first_kept_may_hide(e, t_ms):
            seq = min(seq, snap.low - 1)
            why = (
                f"startingTimestamp {fmt_ms(t_ms)} is before the first entry {ro.url} still "
                f"keeps (sequence {snap.low}), and sequences up to {snap.low - 1} were "
                f"dequeued or unlinked by retention: they may hold records ingested at or "
                f"after it; set failOnDataLoss=false to read from sequence {snap.low}, or "
                f"start later"
            )
    return lost_floor(seq, snap.low, ro, why)


def fmt_ms(t_ms: int) -> str:
    """``t_ms`` (ms since the epoch) as ISO-8601 UTC, to the millisecond."""
    when = datetime.fromtimestamp(t_ms / 1000, tz=UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def window_end(
    buf: tieredbuf.Buffer, snap: Snapshot, t_ms: int, start: int, ro: opt.ReadOptions
) -> int:
    """Exclusive end of a window ending at ``t_ms``: just after the last object holding
    a record ingested before ``t_ms`` (see the module docstring)."""
    end = max(start, tree.find_end_before(snap.root, t_ms, snap.nodes.load))
    pending: list[fm.ManifestEntry] = []
    pool = ThreadPoolExecutor(PLAN_THREADS) if ro.slot is not None else None
    try:
        for e, _ in tree.iter_sized_from(snap.root, end, snap.nodes.load):
            pending.append(e)
            if len(pending) >= SCAN_CHUNK:
                end = _straddle(buf.store, pending, t_ms, ro, end, pool)
                pending = []
        return _straddle(buf.store, pending, t_ms, ro, end, pool)
    finally:
        if pool is not None:
            pool.shutdown()


def _straddle(
    store: Store,
    entries: Sequence[fm.ManifestEntry],
    t_ms: int,
    ro: opt.ReadOptions,
    end: int,
    pool: ThreadPoolExecutor | None,
) -> int:
    """``end`` moved past the last of ``entries`` that holds a record before ``t_ms``."""
    if ro.slot is None:
        holds = [
            e.location.endswith(keys.BATCH_SUFFIX)
            and any(m.ingestion_time_ms < t_ms for m in e.metadata)
            for e in entries
        ]
    else:
        assert pool is not None
        segs = [e for e in entries if e.location.endswith(keys.SEGMENT_SUFFIX)]
        oldest = pool.map(lambda e: _oldest_bundle_ms(store, e, ro.slot), segs)
        early = {e.sequence: t < t_ms for e, t in zip(segs, oldest, strict=True)}
        holds = [early.get(e.sequence, False) for e in entries]
    for e, h in zip(entries, holds, strict=True):
        if h:
            end = max(end, e.sequence + 1)
    return end


def _oldest_bundle_ms(store: Store, e: fm.ManifestEntry, slot: int | None) -> int:
    """Ingestion time of the oldest bundle of ``slot`` in a ``.qseg`` object (its tail);
    the lowest time when unknown (a missing object is kept in the plan: the executor
    reports it)."""
    try:
        tail = segment_tail(store, e.location)
    except ObjectNotFoundError:
        return -(1 << 63)
    unknown = -(1 << 63)  # no time (a Quiver manifest, no entry metadata): keep it
    times = [
        unknown if t is None else t
        for b in tail.bundles
        if any(s == slot for s, _, _ in b.refs)
        for t in (ta.bundle_time_ms(b.ingestion_ts_nanos, e.metadata),)
    ]
    return min(times, default=1 << 62)


def check_bound_buffers(snap: Snapshot, ro: opt.ReadOptions) -> None:
    """An offsets JSON naming another buffer's id is refused: its sequences are not
    this buffer's (a buffer deleted and created again, or another path)."""
    for name, bid in ro.bound_buffers:
        if snap.buffer_id != bid:
            raise ConfigError(
                f"option {name} names buffer {bid}, but the buffer at {ro.url} is "
                f"{snap.buffer_id or 'an older-format one without an id'}: its sequences "
                "are not this buffer's"
            )


def batch_range(buf: tieredbuf.Buffer, snap: Snapshot, ro: opt.ReadOptions) -> tuple[int, int]:
    """``[start, end)`` of a batch read; below the kept history: :func:`lost_floor`.

    An explicit ``endingOffsets`` below the resolved start is an error: below
    ``latest`` or a ``startingTimestamp``'s sequence a ConfigError, below the first
    kept sequence (``earliest``) a data loss (what it asked for is gone)."""
    check_bound_buffers(snap, ro)
    nxt = snap.root.next_seq
    if ro.starting_ts is not None:
        start = time_start(snap, ro.starting_ts, ro)
    else:
        start = lost_floor(resolve_bound(ro.starting, snap, opt.EARLIEST), snap.low, ro)
    if isinstance(ro.ending, int) and ro.ending < start:
        if ro.starting == opt.LATEST or ro.starting_ts is not None:
            what = "latest" if ro.starting == opt.LATEST else "of startingTimestamp"
            raise ConfigError(
                f"endingOffsets {ro.ending} is below startingOffsets {what} ({start}): the "
                "range would be empty"
            )
        if ro.starting in (None, opt.EARLIEST) and ro.fail_on_data_loss:
            raise DataLossError(
                f"endingOffsets {ro.ending} is below the first sequence {ro.url} keeps "
                f"({snap.low}): the sequences before it were dequeued or unlinked by "
                "retention; set failOnDataLoss=false to read nothing instead"
            )
    if ro.ending_ts is not None:
        end = window_end(buf, snap, ro.ending_ts, start, ro)
    elif ro.ending is None or ro.ending == opt.LATEST:
        end = nxt
    elif ro.ending == opt.EARLIEST:
        raise ConfigError("endingOffsets cannot be 'earliest'")
    else:
        assert isinstance(ro.ending, int)
        end = min(ro.ending, nxt)
    return min(start, nxt), max(min(start, nxt), end)


# --- partitions ----------------------------------------------------------------------


def split_streams(
    store: Store, e: fm.ManifestEntry, ro: opt.ReadOptions, size: int = 0
) -> list[tuple[StreamSlice, ...]] | None:
    """The stream groups a large ``.qseg`` object is read in (None: read it whole).

    Splits only bundle reads of objects over ``splitStreamsBytes`` with at least two
    streams of the slot; consecutive streams are grouped up to that many bytes.  An
    object whose tail does not parse, or says the object has another size than the
    manifest recorded (``size``), is read whole: the executor's checks refuse it."""
    limit = ro.split_streams_bytes
    if ro.slot is None or limit <= 0 or not e.location.endswith(keys.SEGMENT_SUFFIX):
        return None
    try:
        tail = segment_tail(store, e.location)
    except (ObjectNotFoundError, CorruptError):
        return None  # read whole: the executor reports the loss or the damage
    mine = [s for s in tail.streams if s.slot_id == ro.slot]
    if tail.size <= limit or len(mine) < 2 or (size and tail.size != size):
        return None  # read whole (the executor refuses an object of another size)
    groups: list[list[StreamInfo]] = [[]]
    size = 0
    for s in mine:
        if groups[-1] and size + s.byte_length > limit:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.byte_length
    if len(groups) < 2:
        return None
    of = bundles_by_stream(tail, e.location)
    known = [ta.bundle_time_ms(b.ingestion_ts_nanos, e.metadata) for b in tail.bundles]
    if any(t is None for t in known):
        return None  # read whole: the executor decides what a time window can do
    ms = [t for t in known if t is not None]
    return [
        tuple(StreamSlice(s, of[s.stream_id], tuple(ms[b] for b in of[s.stream_id])) for s in g)
        for g in groups
    ]


def object_partitions(
    store: Store,
    sized: Sequence[Sized],
    ro: opt.ReadOptions,
    ts_from_ms: int | None = None,
    ts_to_ms: int | None = None,
) -> list[ObjectPartition]:
    """Consecutive objects packed into partitions (:func:`options.pack`), a large
    ``.qseg`` one split by stream instead (its tail read here, in parallel: at most two
    suffix GETs per object).  A size the manifest lacks (0) is read with a HEAD.
    ``[ts_from_ms, ts_to_ms)`` filters records per record (batch time windows only)."""
    entries = [e for e, _ in sized]
    for e in entries:
        opt.check_long(e.sequence)
    if ro.slot is not None and ro.split_streams_bytes > 0 and len(entries) > 1:
        with ThreadPoolExecutor(min(PLAN_THREADS, len(entries))) as pool:
            splits = list(pool.map(lambda x: split_streams(store, x[0], ro, x[1]), sized))
    else:
        splits = [split_streams(store, e, ro, n) for e, n in sized]
    out = []
    whole: list[Sized] = []
    for (e, size), groups in zip(sized, splits, strict=True):
        if groups is None:
            whole.append((e, size))
            continue
        ref = ta.ObjectRef(e.sequence, e.location, e.metadata, size)
        out += [ObjectPartition([ref], ts_from_ms, ts_to_ms, g) for g in groups]
    if whole:
        lengths = _sizes(store, whole, ro)
        refs = [ta.ObjectRef(e.sequence, e.location, e.metadata, n) for e, n in whole]
        out += [
            ObjectPartition(refs[r.start : r.stop], ts_from_ms, ts_to_ms)
            for r in opt.pack(lengths, ro.max_partition_bytes, ro.min_partitions)
        ]
    out.sort(key=lambda p: (p.ref.sequence, p.streams is not None))
    return out


def _sizes(store: Store, sized: Sequence[Sized], ro: opt.ReadOptions) -> list[int]:
    """Object sizes for packing (HEADs, in parallel, for those the manifest lacks)."""
    if ro.max_partition_bytes <= 0 or len(sized) < 2:
        return [0] * len(sized)
    return sizes_of(store, sized)


def sizes_of(store: Store, sized: Sequence[Sized]) -> list[int]:
    """Each object's size: the manifest's when recorded, else a HEAD (in parallel)."""

    def size(item: Sized) -> int:
        e, n = item
        if n > 0:
            return n
        try:
            return store.head(e.location).size
        except ObjectNotFoundError:
            return 0  # the executor reports the loss when it reads the object

    missing = sum(1 for _, n in sized if n <= 0)
    if missing < 2:
        return [size(x) for x in sized]
    with ThreadPoolExecutor(min(PLAN_THREADS, missing)) as pool:
        return list(pool.map(size, sized))


def admit_bytes(store: Store, snap: Snapshot, start: int, end: int, max_bytes: int) -> int:
    """End offset admitted by ``maxBytesPerTrigger`` (at least one object): walks the
    entries from ``start`` only as far as the budget reaches."""
    total = 0
    chunk: list[Sized] = []

    def settle(items: list[Sized]) -> int | None:
        nonlocal total
        for (e, _), n in zip(items, sizes_of(store, items), strict=True):
            total += n
            if total > max_bytes and e.sequence > start:
                return e.sequence
        return None

    for item in tree.iter_sized_from(snap.root, start, snap.nodes.load):
        if item[0].sequence >= end:
            break
        chunk.append(item)
        if len(chunk) >= PLAN_THREADS:
            stop = settle(chunk)
            if stop is not None:
                return stop
            chunk = []
    stop = settle(chunk)
    return end if stop is None else stop


def plan_range(
    buf: tieredbuf.Buffer,
    snap: Snapshot,
    start: int,
    end: int,
    ro: opt.ReadOptions,
    ts_from_ms: int | None = None,
    ts_to_ms: int | None = None,
) -> list[ObjectPartition]:
    """Partitions of ``start <= sequence < end`` (``start >= snap.low``)."""
    return object_partitions(buf.store, collect(snap, start, end), ro, ts_from_ms, ts_to_ms)
