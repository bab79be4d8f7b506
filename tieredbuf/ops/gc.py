"""Garbage collection of data objects nothing refers to (RFC 0001 rules).

A data object is deleted only if all hold:

* it is not referenced by the current manifest snapshot;
* its ULID time is older than the oldest referenced object's ULID time (so an
  object uploaded but not yet enqueued is kept) -- skipped when the queue is empty;
* its ULID time is older than the grace period -- the buffer's (root section 6, the
  one every writer reads); an explicit ``grace`` is honoured only when it is longer,
  so GC never uses a shorter grace than writers assume;
* its key matches ``data/<ULID>.batch|.qseg`` (anything else is left alone).

"Referenced" means reachable from the current root: the GC walks the whole
manifest tree (every group, kgroup and mgroup the root links, and every entry in
them, retained history and partly consumed groups included).  Tree nodes
(``queue/groups/...``) are deleted when no path from the root reaches them and
their ULID time is past the grace period: orphans of a lost CAS, and groups that
a dequeue or retention unlinked by CAS (unlink first, delete after: I5).

Subscriber progress objects (``queue/subscribers/<name>.<reg ULID>``) are kept while
the root registers them; an unregistered one (the loser of a registration race, or one
whose removal could not delete it) is deleted past the grace period.  A pass first
refreshes the subscribers' published positions (one lazy root CAS, only if one moved),
so a cron GC moves the head for subscribers whose instances are gone quiet.

Deletes run in bulk; failures are logged and counted and retried next pass.
The decision is the pure function :func:`select_garbage`; :func:`run_once` does I/O.

Groups never change once written (ULID-named, create-if-absent), so a GC that runs
again (:func:`run_forever`, ``tieredbuf gc --loop``) keeps what it read in a
:class:`GroupCache` and a pass reads only the root, the groups linked since the last
pass and the listings (``data/``, ``queue/groups/``, ``queue/subscribers/``).  The
cache holds the groups the last pass reached, no more (I8).  Each report carries the
requests its pass sent (``GcReport.requests``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import GcConfig
from tieredbuf.errors import CorruptError, StoreError
from tieredbuf.format import tree as ft
from tieredbuf.queue import tree
from tieredbuf.queue.nodes import NodeStore, node_key
from tieredbuf.queue.subscribers import ProgressStore, publish
from tieredbuf.runtime.signals import Stop
from tieredbuf.store.counting import diff

log = logging.getLogger(__name__)


@dataclass
class GcReport:
    listed: int = 0
    referenced: int = 0
    candidates: int = 0
    deleted: int = 0
    failed: int = 0
    skipped_foreign: int = 0
    groups_listed: int = 0
    groups_referenced: int = 0
    groups_deleted: int = 0
    progress_listed: int = 0
    progress_deleted: int = 0
    publications: int = 0
    kept_young: int = 0
    kept_newer_than_oldest: int = 0
    grace_ms: int = 0
    """The grace period this pass used."""
    grace_override_ignored: bool = False
    """An explicit grace shorter than the buffer's was asked for (the buffer's was used)."""
    dry_run: bool = False
    groups_read: int = 0
    """Tree nodes this pass fetched from the store (the rest came from its GroupCache)."""
    groups_cached: int = 0
    """Tree nodes this pass took from its GroupCache (read by an earlier pass)."""
    requests: dict[str, int] = field(default_factory=dict)
    """Store requests sent during the pass, ``{"op/kind": n}`` (tieredbuf/store/counting.py):
    the buffer's meter before and after, so exact when nothing else in the process uses
    the same Buffer meanwhile (as in ``tieredbuf gc``)."""
    deleted_keys: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def select_garbage(
    listed: Iterable[str],
    referenced: set[str],
    oldest_referenced_ms: int | None,
    now_ms: int,
    grace: timedelta,
    report: GcReport,
) -> list[str]:
    """The keys among ``listed`` that the RFC's rules allow deleting."""
    grace_ms = int(grace.total_seconds() * 1000)
    out: list[str] = []
    for key in listed:
        report.listed += 1
        ulid = keys.parse_data_key(key)
        if ulid is None:
            report.skipped_foreign += 1
            continue
        if key in referenced:
            report.referenced += 1
            continue
        ts = ulid.milliseconds
        if oldest_referenced_ms is not None and ts >= oldest_referenced_ms:
            report.kept_newer_than_oldest += 1
            continue
        if now_ms - ts <= grace_ms:
            report.kept_young += 1
            continue
        out.append(key)
    report.candidates = len(out)
    return out


def _unnamed_past_grace(
    listed: Iterable[str],
    parse: Callable[[str], tuple[Any, ...] | None],
    named: set[str],
    now_ms: int,
    grace: timedelta,
    report: GcReport,
) -> tuple[list[str], int, int]:
    """The keys among ``listed`` that ``parse`` accepts (its second field is the key's
    ULID), ``named`` does not hold, and whose ULID is past the grace period; with how
    many were listed and how many named."""
    grace_ms = int(grace.total_seconds() * 1000)
    out: list[str] = []
    n_listed = n_named = 0
    for key in listed:
        n_listed += 1
        parsed = parse(key)
        if parsed is None:
            report.skipped_foreign += 1
            continue
        if key in named:
            n_named += 1
            continue
        if now_ms - parsed[1].milliseconds <= grace_ms:
            report.kept_young += 1
            continue
        out.append(key)
    return out, n_listed, n_named


