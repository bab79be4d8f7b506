"""Scrub a buffer: read every live object the root links and check it (``tieredbuf verify``).

What an operator runs after an incident (a disk replaced under MinIO, a bucket restored,
someone's ``aws s3 cp``), or from cron.  From one root read:

* every tree node the root links (``queue/groups/...``) is read and decoded (its CRC
  and structure: ``CorruptError``), and every registered subscriber's progress object;
* every data object of a readable entry (from the buffer's first readable sequence, or
  ``start``) is read whole through the readers' own check
  (:func:`tieredbuf.consume.fetch.check_object`: the size the manifest recorded, a
  ``.qseg`` object's CRC32) and then decoded in full (a ``.batch``: its records, a zstd
  block against its content checksum; a ``.qseg``: every bundle);
* ``data/`` and ``queue/groups/`` are listed: an object nothing links whose ULID time is
  older than the buffer's GC grace period is reported as unreferenced (an orphan GC has
  not removed yet, or an upload that was never enqueued and never will be: a writer
  re-uploads what is older than half the grace period before enqueueing it).

Each finding is ``missing`` (linked, not in the store), ``damaged`` (in the store, failing
a check) or ``unreferenced``.  Nothing is written.  Cost: one GET per data object and per
linked tree node, one for the root and each progress object, one LIST per 1,000 keys of
``data/`` and ``queue/groups/`` (docs/operations.md gives it per GiB).  Data objects are
checked on ``threads`` threads, holding at most ``max_bytes`` of them (by recorded
size; one object at a time when it is larger).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import GcConfig
from tieredbuf.consume.fetch import fetch_object
from tieredbuf.errors import CorruptError, MissingObjectError, ObjectNotFoundError
from tieredbuf.format import tree as ft
from tieredbuf.format.batch import decode_batch
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.queue import tree
from tieredbuf.queue.nodes import NodeStore, node_key
from tieredbuf.queue.subscribers import ProgressStore
from tieredbuf.store.counting import diff

Problem = Literal["missing", "damaged", "unreferenced"]

THREADS = 8
MAX_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class Finding:
    """One object that is not as the buffer needs it."""

    problem: Problem
    kind: str
    """``data``, ``group`` or ``subscriber`` (:func:`tieredbuf.keys.key_kind`)."""
    key: str
    sequence: int | None = None
    """A data object's entry; a group's first sequence."""
    detail: str = ""


@dataclass
class VerifyReport:
    entries: int = 0
    """Data objects read and checked."""
    bytes: int = 0
    """Their bytes."""
    unsized: int = 0
    """Of those, entries the manifest recorded no size for (an RFC 0001 writer's):
    checked by decoding only."""
    groups: int = 0
    """Tree nodes read."""
    subscribers: int = 0
    """Progress objects read."""
    listed: int = 0
    """Keys listed under ``data/`` and ``queue/groups/``."""
    first: int = 0
    next: int = 0
    """The data objects of sequences ``first .. next - 1`` were checked."""
    grace_ms: int = 0
    seconds: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=dict)
    """Store requests sent, ``{"op/kind": n}`` (tieredbuf/store/counting.py)."""

    def of(self, problem: Problem) -> list[Finding]:
        return [f for f in self.findings if f.problem == problem]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["missing"] = len(self.of("missing"))
        d["damaged"] = len(self.of("damaged"))
        d["unreferenced"] = len(self.of("unreferenced"))
        return d


def check_data(store: Any, entry: ManifestEntry, size: int) -> tuple[int, Finding | None]:
    """Read ``entry``'s data object and check it through and through: (bytes read, the
    finding or None)."""
    loc = entry.location
    try:
        data = fetch_object(store, entry, size)
        if loc.endswith(keys.SEGMENT_SUFFIX):
            from tieredbuf.format.segment import SegmentReader

            SegmentReader(data, loc).bundles()
        else:
            decode_batch(data, obj=loc)
    except MissingObjectError:
        return 0, Finding("missing", keys.KIND_DATA, loc, entry.sequence)
    except CorruptError as e:
        return 0, Finding("damaged", keys.KIND_DATA, loc, entry.sequence, str(e))
    return len(data), None


def _unread(r: ft.Ref) -> str:
    return (
        f"sequences {r.first}..{r.last} are under it: their data objects are not checked "
        "(and may be listed as unreferenced)"
    )


def _linked(
    root: tree.Root, load: Callable[[ft.Ref], ft.Node], bad: Callable[[ft.Ref, Finding], None]
) -> Iterator[tuple[ManifestEntry, int]]:
    """Every linked entry and its recorded size, oldest first; a node that is missing or
    does not decode is reported to ``bad`` and its entries skipped."""

    def walk(refs: tuple[ft.Ref, ...] | list[ft.Ref]) -> Iterator[tuple[ManifestEntry, int]]:
        for r in refs:
            key = node_key(r)
            try:
                node = load(r)
            except ObjectNotFoundError:
                bad(r, Finding("missing", keys.KIND_GROUP, key, r.first, _unread(r)))
                continue
            except CorruptError as e:
                bad(r, Finding("damaged", keys.KIND_GROUP, key, r.first, f"{e}; {_unread(r)}"))
                continue
            if node.level:
                yield from walk(node.refs)
                continue
            assert node.entries is not None
            stats = node.stats
            for entry in tree.iter_view_from(node.entries, node.first):
                i = entry.sequence - node.first
                yield entry, stats[i].size if i < len(stats) else 0

    yield from walk(root.refs)
    first, n = root.entries_first, root.n_entries
    for e in tree.iter_view_from(root.entries_view(), first):
        i = e.sequence - first
        yield e, root.stat_at(i).size if i < n else 0


def unreferenced(
    listed: Iterator[str], linked: set[str], now_ms: int, grace_ms: int
) -> Iterator[Finding]:
    """Data objects and tree nodes among ``listed`` that nothing links, older than the
    grace period by their ULID time (keys tieredbuf does not write are left alone)."""
    for key in listed:
        if key in linked:
            continue
        u: ULID | None
        kind = keys.key_kind(key)
        if kind == keys.KIND_DATA:
            u = keys.parse_data_key(key)
        else:
            g = keys.parse_group_key(key)
            u = None if g is None else g[1]
        if u is not None and now_ms - u.milliseconds > grace_ms:
            age = timedelta(seconds=(now_ms - u.milliseconds) // 1000)
            when = datetime.fromtimestamp(u.milliseconds / 1000, UTC).isoformat(timespec="seconds")
            yield Finding(
                "unreferenced",
                kind,
                key,
                detail=f"written {when} ({age} ago), nothing links it, past the grace period",
            )


def verify(
    buf: Any,
    *,
    start: int | None = None,
    threads: int = THREADS,
    max_bytes: int = MAX_BYTES,
    now_ms: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check the buffer ``buf`` (a :class:`tieredbuf.Buffer`); see the module docstring.

    ``start``: check data objects from this sequence on (default: the first readable
    one); every linked node is read and the listings are complete whatever ``start``.
    ``on_progress(done, total)`` is called as data objects are checked."""
    t0 = time.monotonic()
    report = VerifyReport()
    counts = getattr(buf.store, "counts", None)
    before = counts.snapshot() if counts is not None else None
    snap = buf.snapshot()
    root = snap.root
    report.first = max(snap.low, start or 0)
    report.next = root.next_seq
    grace = snap.gc_grace_ms
    report.grace_ms = (
        int(GcConfig().gc_grace_period / timedelta(milliseconds=1)) if grace is None else grace
    )
    nodes = NodeStore(buf.store, cache_nodes=4)
    linked: set[str] = set()

    def load(r: ft.Ref) -> ft.Node:
        linked.add(node_key(r))
        node = nodes.load(r)
        report.groups += 1
        return node

    def bad(r: ft.Ref, f: Finding) -> None:
        report.findings.append(f)

    total = max(0, report.next - report.first)
    done = 0
    inflight: dict[Future[tuple[int, Finding | None]], int] = {}
    held = 0

    def settle() -> None:
        """Take in the checks that are done (waiting for the first one)."""
        nonlocal held, done
        ready, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
        for f in ready:
            held -= inflight.pop(f)
            n, finding = f.result()
            report.bytes += n
            if finding is not None:
                report.findings.append(finding)
            done += 1
            if on_progress is not None:
                on_progress(done, total)

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="tb-verify") as pool:
        for entry, size in _linked(root, load, bad):
            linked.add(entry.location)
            if entry.sequence < report.first:
                continue
            report.entries += 1
            report.unsized += size == 0
            while inflight and (held + size > max_bytes or len(inflight) >= 2 * threads):
                settle()
            inflight[pool.submit(check_data, buf.store, entry, size)] = size
            held += size
        while inflight:
            settle()
    progress = ProgressStore(buf.queue)
    for reg in root.registry.values():
        if reg.is_default:
            continue
        key = keys.progress_key(reg.name, ULID.from_bytes(reg.reg_id))
        linked.add(key)
        report.subscribers += 1
        try:
            if progress.get(reg.name, reg.reg_id) is None:
                report.findings.append(Finding("missing", keys.KIND_SUBSCRIBER, key))
        except CorruptError as e:
            report.findings.append(Finding("damaged", keys.KIND_SUBSCRIBER, key, detail=str(e)))
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms

    def listing() -> Iterator[str]:
        for prefix in (keys.DATA_PREFIX, keys.GROUPS_PREFIX):
            for m in buf.store.list(prefix):
                report.listed += 1
                yield m.key

    report.findings += unreferenced(listing(), linked, now, report.grace_ms)
    report.findings.sort(
        key=lambda f: (f.problem == "unreferenced", -1 if f.sequence is None else f.sequence)
    )
    report.seconds = time.monotonic() - t0
    if counts is not None and before is not None:
        report.requests = {
            f"{op}/{kind}": n for (op, kind), n in sorted(diff(counts.snapshot(), before).items())
        }
    return report
