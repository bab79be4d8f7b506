"""The streaming ``consumer`` option: the query is the queue's fenced consumer.

Kept in one small class so it can become a named subscriber later without touching
the planning code: :meth:`QueueConsumer.start` bumps the epoch once per query run
(fencing every older consumer: an older run of the same query, a second query, a
plain ``buf.consumer()``), :meth:`check` fails a trigger whose root is at another
epoch, and :meth:`commit` dequeues through a sequence at our epoch (a fenced query
cannot dequeue: the CAS is conditional on the epoch, I4).  It never creates a buffer:
``start`` on a URL with no manifest raises BufferNotFoundError.
"""

from __future__ import annotations

import logging

from ulid import ULID

import tieredbuf
from tieredbuf.errors import FencedError
from tieredbuf.queue.manifest_queue import Snapshot

log = logging.getLogger(__name__)


class QueueConsumer:
    def __init__(self, buf: tieredbuf.Buffer, name: str) -> None:
        self.buf = buf
        self.name = name
        self.epoch: int | None = None

    def start(self) -> int:
        """Bump the epoch (once per query run); returns it."""
        if self.epoch is None:
            owner = f"spark:{self.name}/{ULID()}"
            self.epoch = self.buf.queue.initialize(owner, create=False)
            log.info("tieredbuf consumer %r initialized at epoch %d", owner, self.epoch)
        return self.epoch

    def check(self, snap: Snapshot) -> None:
        """FencedError when ``snap`` is at another epoch than ours."""
        epoch = self.start()
        if snap.footer.epoch != epoch:
            raise FencedError(epoch, snap.footer.epoch)

    def commit(self, through: int) -> None:
        """Dequeue every sequence <= ``through`` (fenced by our epoch)."""
        self.buf.queue.dequeue(through, self.start())
