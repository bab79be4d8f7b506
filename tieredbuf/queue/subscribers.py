"""Named subscribers on the object store: progress objects and the root's registry.

* A named subscriber's state is its progress object
  ``queue/subscribers/<name>.<reg ULID>`` (:mod:`tieredbuf.format.progress`), created
  create-if-absent *before* the root CAS that registers ``(name, reg_id)`` and
  CAS-written afterwards by that subscriber only.
* The root's registry (section 7) records each subscriber's ``published_next``; the
  head is the slowest of them.  :func:`publish` copies the subscribers' positions from
  their progress objects into the root (one CAS, no fencing: it only copies what their
  own fenced writes recorded); :func:`remove` drops a registration (its hold on the head
  goes with it) and then deletes the progress object.

Every root change goes through :meth:`ManifestQueue.update`, which re-reads and decides
again after any failed write, so a retry recognises its own landed write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ulid import ULID

from tieredbuf import keys
from tieredbuf.errors import (
    AlreadyExistsError,
    BufferNotFoundError,
    ObjectNotFoundError,
    PermanentStoreError,
    StoreError,
)
from tieredbuf.format import progress as fp
from tieredbuf.format import registry as freg
from tieredbuf.format import tree as ft
from tieredbuf.queue import shared, tree
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot, require_room
from tieredbuf.runtime.retry import backoff_delay
from tieredbuf.store.base import IfMatch

_PARALLEL_READS = 8


def progress_key(name: str, reg_id: bytes) -> str:
    return keys.progress_key(name, ULID.from_bytes(reg_id))


class ProgressStore:
    """GET / create / CAS of progress objects; transient read errors are retried."""

    def __init__(self, queue: ManifestQueue, max_attempts: int = 8) -> None:
        self.queue = queue
        self.store = queue.store
        self.max_attempts = max_attempts

    def get(self, name: str, reg_id: bytes) -> tuple[fp.Progress, str] | None:
        """(progress, etag), or None when the object does not exist."""
        key = progress_key(name, reg_id)
        attempt = 0
        while True:
            try:
                got = self.store.get(key)
                break
            except ObjectNotFoundError:
                return None
            except PermanentStoreError:
                raise  # credentials, access, bucket: retrying cannot help
            except StoreError:
                attempt += 1
                self.queue.stats.incr("progress_read_retries")
                if attempt >= self.max_attempts:
                    raise
                self.queue.sleep(backoff_delay(self.queue.retry, attempt - 1))
        self.queue.stats.incr("progress_reads")
        return fp.decode(got.data, obj=key), got.etag

    def create(self, p: fp.Progress) -> None:
        """Create-if-absent; AlreadyExists means our own earlier attempt landed (the key holds
        a fresh registration ULID: 80 random bits)."""
        with contextlib.suppress(AlreadyExistsError):
            self.store.put(progress_key(p.name, p.reg_id), fp.encode(p), mode="create")
        self.queue.stats.incr("progress_writes")

    def cas_bytes(self, name: str, reg_id: bytes, data: bytes, etag: str) -> str:
        """Replace-if-match of an encoded progress object; store errors propagate (the CAS
        primitive re-reads and decides)."""
        new = self.store.put(progress_key(name, reg_id), data, mode=IfMatch(etag))
        self.queue.stats.incr("progress_writes")
        return new

    def delete(self, name: str, reg_id: bytes) -> None:
        failures = self.store.delete_many([progress_key(name, reg_id)])
        if failures:
            raise failures[0][1]

    def get_many(self, regs: Iterable[freg.Registration]) -> dict[str, fp.Progress]:
        """The progress of each named registration that has one (in parallel when many)."""
        named = [r for r in regs if not r.is_default]

        def one(r: freg.Registration) -> tuple[str, fp.Progress | None]:
            got = self.get(r.name, r.reg_id)
            return r.name, None if got is None else got[0]

        if len(named) <= 2:
            pairs = [one(r) for r in named]
        else:
            with ThreadPoolExecutor(min(_PARALLEL_READS, len(named))) as pool:
                pairs = list(pool.map(one, named))
        return {n: p for n, p in pairs if p is not None}


# --- root changes -------------------------------------------------------------------


class Retry(Exception):
    """A registration attempt must be re-planned from a fresh read (see :func:`register`)."""


def register(
    queue: ManifestQueue, reg: freg.Registration, check: Callable[[Snapshot], None] | None = None
) -> freg.Registration:
    """Add ``reg`` to the registry (one CAS); returns the registration that holds the name
    afterwards -- ours, or the one that won a race (then ours is an orphan for GC).
    ``check`` runs on every fresh read before the write and may raise :class:`Retry`."""
    winner: list[freg.Registration] = []

    def change(snap: Snapshot, draft: tree.Root) -> bool:
        if not snap.exists:
            raise BufferNotFoundError(queue.store.url)
        cur = draft.registry.get(reg.name)
        if cur is not None:
            winner.append(cur)
            return False
        require_room(draft)
        if check is not None:
            check(snap)
        draft.registry[reg.name] = reg
        return True

    if queue.update(change, "registrations"):
        return reg
    return winner[-1]


def set_published(queue: ManifestQueue, name: str, reg_id: bytes, position: int) -> bool:
    """Republish a subscriber's position lower than published (a resume point before it):
    the head comes back with it, never below the first retained sequence."""

    def change(snap: Snapshot, draft: tree.Root) -> bool:
        cur = draft.registry.get(name)
        if cur is None or cur.reg_id != reg_id or cur.published_next <= position:
            return False
        draft.registry[name] = dataclasses.replace(cur, published_next=position)
        return True

    return queue.update(change, "republications")


def publish(queue: ManifestQueue, progress: ProgressStore) -> int:
    """One lazy root CAS: every named subscriber's ``published_next`` becomes the larger of
    what is published and what its progress object says (same registration only); the
    head follows.  No fencing is needed: it copies what each subscriber's own fenced
    writes recorded.  The progress objects are read *after* each root read, so a
    subscriber that lowered its position (progress first, then the root) is never raised
    again by a stale copy.  Returns the head as this publication left it."""
    head: list[int] = []

    def change(snap: Snapshot, draft: tree.Root) -> bool:
        behind = [
            r
            for r in draft.registry.values()
            if not r.is_default and r.published_next < draft.next_seq
        ]
        moved = False
        for name, p in progress.get_many(behind).items():
            cur = draft.registry[name]
            needed = fp.needed(p)  # its position, or a dead letter kept for redrive
            if p.reg_id == cur.reg_id and needed > cur.published_next:
                draft.registry[name] = dataclasses.replace(
                    cur, published_next=min(needed, draft.next_seq)
                )
                moved = True
        head.append(freg.head_of(draft.registry, draft.low, draft.next_seq, draft.head))
        return moved

    queue.update(change, "publications")
    return head[-1]


def remove(queue: ManifestQueue, name: str) -> bool:
    """Unregister ``name`` (its hold on the head goes at once), then delete its progress
    object; a live instance then fails with SubscriberRemovedError.  Removing "default"
    also bumps the epoch, fencing a live default consumer.  False if it was not registered."""
    gone: list[freg.Registration] = []

    def change(snap: Snapshot, draft: tree.Root) -> bool:
        cur = draft.registry.get(name)
        if cur is None:
            return False
        gone.append(cur)
        if cur.is_default:
            draft.epoch += 1
            draft.owner = f"removed/{ULID()}"
        del draft.registry[name]
        return True

    queue.update(change, "removals")
    if not gone:
        return False
    reg = gone[-1]
    if not reg.is_default:
        ProgressStore(queue).delete(name, reg.reg_id)
    return True


# --- listing ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubscriberInfo:
    """One subscriber as ``buf.subscribers()`` reports it."""

    name: str
    shared: bool
    next_sequence: int
    """The first sequence it still needs (its position)."""
    published_next: int
    """Its position as last published into the root (what holds the head)."""
    lag_entries: int
    lag_bytes: int
    lag_seconds: float | None
    """Age of the entry at its position (None when caught up, or that entry is gone)."""
    epoch: int
    last_activity_ms: int | None
    """Its last progress write (None for "default": its state is the root's)."""
    lost: int
    lost_now: int
    """Sequences it needs that retention already unlinked (it gets DataLossError)."""
    registration: str
    work: dict[str, int] | None = None
    """Shared work queues: claim cursor, live leases, workers, rejected_total, ..."""
    rejected: tuple[fp.Rejected, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rejected"] = [
            {
                "sequence": r.seq,
                "time_ms": r.time_ms,
                "deliveries": r.deliveries,
                "reason": r.reason.decode("utf-8", "backslashreplace"),
                "kept": bool(r.flags & fp.KEPT),
            }
            for r in self.rejected
        ]
        return d


def listing(
    queue: ManifestQueue, now_ms: int | None = None, snap: Snapshot | None = None
) -> list[SubscriberInfo]:
    """Every registered subscriber with its position, lag (entries, bytes, age), epoch and
    last activity: one root read (none when given ``snap``), one GET per named subscriber,
    one per tree level each."""
    snap = queue.read() if snap is None else snap
    if not snap.exists:
        raise BufferNotFoundError(queue.store.url)
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    root = snap.root
    progress = ProgressStore(queue).get_many(root.registry.values())
    out = []
    for name in sorted(root.registry):
        reg = root.registry[name]
        p = progress.get(name)
        pos = reg.published_next if p is None else p.position
        start = max(pos, snap.low)
        first = tree.find_sequence(root, start, snap.nodes.load) if start < root.next_seq else None
        times = [m.ingestion_time_ms for m in first.metadata] if first is not None else []
        out.append(
            SubscriberInfo(
                name=name,
                shared=reg.shared,
                next_sequence=pos,
                published_next=reg.published_next,
                lag_entries=max(0, root.next_seq - pos),
                lag_bytes=bytes_from(root, start, snap.nodes.load),
                lag_seconds=None if not times else max(0.0, (now - min(times)) / 1000),
                epoch=root.epoch if reg.is_default else (0 if p is None else p.epoch),
                last_activity_ms=None if p is None else p.updated_ms,
                lost=0 if p is None else p.lost,
                lost_now=max(0, snap.low - pos),
                registration="" if reg.is_default else str(ULID.from_bytes(reg.reg_id)),
                work=shared.summary(p, now) if p is not None and p.shared else None,
                rejected=() if p is None else p.rejected,
            )
        )
    return out


def bytes_from(root: tree.Root, seq: int, load: tree.Load) -> int:
    """Bytes of the linked data objects from sequence ``seq`` on (a subscriber's lag in
    bytes): the root's total minus what lies before ``seq``; one node GET per level."""
    seq = max(seq, root.linked_first)
    if seq >= root.next_seq:
        return 0
    before = 0
    if seq >= root.entries_first:
        before = root.refs_total_bytes() + sum(
            root.stat_at(j).size for j in range(seq - root.entries_first)
        )
        return root.total_bytes - before
    refs: Sequence[ft.Ref] = root.refs
    while True:
        i = tree.ref_index(refs, seq)
        before += sum(r.total_bytes for r in refs[:i])
        node = load(refs[i])
        if node.level == 0:
            before += sum(s.size for s in node.stats[: seq - node.first])
            return root.total_bytes - before
        refs = node.refs
