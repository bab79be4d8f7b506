"""The streaming ``consumer`` option: the query is a named subscriber of the buffer.

``.option("consumer", "etl")`` makes the query subscriber ``etl``
(:mod:`tieredbuf.queue.subscription`): several queries (and ``buf.consumer(...)``
programs) with different names read the same buffer side by side, each with its own
position, and an entry is unlinked only once every subscriber is past it.  The name
``default`` is the buffer's RFC 0001 consumer, the one ``buf.consumer()`` is.

* :meth:`QueueConsumer.start` registers the subscriber if new and bumps *its own*
  epoch once per query run: an older run of the same query (or a second query with
  the same name) is fenced; other subscribers are untouched (I4).  It returns the
  subscriber's position: where a new checkpoint resumes.  It never creates a buffer.
* :meth:`check` fails a trigger when a newer instance took over: for "default" from
  the root the trigger read anyway, for a named subscriber from its progress object
  (one small GET per trigger that found data; an idle query makes none: it learns at
  its next busy trigger, before planning anything, or at its commit).
* :meth:`commit` acks through a sequence: one CAS of the subscriber's own progress
  object (fenced by its epoch), published into the root lazily, when this subscriber
  holds the head back (never more than once a second), so acks do not contend with
  producers' appends.  :meth:`close` publishes what is left.
"""

from __future__ import annotations

import logging

import tieredbuf
from tieredbuf.errors import FencedError
from tieredbuf.queue.manifest_queue import Snapshot
from tieredbuf.queue.subscription import Subscription

log = logging.getLogger(__name__)


class QueueConsumer:
    def __init__(self, buf: tieredbuf.Buffer, name: str) -> None:
        self.buf = buf
        self.name = name
        self.sub: Subscription = buf.subscription(name, owner=f"spark:{name}")
        self.position: int | None = None

    def start(self, latest: bool = False) -> int:
        """Register / bump the epoch (once per query run); returns the subscriber's
        position when it started (``latest``: a new subscriber starts at the tail)."""
        if self.position is None:
            self.position = self.sub.initialize(start="latest" if latest else "earliest")
            log.info(
                "tieredbuf subscriber %r: epoch %d, position %d",
                self.name,
                self.sub.epoch,
                self.position,
            )
        return self.position

    @property
    def epoch(self) -> int:
        self.start()
        assert self.sub.epoch is not None
        return self.sub.epoch

    def check(self, snap: Snapshot) -> None:
        """FencedError when a newer instance of this subscriber took over (for "default"
        from the root the trigger read, for a named subscriber from its progress object)."""
        self.start()
        self.sub.check(snap)

    def check_footer_epoch(self, footer_epoch: int) -> None:
        """The idle path's footer read: it carries the epoch of "default" only."""
        self.start()
        self.sub.check_footer(footer_epoch)

    def skipped(self, first: int, low: int) -> int:
        """Sequences ``first..low-1`` are gone and skipped (failOnDataLoss=false): count
        those this subscriber had not acked in its ``lost`` count, and ack them with it
        (both are written by the next commit's progress CAS, or at close), so a re-run
        of the micro-batch after a restart does not count them again.  Returns how many
        were counted now.  (The "default" subscriber keeps no lost count: as
        ``buf.consumer()``, it is counted in memory only.)"""
        self.start()
        n = low - max(first, self.sub.position)
        if n <= 0:
            return 0
        self.sub.lost += n
        self.sub.ack_through(low - 1)
        log.warning(
            "tieredbuf subscriber %r: %d sequences before %d were gone and are skipped "
            "(failOnDataLoss=false); counted in its lost count",
            self.name,
            n,
            low,
        )
        return n

    def commit(self, through: int) -> None:
        """Ack every sequence <= ``through`` (fenced by our epoch)."""
        self.start()
        self.sub.ack_through(through)
        self.sub.flush(publish=False)

    def close(self) -> None:
        if self.position is None:
            return
        try:
            self.sub.close()
        except FencedError as e:  # a newer run took over: it owns the position now
            log.info("tieredbuf subscriber %r: not publishing at stop: %s", self.name, e)
