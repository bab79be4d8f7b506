"""One subscriber's position, for any reader: initialize / position / ack-through / flush.

:class:`Subscription` is what a consumer (or a Spark driver, which has no
ConsumedBatch objects) needs of a subscriber, without reading any data:

* ``initialize(last_acked_sequence=None, start="earliest")`` registers the subscriber
  if new and bumps *its own* epoch, fencing older instances of the same subscriber only
  (I4); returns the first sequence to read.
* ``check(snap=None)`` raises FencedError (SubscriberRemovedError once removed) if a
  newer instance took over: for "default" from a root just read (``snap``: no request)
  or the root's 22-byte footer, for a named subscriber from its progress object (one
  small GET); ``check_footer(epoch)`` judges a footer read anyway (it carries only
  "default"'s epoch).
* ``ack_through(seq)`` records that everything through ``seq`` is done: no request.
* ``flush()`` writes it: for "default" a root CAS at the root's epoch (RFC 0001's
  dequeue); for a named subscriber a CAS of its own progress object (fenced by the epoch
  there), then, lazily, a publication into the root (:func:`subscribers.publish`) when
  this subscriber is the one holding the head back (at most once per
  ``publish_interval``), and always on ``flush(publish=True)`` / ``close()``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

from ulid import ULID

from tieredbuf.errors import (
    BufferNotFoundError,
    ConfigError,
    DataLossError,
    FencedError,
    NotInitializedError,
    SubscriberRemovedError,
)
from tieredbuf.format import progress as fp
from tieredbuf.format import registry as freg
from tieredbuf.queue import cas
from tieredbuf.queue import subscribers as subs
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot

Start = Literal["earliest", "latest"]
D = TypeVar("D")
R = TypeVar("R")


def _check_start(start: str) -> None:
    if start not in ("earliest", "latest"):
        raise ConfigError(f"start must be 'earliest' or 'latest', got {start!r}")


class Subscription:
    """A subscriber's position.  Use :func:`open_subscription` to get one."""

    def __init__(
        self,
        queue: ManifestQueue,
        name: str,
        *,
        shared: bool = False,
        publish_interval_ms: int = 1000,
        owner: str | None = None,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.queue = queue
        self.name = freg.check_name(name)
        self.shared = shared
        self.publish_interval_ms = publish_interval_ms
        self.clock_ms = clock_ms
        self.owner_prefix = owner or f"c-{ULID()}"
        self.epoch: int | None = None
        self.position = 0
        """The first sequence not yet acked (through ``ack_through``)."""
        self.written = 0
        """The position as last written (root or progress object)."""
        self.lost = 0
        """Sequences skipped because retention unlinked them first (``on_lost="skip"``)."""

    @property
    def is_default(self) -> bool:
        return self.name == freg.DEFAULT

    def _epoch(self) -> int:
        if self.epoch is None:
            raise NotInitializedError(f"call initialize() before using subscriber {self.name!r}")
        return self.epoch

    def initialize(self, last_acked_sequence: int | None = None, start: str = "earliest") -> int:
        raise NotImplementedError

    def check(self, snap: Snapshot | None = None) -> None:
        """Raise FencedError if a newer instance of this subscriber took over.  ``snap``: a
        root just read (noted, see :meth:`observe`; it carries "default"'s epoch)."""
        raise NotImplementedError

    def check_footer(self, footer_epoch: int) -> bool:
        """The epoch of a root footer just read: FencedError if it fences this instance.
        True when it was this subscriber's epoch to judge ("default"), False when the
        footer says nothing about this subscriber (a named one)."""
        return False

    @property
    def footer_epoch(self) -> int | None:
        """The epoch a root footer shows while this instance is current (None: the footer
        does not carry this subscriber's epoch)."""
        return None

    def ack_through(self, sequence: int) -> None:
        """Everything through ``sequence`` is processed (no request until :meth:`flush`)."""
        self._epoch()
        self.position = max(self.position, sequence + 1)

    def flush(self, publish: bool = True, *, verify: bool = False) -> bool:
        """Write the position (fenced by this instance's epoch).  ``verify``: even when
        there is nothing to write, make sure this instance is not fenced.  True when a
        write or a check showed this instance current."""
        raise NotImplementedError

    def observe(self, snap: Snapshot) -> None:
        """Note a fresh root read (a named subscriber publishes lazily from it)."""

    def close(self) -> None:
        if self.epoch is not None:
            self.flush(publish=True)

    def close_reader(self) -> None:
        """What a consumer's ``close()`` writes: by default everything (:meth:`close`)."""
        self.close()


class DefaultSubscription(Subscription):
    """ "default": RFC 0001's consumer, resident in the root (its epoch is the footer's)."""

    def initialize(self, last_acked_sequence: int | None = None, start: str = "earliest") -> int:
        _check_start(start)
        want = None if last_acked_sequence is None else last_acked_sequence + 1
        self.epoch = self.queue.initialize(
            f"{self.owner_prefix}/{ULID()}", position=want, start=start
        )
        snap = self.queue.read()
        reg = snap.registry.get(freg.DEFAULT)
        if snap.footer.epoch != self.epoch or reg is None:
            raise FencedError(self.epoch, snap.footer.epoch)
        self.written = reg.published_next
        self.position = reg.published_next if want is None else want
        return self.position

    def check(self, snap: Snapshot | None = None) -> None:
        epoch = self._epoch()
        if snap is None:
            self.queue.check_epoch(epoch)
        elif snap.footer.epoch != epoch:
            raise FencedError(epoch, snap.footer.epoch)

    def check_footer(self, footer_epoch: int) -> bool:
        epoch = self._epoch()
        if footer_epoch != epoch:
            raise FencedError(epoch, footer_epoch)
        return True

    @property
    def footer_epoch(self) -> int | None:
        return self.epoch

    def flush(self, publish: bool = True, *, verify: bool = False) -> bool:
        """RFC 0001's dequeue: a root CAS at this instance's epoch (it reads the root
        first, so it always verifies)."""
        self.queue.dequeue(self.position - 1, self._epoch())
        self.written = self.position
        return True

    def close_reader(self) -> None:
        """RFC 0001's consumer writes nothing at close: its acks land by ``dequeue_every``
        or ``flush()``."""


class NamedSubscription(Subscription):
    """A named subscriber: its epoch, position and (shared) work state in its progress
    object; its published position in the root's registry."""

    def __init__(self, queue: ManifestQueue, name: str, **kw: object) -> None:
        super().__init__(queue, name, **kw)  # type: ignore[arg-type]
        if self.is_default:
            raise ConfigError('"default" is the root-resident consumer: use DefaultSubscription')
        self.progress_store = subs.ProgressStore(queue)
        self.reg_id: bytes | None = None
        self.progress: fp.Progress | None = None
        self.etag: str | None = None
        self._owner = ""
        self._published = -1
        self._head = -1
        self._observed_ms = -(1 << 62)
        self._last_publish_ms = -(1 << 62)
        self.registered_root: Snapshot | None = None
        """The root :meth:`register` judged by (a worker's first refill starts from it)."""

    # --- registration and fencing ------------------------------------------------------

    def register(self, start: str = "earliest", position: int | None = None) -> None:
        """Find or create this subscriber's registration (no epoch bump)."""
        _check_start(start)
        while True:
            snap = self.queue.read()
            if not snap.exists:
                raise BufferNotFoundError(self.queue.store.url)
            reg = snap.registry.get(self.name)
            if reg is None:
                reg = self._register_new(snap, start, position)
            if reg.shared != self.shared:
                kind = "a shared work queue" if reg.shared else "a stream subscriber"
                use = "buf.worker()" if reg.shared else "buf.consumer()"
                raise ConfigError(f"subscriber {self.name!r} is {kind}: use {use}")
            got = self.progress_store.get(self.name, reg.reg_id)
            if got is None:
                again = self.queue.read().registry.get(self.name)
                if again is not None and again.reg_id == reg.reg_id:
                    raise DataLossError(
                        f"the progress object {subs.progress_key(self.name, reg.reg_id)} of "
                        f"registered subscriber {self.name!r} is missing (deleted by hand?)"
                    )
                continue  # removed (or re-registered) meanwhile: start again
            self.reg_id, (self.progress, self.etag) = reg.reg_id, got
            known = snap.registry.get(self.name)
            self.registered_root = (
                snap if known is not None and known.reg_id == reg.reg_id else None
            )
            self._published, self._head = reg.published_next, snap.head
            self._observed_ms = self.clock_ms()
            return

    def _register_new(self, snap: Snapshot, start: str, position: int | None) -> freg.Registration:
        now = self.clock_ms()
        reg_id = ULID.from_timestamp(now / 1000).bytes
        first = (
            position
            if position is not None
            else (snap.root.next_seq if start == "latest" else snap.low)
        )
        self._owner = f"{self.owner_prefix}/{ULID()}"
        p = fp.Progress(
            self.name,
            reg_id,
            self.shared,
            0 if self.shared else 1,
            self._owner,
            first,
            first,
            now,
            now,
        )
        self.progress_store.create(p)
        deadline = self.queue.tree.link_deadline.total_seconds() * 1000

        def check(fresh: Snapshot) -> None:
            # GC reaps an unregistered progress object past its grace period: link it well
            # inside it (like a group node), or re-plan with a fresh one
            if self.clock_ms() - now > deadline:
                raise subs.Retry()
            if position is None and start == "earliest" and fresh.low > first:
                raise subs.Retry()  # retention moved on: start at the new earliest

        reg = freg.Registration(self.name, reg_id, freg.FLAG_SHARED if self.shared else 0, first)
        try:
            return subs.register(self.queue, reg, check)
        except subs.Retry:
            self.queue.stats.incr("registration_replans")
            return self._register_new(self.queue.read(), start, position)

    def initialize(self, last_acked_sequence: int | None = None, start: str = "earliest") -> int:
        """Register if new, then bump this subscriber's epoch in its progress object (older
        instances of *this* subscriber are fenced; others are untouched)."""
        if self.shared:
            raise ConfigError("workers of a shared subscriber never bump its epoch")
        if last_acked_sequence is not None and last_acked_sequence < 0:
            raise ValueError(f"last_acked_sequence must be >= 0, got {last_acked_sequence}")
        want = None if last_acked_sequence is None else last_acked_sequence + 1
        self.register(start, want)
        assert self.progress is not None and self.etag is not None
        if self.progress.epoch == 1 and self.progress.owner == self._owner:
            p = self.progress  # registered by this very call: epoch 1 is already ours
        else:
            p = self._bump_epoch(want)
        self.epoch = p.epoch
        self.position = self.written = p.position
        self.lost = p.lost
        if self.reg_id is not None and p.position < self._published:
            subs.set_published(self.queue, self.name, self.reg_id, p.position)
            self._published = p.position
        return self.position

    def _bump_epoch(self, want: int | None) -> fp.Progress:
        owner = f"{self.owner_prefix}/{ULID()}"

        def decide(p: fp.Progress, attempt: int) -> tuple[fp.Progress, fp.Progress]:
            pos = p.position if want is None else want
            new = dataclasses.replace(
                p,
                epoch=p.epoch + 1,
                owner=owner,
                position=pos,
                claim_cursor=pos,
                updated_ms=self.clock_ms(),
            )
            return new, new

        def landed(p: fp.Progress, tried: Sequence[fp.Progress]) -> fp.Progress | None:
            return p if any(p.owner == t.owner and p.epoch == t.epoch for t in tried) else None

        def done(new: fp.Progress) -> fp.Progress:
            self.queue.stats.incr("subscriber_epoch_bumps")
            return new

        return self.cas(decide, done, landed)

    def cas(
        self,
        decide: Callable[[fp.Progress, int], tuple[fp.Progress, D] | cas.Skip[R]],
        done: Callable[[D], R],
        landed: Callable[[fp.Progress, Sequence[D]], R | None] | None = None,
        *,
        fenced: bool = False,
        blind: bool = True,
        retries: cas.Retries | None = None,
    ) -> R:
        """Write this subscriber's progress object through the one CAS primitive
        (:func:`tieredbuf.queue.cas.run`): ``decide(progress, attempt)`` returns the new
        progress and what it decided (or a Skip); the first attempt is decided from the
        progress as last read or written (``blind``: no GET), a failure re-reads it.
        ``fenced``: every attempt first checks this instance's epoch (FencedError).
        ``retries``: how to back off (the queue's by default)."""
        epoch = self._epoch() if fenced else None

        def fence(p: fp.Progress) -> None:
            if epoch is not None and p.epoch != epoch:
                raise FencedError(epoch, p.epoch, self.name)

        def write(
            read: cas.Read[fp.Progress], attempt: int
        ) -> cas.Write[tuple[fp.Progress, D]] | cas.Skip[R]:
            got = decide(read.state, attempt)
            if isinstance(got, cas.Skip):
                return got
            return cas.Write(fp.encode(got[0]), got)

        def finish(new: tuple[fp.Progress, D], etag: str) -> R:
            self.progress, self.etag = new[0], etag
            return done(new[1])

        def found(read: cas.Read[fp.Progress], tried: Sequence[tuple[fp.Progress, D]]) -> R | None:
            assert landed is not None
            return landed(read.state, [d for _, d in tried])

        assert self.progress is not None and self.etag is not None and self.reg_id is not None
        first = cas.Read(self.progress, self.etag) if blind else None
        return cas.run(
            _ProgressObject(self),
            write,
            finish,
            retries=retries or self.queue.cas_retries(),
            stats=self.queue.stats,
            fence=fence if fenced else None,
            landed=found if landed is not None else None,
            first=first,
            stat_prefix="progress_",
            what=f"the progress of subscriber {self.name!r}",
        )

    def reload(self) -> fp.Progress:
        assert self.reg_id is not None
        got = self.progress_store.get(self.name, self.reg_id)
        if got is None:
            raise SubscriberRemovedError(self.name, self.epoch or 0)
        self.progress, self.etag = got
        return got[0]

    def check(self, snap: Snapshot | None = None) -> None:
        epoch = self._epoch()
        p = self.reload()
        if p.epoch != epoch:
            raise FencedError(epoch, p.epoch, self.name)
        if snap is not None:
            self.observe(snap)

    # --- position ---------------------------------------------------------------------

    def observe(self, snap: Snapshot) -> None:
        reg = snap.registry.get(self.name)
        if reg is None or reg.reg_id != self.reg_id:
            raise SubscriberRemovedError(self.name, self.epoch or 0)
        self._published, self._head = reg.published_next, snap.head
        self._observed_ms = self.clock_ms()

    def flush(self, publish: bool = True, *, verify: bool = False) -> bool:
        """Write the position (one CAS of the progress object, fenced by its epoch), then
        publish it into the root if this subscriber holds the head back (``publish``:
        whenever it is behind what the progress object says).  ``verify`` with nothing to
        write: one GET of the progress object checks the epoch."""
        self._epoch()
        position, lost = self.position, self.lost
        shown = True
        if position != self.written or lost != (self.progress.lost if self.progress else 0):

            def decide(p: fp.Progress, attempt: int) -> tuple[fp.Progress, None] | cas.Skip[None]:
                if (p.position, p.lost) == (position, lost):
                    return cas.Skip(None)  # our write landed; its response was lost
                return dataclasses.replace(
                    p,
                    position=position,
                    claim_cursor=position,
                    lost=lost,
                    updated_ms=self.clock_ms(),
                ), None

            self.cas(decide, lambda _: None, fenced=True)
        elif verify:
            self.check()
        else:
            shown = False
        self.written = position
        self.maybe_publish(force=publish)
        return shown

    def maybe_publish(self, force: bool = False) -> bool:
        """Publish when behind the progress object and either ``force`` or this subscriber
        holds the head back and ``publish_interval`` passed since its last publication.

        Whether it holds the head is judged from its last view of the root, refreshed by
        one GET when that view is older than ``publish_interval``."""
        if self._published >= self.written:
            return False
        now = self.clock_ms()
        if not force:
            if now - self._last_publish_ms < self.publish_interval_ms:
                return False
            if now - self._observed_ms >= self.publish_interval_ms:
                self.observe(self.queue.read())
                if self._published >= self.written:
                    return False
            if self._published > self._head:
                return False  # another subscriber holds the head back: its publication
        self._last_publish_ms = now  # will refresh ours too
        self._head = subs.publish(self.queue, self.progress_store)
        self._published = self.written
        return True


class _ProgressObject:
    """A named subscriber's progress object as a :class:`~tieredbuf.queue.cas.CasObject`:
    a read refreshes the subscription's copy (SubscriberRemovedError once it is gone)."""

    def __init__(self, sub: NamedSubscription) -> None:
        self.sub = sub

    def read(self) -> cas.Read[fp.Progress]:
        p = self.sub.reload()
        assert self.sub.etag is not None
        return cas.Read(p, self.sub.etag)

    def write(self, data: bytes, etag: str | None) -> str:
        assert etag is not None and self.sub.reg_id is not None
        return self.sub.progress_store.cas_bytes(self.sub.name, self.sub.reg_id, data, etag)


def open_subscription(queue: ManifestQueue, name: str = freg.DEFAULT, **kw: object) -> Subscription:
    """The subscription of ``name`` ("default": the root-resident RFC consumer)."""
    if freg.check_name(name) == freg.DEFAULT:
        if kw.get("shared"):
            raise ConfigError('"default" is a stream subscriber, not a shared work queue')
        return DefaultSubscription(queue, name, **kw)  # type: ignore[arg-type]
    return NamedSubscription(queue, name, **kw)