def select_group_garbage(
    listed: Iterable[str],
    referenced: set[str],
    now_ms: int,
    grace: timedelta,
    report: GcReport,
) -> list[str]:
    """Tree node keys nothing reachable from the root refers to, older than the grace period."""
    out, n_listed, n_referenced = _unnamed_past_grace(
        listed, keys.parse_group_key, referenced, now_ms, grace, report
    )
    report.groups_listed += n_listed
    report.groups_referenced += n_referenced
    return out


def select_progress_garbage(
    listed: Iterable[str],
    registered: set[str],
    now_ms: int,
    grace: timedelta,
    report: GcReport,
) -> list[str]:
    """Progress objects no registration in the root names, older than the grace period
    (by their registration ULID: registration lands within the link deadline, < grace)."""
    out, n_listed, _ = _unnamed_past_grace(
        listed, keys.parse_progress_key, registered, now_ms, grace, report
    )
    report.progress_listed += n_listed
    return out


class GroupCache:
    """Decoded tree nodes a GC read, kept across passes (nodes are immutable).

    Keyed by the node's object key (its first sequence, ULID and kind: a key is never
    written twice).  After each pass it keeps only the nodes that pass reached, so
    it is as large as the linked tree and no larger.  Not thread-safe: one per GC loop.
    """

    def __init__(self) -> None:
        self.nodes: dict[str, ft.Node] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def retain(self, keep: set[str]) -> None:
        """Forget every node not in ``keep`` (unlinked by a dequeue or retention)."""
        self.nodes = {k: n for k, n in self.nodes.items() if k in keep}


def reachable(
    buf: Any, snap: Any = None, *, cache: GroupCache | None = None, report: GcReport | None = None
) -> tuple[list[str], set[str]]:
    """(data locations of every linked entry in order, keys of every linked tree node and
    registered progress object).

    Each node is fetched at most once.  With a ``cache``, nodes it holds are not
    fetched at all, fetched ones are added, and afterwards it keeps only the nodes
    reached here.
    """
    snap = buf.snapshot() if snap is None else snap
    nodes = NodeStore(buf.store, cache_nodes=4)
    seen: set[str] = set()
    cache = GroupCache() if cache is None else cache  # a walk reads each node once
    known = cache.nodes

    def load(ref: ft.Ref) -> ft.Node:
        key = node_key(ref)
        seen.add(key)
        node = known.get(key)
        if node is not None:
            if node.level != ref.level or node.first != ref.first or node.last != ref.last:
                raise CorruptError(ft.WHAT_NODE, key, 0, "node does not match its reference")
            return node
        node = nodes.load(ref)
        if report is not None:
            report.groups_read += 1
        known[key] = node
        return node

    locations = [e.location for e in tree.iter_from(snap.root, snap.root.linked_first, load)]
    _walk_refs(snap.root.refs, load)
    cache.retain(seen)
    if report is not None:
        report.groups_cached = len(seen) - report.groups_read
    for reg in snap.root.registry.values():
        if not reg.is_default:
            seen.add(keys.progress_key(reg.name, ULID.from_bytes(reg.reg_id)))
    return locations, seen


def effective_grace(
    root_ms: int | None, asked: timedelta | None, cfg: GcConfig, report: GcReport
) -> timedelta:
    """The grace period a pass uses: the root's, or a longer explicit one (see run_once)."""
    if root_ms is None:
        grace = cfg.gc_grace_period if asked is None else asked
    else:
        grace = timedelta(milliseconds=root_ms)
        if asked is not None and asked > grace:
            grace = asked
        elif asked is not None and asked < grace:
            report.grace_override_ignored = True
            log.warning(
                "gc: grace %s is shorter than the buffer's %s; using the buffer's "
                "(Buffer.set_gc_grace_period changes it)",
                asked,
                grace,
            )
    report.grace_ms = grace // timedelta(milliseconds=1)
    return grace


def _walk_refs(refs: tuple[ft.Ref, ...] | list[ft.Ref], load: Any) -> None:
    for r in refs:
        node = load(r)
        if node.level:
            _walk_refs(node.refs, load)


def _delete(buf: Any, garbage: list[str], cfg: GcConfig, report: GcReport) -> list[str]:
    done: list[str] = []
    for i in range(0, len(garbage), cfg.delete_batch):
        chunk = garbage[i : i + cfg.delete_batch]
        try:
            failures = buf.store.delete_many(chunk)
        except StoreError as e:
            failures = [(k, e) for k in chunk]
        failed = {k for k, _ in failures}
        for k, err in failures:
            log.warning("gc: delete of %s failed (retried next pass): %s", k, err)
        report.failed += len(failed)
        done.extend(k for k in chunk if k not in failed)
    return done


