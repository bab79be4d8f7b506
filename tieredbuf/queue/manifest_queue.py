"""The queue manifest as a CAS-written queue (RFC 0001), with exactly-once append.

Every write is a conditional PUT of the whole root: If-None-Match: * when the
manifest does not exist yet, If-Match: <etag> otherwise.  After *any* failed
write (conflict or unknown outcome) the queue re-reads the manifest and decides
from what it finds, never from the error alone (I2):

* append: the producer's watermark says whether its append already landed;
* initialize: the epoch owner says whether our epoch bump already landed;
* dequeue: the default subscriber's published position says whether it already landed.

The head is the slowest registered subscriber's published position (section 7,
:mod:`tieredbuf.format.registry`); every write recomputes it.  Registry changes by
named subscribers (register, remove, publish) go through :meth:`ManifestQueue.update`
(:mod:`tieredbuf.queue.subscribers`).

The root is the top of an M-way tree (:mod:`tieredbuf.queue.tree`): whoever
writes it also rebalances (oldest ``m`` of an over-full level into a new
immutable group object, PUT create-if-absent under a fresh ULID key *before*
the root CAS) and applies retention / unlinks consumed groups.  A lost CAS
leaves those group objects as orphans for GC; the retry re-plans from a fresh
read.  The root stays bounded (I6).

Retention is the root's (section 5), never a writer's own: every writer applies
the policy stored in the root it read.  :meth:`ManifestQueue.set_retention`
changes it by CAS; a writer whose ``TreeConfig`` sets retention seeds the root's
policy in its first write *only when the root has never had one*; a root policy
that disagrees with a writer's config wins (the writer logs it and counts
``retention_config_ignored``).

So is the buffer section (6: buffer id, creation time, GC grace period): the first
write that finds it missing adds it (a fresh ULID, the default grace period), every
later write keeps it as found, and only :meth:`ManifestQueue.set_gc_grace_period`
changes the grace period.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

from ulid import ULID

from tieredbuf.config import DEFAULT_GC_GRACE_PERIOD, RetryConfig, TreeConfig
from tieredbuf.errors import (
    BufferNotFoundError,
    ConfigError,
    FencedError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    ProducerIdReusedError,
)
from tieredbuf.format import manifest as fm
from tieredbuf.format import registry as freg
from tieredbuf.keys import MANIFEST_KEY
from tieredbuf.queue import cas, tree
from tieredbuf.queue.nodes import NodeStore
from tieredbuf.queue.snapshot import Snapshot as Snapshot  # re-exported
from tieredbuf.runtime.retry import RetryLog
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import IfMatch, PutMode, Store

log = logging.getLogger(__name__)

D = TypeVar("D")
R = TypeVar("R")

WATERMARK_CAP = 16384
"""At most this many producer watermarks are kept (most recently active first)."""


class ManifestQueue:
    """CAS operations on ``queue/manifest``; safe to share between threads."""

    def __init__(
        self,
        store: Store,
        *,
        key: str = MANIFEST_KEY,
        retry: RetryConfig | None = None,
        watermark_ttl_ms: int = 86_400_000,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        sleep: Callable[[float], None] = time.sleep,
        max_transient_retries: int | None = None,
        tree_config: TreeConfig | None = None,
        nodes: NodeStore | None = None,
    ) -> None:
        self.store = store
        self.key = key
        self.retry = retry or RetryConfig()
        self.watermark_ttl_ms = watermark_ttl_ms
        self.clock_ms = clock_ms
        self.sleep = sleep
        self.max_transient_retries = max_transient_retries
        self.stats = Stats()
        self.retry_log = RetryLog(log)
        """Store failures of this queue's retries, logged at most once per interval."""
        self.tree = tree_config or TreeConfig()
        self._config_retention = retention_of(self.tree)
        self._warned_retention: fm.RetentionPolicy | None = None
        self.nodes = nodes or NodeStore(
            store, retry=self.retry, clock_ms=clock_ms, sleep=sleep, stats=self.stats
        )
        self._latest: tuple[bytes, str] | None = None  # the root last read or written

    # --- reads -------------------------------------------------------------

    def read(self) -> Snapshot:
        """Read and decode the root (an absent manifest reads as empty)."""
        snap = self.read_if_changed(None)
        assert snap is not None
        return snap

    def read_if_changed(self, etag: str | None) -> Snapshot | None:
        """The root, or None while it is still at ``etag``: a conditional GET (a 304 without a
        body while unchanged)."""
        try:
            got = self.store.get_if_changed(self.key, etag) if etag else self.store.get(self.key)
        except ObjectNotFoundError:
            view = fm.empty_manifest()
            return Snapshot(view, None, tree.decode_root(view), self.nodes)
        if got is None:
            return None
        self.stats.incr("manifest_reads")
        self.stats.incr("manifest_bytes_read", len(got.data))
        view = fm.open_manifest(got.data, obj=self.key)
        self._latest = (got.data, got.etag)
        return Snapshot(view, got.etag, tree.decode_root(view, self.clock_ms()), self.nodes)

    @property
    def knows_root(self) -> bool:
        """True once this queue has read or written the root (see ``optimistic``)."""
        return self._latest is not None

    def latest_snapshot(self) -> Snapshot:
        """The root as this queue last read or wrote it, without a request (maybe stale)."""
        assert self._latest is not None
        view = fm.open_manifest(self._latest[0], obj=self.key)
        return Snapshot(view, self._latest[1], tree.decode_root(view, self.clock_ms()), self.nodes)

    def read_footer(self) -> fm.Footer:
        """Only the raw 22-byte root footer: one small ranged GET.

        Its epoch and next_sequence are the queue's; its entry_count counts the
        entries held in the root itself (use :meth:`read` for the queue's head).
        """
        try:
            tail = self.store.get_suffix(self.key, fm.FOOTER_SIZE)
        except ObjectNotFoundError:
            return fm.empty_manifest().footer
        return fm.parse_footer(tail, obj=self.key)

    def check_epoch(self, epoch: int) -> fm.Footer:
        """Raise FencedError unless the manifest is still at ``epoch``."""
        footer = self.read_footer()
        if footer.epoch != epoch:
            raise FencedError(epoch, footer.epoch)
        return footer

    # --- the CAS primitive over the root -----------------------------------------

    def remember(self, data: bytes, etag: str) -> None:
        """The root this queue just wrote (an optimistic append CASes against it next)."""
        self._latest = (data, etag)

    def run_cas(
        self,
        decide: Callable[[cas.Read[Snapshot], int], cas.Write[D] | cas.Skip[R]],
        done: Callable[[D, str], R],
        *,
        landed: Callable[[cas.Read[Snapshot], Sequence[D]], R | None] | None = None,
        first: cas.Read[Snapshot] | None = None,
    ) -> R:
        """One CAS loop over the root (:func:`tieredbuf.queue.cas.run`); ``first``: a root
        to decide the first attempt from without reading it."""
        return cas.run(
            _Root(self),
            decide,
            done,
            retries=self.cas_retries(),
            stats=self.stats,
            landed=landed,
            first=first,
            what="manifest operation",
        )

    def cas_retries(self) -> cas.Retries:
        """How this queue's CAS loops back off (its progress objects' too), log their store
        failures, and give up (``retry.give_up_after``, in a direct call)."""
        return cas.Retries(self.retry, self.sleep, self.max_transient_retries, self.retry_log)

    def build(self, draft: tree.Root, now_ms: int) -> Callable[[], bytes]:
        """The bytes of ``draft`` (group PUTs happen here); a build that took longer than
        the tree's link deadline re-plans instead (its new groups might be GC's already)."""

        def build() -> bytes:
            started = self.clock_ms()
            data = self._finish(draft, now_ms)
            if self.clock_ms() - started > self.tree.link_deadline.total_seconds() * 1000:
                raise cas.Replan("late_links")
            return data

        return build

    # --- append --------------------------------------------------------------

    def append(
        self,
        new: Sequence[fm.NewEntry],
        producer_id: str,
        last_producer_seq: int,
        *,
        before_write: Callable[[Snapshot], None] | None = None,
        create: bool = True,
        strict: bool = False,
    ) -> list[int | None]:
        """Append ``new`` exactly once, as one writer's own CAS (the Spark sink; producers
        and exporters commit through the fan-in hub, :mod:`tieredbuf.queue.commit`).
        Returns the sequence given to each entry.

        ``new[i]`` is the producer's append number ``last_producer_seq - len(new) + 1 + i``.
        Entries whose number the manifest's watermark already covers landed earlier (a
        retry after an unknown outcome, or a restart) and are not appended again; their
        sequence is known when the whole group landed together, else ``None``.
        ``before_write`` runs before every write, with the snapshot the write will CAS
        against, and may raise to abort (GC grace race: the snapshot carries the buffer's
        grace period).  ``create=False``: raise BufferNotFoundError instead of creating a
        buffer where none exists.  ``strict=True``: only this very group can have covered
        its numbers -- a watermark that covers some of them without ending exactly at
        ``last_producer_seq``, or that is past it, belongs to another writer using the
        same producer id, and ProducerIdReusedError is raised instead of skipping the
        entries as already appended.
        """
        n = len(new)
        if n == 0:
            return []
        if last_producer_seq - n + 1 < 1:
            raise ValueError("producer sequence numbers start at 1")
        pseqs = range(last_producer_seq - n + 1, last_producer_seq + 1)  # consecutive

        def decide(
            read: cas.Read[Snapshot], attempt: int
        ) -> cas.Write[_Appended] | cas.Skip[list[int | None]]:
            snap = read.state
            if not create and not snap.exists:
                raise BufferNotFoundError(self.store.url)
            view = snap.view
            wm = view.watermarks.get(producer_id)
            done = 0 if wm is None else bisect.bisect_right(pseqs, wm.producer_seq)
            if strict and wm is not None and done and wm.producer_seq != pseqs[-1]:
                raise ProducerIdReusedError(producer_id, wm.producer_seq, pseqs[-1])
            if done == n:  # landed before this call (a restart)
                assert wm is not None
                last = wm.last_sequence - (wm.producer_seq - last_producer_seq)
                return cas.Skip(list(range(last - n + 1, last + 1)))
            if before_write is not None:
                before_write(snap)
            todo = new[done:]
            now = self.clock_ms()
            wms = fm.prune_watermarks(view.watermarks, now, self.watermark_ttl_ms, WATERMARK_CAP)
            last_seq = snap.root.next_seq + len(todo) - 1
            wms[producer_id] = fm.Watermark(producer_id, last_producer_seq, last_seq, now)
            draft = self.draft(snap)
            draft.watermarks = wms
            first = tree.append_entries(draft, todo, now)
            return cas.Write(
                self.build(draft, now), _Appended([None] * done, first, len(todo), last_seq, now)
            )

        def done(d: _Appended, etag: str) -> list[int | None]:
            self.stats.incr("appends")
            self.stats.incr("entries_appended", d.count)
            return d.sequences()

        def landed(read: cas.Read[Snapshot], tried: Sequence[_Appended]) -> list[int | None] | None:
            wm = read.state.view.watermarks.get(producer_id)
            if wm is None or wm.producer_seq != pseqs[-1]:
                return None
            for d in tried:  # this call's own write, found after its response was lost
                if (wm.last_sequence, wm.updated_ms) == (d.last_seq, d.now_ms):
                    self.stats.incr("deduplicated_appends")
                    return d.sequences()
            return None

        return self.run_cas(decide, done, landed=landed)

    def append_once(
        self,
        new: Sequence[fm.NewEntry],
        *,
        before_write: Callable[[Snapshot], None] | None = None,
        create: bool = True,
    ) -> list[int]:
        """Append ``new`` exactly once in one CAS, without a producer watermark.

        For appends made once (a Spark batch job without a producer id): every entry's
        location must be unique (a fresh ULID key).  After a failed write the queue is
        re-read and the write recognised by its first entry's location at the sequence
        it was given; a write whose entries were unlinked since (dequeued and dropped)
        cannot be told apart and raises OutcomeUnknownError.  ``before_write`` and
        ``create`` as in :meth:`append`.
        """
        n = len(new)
        if n == 0:
            return []

        def decide(read: cas.Read[Snapshot], attempt: int) -> cas.Write[int]:
            snap = read.state
            if not create and not snap.exists:
                raise BufferNotFoundError(self.store.url)
            if before_write is not None:
                before_write(snap)
            now = self.clock_ms()
            draft = self.draft(snap)
            first = tree.append_entries(draft, new, now)
            return cas.Write(self.build(draft, now), first)

        def done(first: int, etag: str) -> list[int]:
            self.stats.incr("appends")
            self.stats.incr("entries_appended", n)
            return list(range(first, first + n))

        def landed(read: cas.Read[Snapshot], tried: Sequence[int]) -> list[int] | None:
            snap = read.state
            for first in tried:
                if first >= snap.root.next_seq:
                    continue
                if first < snap.root.linked_first:
                    raise OutcomeUnknownError(
                        f"an append of {new[0].location} may have landed at sequence {first}, "
                        "which is no longer linked: cannot tell"
                    )
                got = tree.find_sequence(snap.root, first, self.nodes.load)
                if got is not None and got.location == new[0].location:
                    self.stats.incr("deduplicated_appends")
                    return list(range(first, first + n))
            return None

        return self.run_cas(decide, done, landed=landed)

    # --- the default subscriber (RFC 0001's consumer) ---------------------------

    def create(self) -> bool:
        """Create an empty buffer (its root) if none exists; True if this call created it."""
        return self.update(lambda snap, draft: not snap.exists, "creations")

    def initialize(
        self,
        owner: str,
        *,
        create: bool = False,
        position: int | None = None,
        start: str = "earliest",
    ) -> int:
        """Bump the epoch (fencing every older default consumer); returns the new epoch.

        Registers "default" if it is not (at the first retained sequence, or the tail with
        ``start="latest"``).  ``position`` (a resume point below the published one) lowers
        its published position in the same CAS, never below the first retained sequence.
        ``owner`` must be unique to this call: it is how a retry recognises its own bump.
        A reader never creates a buffer: no manifest raises BufferNotFoundError, unless
        ``create=True`` (then the first write makes the root).
        """
        target: list[int] = []

        def change(snap: Snapshot, draft: tree.Root) -> bool:
            if target and snap.view.owner == owner and snap.footer.epoch == target[-1]:
                return False  # our bump landed although its CAS reported a failure
            if not create and not snap.exists:
                raise BufferNotFoundError(self.store.url)
            reg = draft.registry.get(freg.DEFAULT)
            if reg is None:
                require_room(draft)
            target.append(snap.footer.epoch + 1)
            draft.epoch, draft.owner = target[-1], owner
            first = draft.next_seq if start == "latest" else draft.low
            pub = first if reg is None else reg.published_next
            if position is not None and position < pub:
                pub = max(position, draft.low)
            draft.registry[freg.DEFAULT] = freg.Registration(freg.DEFAULT, freg.ZERO_REG, 0, pub)
            return True

        self.update(change, "epoch_bumps")
        return target[-1]

    def dequeue(self, through_sequence: int, epoch: int) -> None:
        """The default subscriber is done through ``through_sequence``: publish it (the head
        moves when every other subscriber is past it too); fenced by ``epoch``."""

        def change(snap: Snapshot, draft: tree.Root) -> bool:
            if snap.footer.epoch != epoch:
                raise FencedError(epoch, snap.footer.epoch)
            want = min(through_sequence + 1, draft.next_seq)
            reg = draft.registry.get(freg.DEFAULT)
            if reg is not None and reg.published_next >= want:
                return False
            draft.registry[freg.DEFAULT] = freg.Registration(freg.DEFAULT, freg.ZERO_REG, 0, want)
            return True

        self.update(change, "dequeues")

    def update(self, change: Callable[[Snapshot, tree.Root], bool], stat: str) -> bool:
        """A CAS loop over the root: ``change(snap, draft)`` edits a draft of a fresh read and
        returns False when there is nothing (more) to write; it decides from what it finds,
        so a retry after an unknown outcome recognises its own landed write.  Retention,
        the head and rebalancing are applied in the same write.  True if this call wrote."""

        def decide(read: cas.Read[Snapshot], attempt: int) -> cas.Write[None] | cas.Skip[bool]:
            draft = self.draft(read.state)
            if not change(read.state, draft):
                return cas.Skip(False)
            return cas.Write(self.build(draft, self.clock_ms()), None)

        return self.run_cas(decide, lambda _d, _e: self._counted(stat, True))

    def _counted(self, stat: str, result: R) -> R:
        self.stats.incr(stat)
        return result

    def apply_retention(self) -> None:
        """One CAS that only applies retention and rebalancing (e.g. from a cron job)."""

        def decide(read: cas.Read[Snapshot], attempt: int) -> cas.Write[None]:
            before = read.state.root
            draft = self.draft(read.state)
            build = self.build(draft, self.clock_ms())

            def unless_unchanged() -> bytes:
                data = build()
                if draft.same_links(before) and draft.retention == before.retention:
                    raise cas.Unchanged()  # nothing to unlink: no write (idempotent)
                return data

            return cas.Write(unless_unchanged, None)

        self.run_cas(decide, lambda _d, _e: self._counted("retention_passes", None))

    def set_retention(
        self, max_age: timedelta | None = None, max_bytes: int | None = None
    ) -> fm.RetentionPolicy:
        """Store the buffer's retention policy in the root (one CAS) and apply it at once.

        Both None stores an explicit "no retention": acked history is unlinked as it is
        dequeued, and no writer's TreeConfig can seed a policy again.  Replaces the whole
        policy; idempotent (a root already at this policy is not written).
        """
        want = _policy(max_age, max_bytes)

        def decide(
            read: cas.Read[Snapshot], attempt: int
        ) -> cas.Write[None] | cas.Skip[fm.RetentionPolicy]:
            if read.state.root.retention == want:
                return cas.Skip(want)
            draft = self.draft(read.state)
            draft.retention = want
            return cas.Write(self.build(draft, self.clock_ms()), None)

        return self.run_cas(decide, lambda _d, _e: self._counted("retention_sets", want))

    def set_gc_grace_period(self, grace: timedelta, *, force: bool = False) -> timedelta:
        """Store the buffer's GC grace period in the root (one CAS; idempotent); GC and
        writers read it there.  Under twice the tree's ``link_deadline`` GC could delete a
        group node a writer is about to link: refused unless ``force``."""
        if not isinstance(grace, timedelta) or grace < timedelta(0):
            raise ConfigError(f"gc grace period must be a timedelta >= 0, got {grace!r}")
        if not force and grace < 2 * self.tree.link_deadline:
            raise ConfigError(
                f"gc grace period {grace} is shorter than twice the tree's link deadline "
                f"({self.tree.link_deadline}): GC could delete what a writer is linking; "
                "pass force=True only when no writer runs concurrently"
            )
        want = grace // timedelta(milliseconds=1)

        def decide(read: cas.Read[Snapshot], attempt: int) -> cas.Write[None] | cas.Skip[timedelta]:
            if read.state.gc_grace_ms == want:
                return cas.Skip(grace)
            draft = self.draft(read.state)
            assert draft.buffer is not None
            draft.buffer = dataclasses.replace(draft.buffer, gc_grace_ms=want)
            return cas.Write(self.build(draft, self.clock_ms()), None)

        return self.run_cas(decide, lambda _d, _e: self._counted("grace_sets", grace))

    # --- tree maintenance inside a CAS attempt ----------------------------------

    def draft(self, snap: Snapshot) -> tree.Root:
        """A copy of the root to change; adds the buffer section when the root lacks one
        (a fresh buffer id, the default grace period), and seeds the retention policy from
        our TreeConfig only when the root has never had one (the root's stored policy is
        authoritative)."""
        draft = snap.root.copy()
        if draft.buffer is None:
            now = self.clock_ms()
            draft.buffer = fm.BufferInfo(
                ULID.from_timestamp(now / 1000).bytes,
                now,
                DEFAULT_GC_GRACE_PERIOD // timedelta(milliseconds=1),
            )
        mine = self._config_retention
        if mine is None:
            return draft
        if draft.retention is None:
            draft.retention = mine
        elif draft.retention != mine and self._warned_retention != draft.retention:
            self._warned_retention = draft.retention
            self.stats.incr("retention_config_ignored")
            log.warning(
                "the buffer's stored retention policy %s differs from this writer's "
                "TreeConfig %s: applying the stored one (set_retention changes it)",
                draft.retention,
                mine,
            )
        return draft

    @staticmethod
    def policy(head: int, now_ms: int, retention: fm.RetentionPolicy | None) -> tree.Policy:
        """What a write may unlink under the root's ``retention`` (None: no retention)."""
        if retention is None or not retention.retains:
            return tree.Policy(head=head, retain=False)
        age = retention.max_age_ms
        return tree.Policy(
            head=head,
            retain=True,
            age_limit_ms=None if age is None else now_ms - age,
            max_bytes=retention.max_bytes,
        )

    def _finish(self, draft: tree.Root, now_ms: int) -> bytes:
        """Settle the head, unlink what the root's policy allows, rebalance, and encode (group
        PUTs happen here)."""
        draft.settle_head()
        policy = self.policy(draft.head, now_ms, draft.retention)
        tree.trim(draft, policy, self.nodes.load, self.nodes.put)
        tree.rebalance(draft, self.tree.m, self.nodes.put)
        if draft.nodes_written:
            self.stats.incr("groups_written", len(draft.nodes_written))
        return draft.encode()