def run_once(
    buf: Any,
    *,
    grace: timedelta | None = None,
    dry_run: bool = False,
    config: GcConfig | None = None,
    now_ms: int | None = None,
    cache: GroupCache | None = None,
) -> GcReport:
    """One GC pass over ``buf`` (a :class:`tieredbuf.Buffer`).

    ``cache``: the groups earlier passes read (see :class:`GroupCache`); a pass reads
    only the groups it does not hold.

    The grace period is the buffer's (its root's section 6, which writers read too).
    ``grace`` overrides it only when longer: a shorter one is ignored (logged, and
    ``report.grace_override_ignored``), since writers re-upload only objects older
    than half the *buffer's* grace and a shorter GC grace could delete an object a
    writer is about to enqueue.  To shorten it, set the buffer's
    (``Buffer.set_gc_grace_period``).  A root without the section (written only by an
    older tieredbuf) uses ``grace``, else ``config.gc_grace_period``, as before.
    """
    cfg = config or GcConfig()
    report = GcReport(dry_run=dry_run)
    counts = getattr(buf.store, "counts", None)
    before = counts.snapshot() if counts is not None else None
    try:
        _pass(buf, grace, dry_run, cfg, now_ms, cache, report)
    finally:
        if counts is not None and before is not None:
            report.requests = {
                f"{op}/{kind}": n
                for (op, kind), n in sorted(diff(counts.snapshot(), before).items())
            }
    return report


def _pass(
    buf: Any,
    grace: timedelta | None,
    dry_run: bool,
    cfg: GcConfig,
    now_ms: int | None,
    cache: GroupCache | None,
    report: GcReport,
) -> None:
    queue = getattr(buf, "queue", None)
    if not dry_run and queue is not None:
        published = queue.stats.get("publications")
        publish(queue, ProgressStore(queue))
        report.publications = queue.stats.get("publications") - published
    # Snapshot (and walk) first, list second: an object enqueued after the snapshot
    # was uploaded before it, and is protected by the oldest-entry and grace rules; a
    # group linked after it is younger than the writers' link deadline (< grace).
    snap = buf.snapshot()
    grace = effective_grace(snap.gc_grace_ms, grace, cfg, report)
    locations, linked_nodes = reachable(buf, snap, cache=cache, report=report)
    referenced = set(locations)
    oldest: int | None = None
    for loc in locations[:1]:
        u = keys.parse_data_key(loc)
        oldest = u.milliseconds if u is not None else None
    if locations and oldest is None:
        oldest = 0  # the oldest entry is not ULID-named: keep everything unreferenced but old
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    listed = (m.key for m in buf.store.list(keys.DATA_PREFIX))
    garbage = select_garbage(listed, referenced, oldest, now, grace, report)
    groups = (m.key for m in buf.store.list(keys.GROUPS_PREFIX))
    group_garbage = select_group_garbage(groups, linked_nodes, now, grace, report)
    progress = (m.key for m in buf.store.list(keys.SUBSCRIBERS_PREFIX))
    progress_garbage = select_progress_garbage(progress, linked_nodes, now, grace, report)
    if dry_run:
        report.deleted_keys = garbage + group_garbage + progress_garbage
        return
    deleted = _delete(buf, garbage, cfg, report)
    report.deleted += len(deleted)
    report.deleted_keys.extend(deleted)
    gdeleted = _delete(buf, group_garbage, cfg, report)
    report.groups_deleted += len(gdeleted)
    report.deleted_keys.extend(gdeleted)
    pdeleted = _delete(buf, progress_garbage, cfg, report)
    report.progress_deleted += len(pdeleted)
    report.deleted_keys.extend(pdeleted)


def run_forever(
    buf: Any,
    *,
    interval: timedelta | None = None,
    stop: Stop | None = None,
    on_report: Callable[[GcReport, float], None] | None = None,
    grace: timedelta | None = None,
    dry_run: bool = False,
    config: GcConfig | None = None,
) -> None:
    """GC passes every ``interval`` (``config.gc_interval``, 5 min) until ``stop`` is set.

    One :class:`GroupCache` lives across the passes, so after the first a pass reads
    only the root, the new groups and the listings.  ``on_report(report, seconds)``
    is called after each pass.  A pass that fails with a store error is logged and
    retried at the next interval (its cache is kept: what it holds is still true);
    any other error propagates.
    """
    cfg = config or GcConfig()
    wait = (cfg.gc_interval if interval is None else interval).total_seconds()
    if stop is None:
        stop = threading.Event()
    cache = GroupCache()
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            report = run_once(buf, grace=grace, dry_run=dry_run, config=cfg, cache=cache)
        except StoreError as e:
            log.warning("gc: pass failed (retried in %ss): %s", wait, e)
        else:
            if on_report is not None:
                on_report(report, time.monotonic() - t0)
        stop.wait(wait)