@dataclasses.dataclass(frozen=True, slots=True)
class _Appended:
    """What one append attempt decided: the sequences it gives its entries."""

    prior: list[int | None]
    """Entries an earlier attempt had landed (their sequences, where known)."""
    first: int
    count: int
    last_seq: int
    now_ms: int
    """The watermark it writes: (last_seq, now_ms) is how a retry recognises it."""

    def sequences(self) -> list[int | None]:
        return self.prior + list(range(self.first, self.first + self.count))


class _Root:
    """The root as a :class:`~tieredbuf.queue.cas.CasObject` of its queue."""

    def __init__(self, queue: ManifestQueue) -> None:
        self.queue = queue

    def read(self) -> cas.Read[Snapshot]:
        snap = self.queue.read()
        return cas.Read(snap, snap.etag)

    def write(self, data: bytes, etag: str | None) -> str:
        mode: PutMode = "create" if etag is None else IfMatch(etag)
        written = self.queue.store.put(self.queue.key, data, mode=mode)
        self.queue.remember(data, written)
        return written


def require_room(draft: tree.Root) -> None:
    """Raise ConfigError when the registry is at its cap (a new registration would not fit
    in the bounded root, I6)."""
    if len(draft.registry) >= freg.MAX_SUBSCRIBERS:
        raise ConfigError(
            f"the buffer already has {freg.MAX_SUBSCRIBERS} subscribers "
            "(the cap that keeps the root bounded): remove one first"
        )


def _policy(max_age: timedelta | None, max_bytes: int | None) -> fm.RetentionPolicy:
    if max_age is not None and max_age < timedelta(0):
        raise ConfigError(f"retention max_age must be >= 0, got {max_age}")
    if max_bytes is not None and max_bytes < 0:
        raise ConfigError(f"retention max_bytes must be >= 0, got {max_bytes}")
    age_ms = None if max_age is None else max_age // timedelta(milliseconds=1)
    return fm.RetentionPolicy(age_ms, max_bytes)


def retention_of(cfg: TreeConfig) -> fm.RetentionPolicy | None:
    """The policy a TreeConfig asks for (None when it sets no retention rule)."""
    if not cfg.retains:
        return None
    return _policy(cfg.retention_max_age, cfg.retention_max_bytes)
