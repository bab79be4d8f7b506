"""The refills of one process's workers of one work queue, made one writer of its
progress object.

Every change a worker makes is a CAS of the queue's progress object
(:mod:`tieredbuf.consume.refill`).  Eight workers that each write it themselves lose
about one race per write at S3's round trips -- a refused PUT and a GET -- and write it
eight times where once would do.  So the workers a :class:`~tieredbuf.Buffer` opens on
one queue (with one configuration) hand their refills to one :class:`RefillHub`:

* it runs them one CAS at a time on a thread of its own, and each CAS carries every
  refill asked for while the one before it was under way (a group commit): a worker's
  part is decided as its own CAS would decide it (its id, its token, its ops, its
  batch), only written together with the others';
* it registers the subscriber once, keeps one copy of the progress object and one of
  the root for all of them, and is the one that publishes the queue's position;
* a worker waits for its refill only when it has nothing left to hand out (a refill
  running ahead is a future), and has at most one refill asked at a time.

Workers in other processes, or with another configuration, write the object as
separate writers (a lost race costs a GET and a retry).  :class:`Hubs` is the
registry a buffer keeps: a hub lives while a worker is attached to it.  A hub whose
subscriber was removed (SubscriberRemovedError, or ``Buffer.remove_subscriber``) is
*retired*: its workers keep failing, and a worker opened afterwards registers the
queue afresh through a new hub.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import timedelta

from ulid import ULID

from tieredbuf.config import WorkerConfig
from tieredbuf.consume.refill import Refilled, Refiller, Request
from tieredbuf.errors import SubscriberRemovedError
from tieredbuf.format.progress import Progress
from tieredbuf.queue import shared
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot
from tieredbuf.queue.subscription import NamedSubscription
from tieredbuf.runtime.pools import started_pool

_MS = timedelta(milliseconds=1)


def limits_of(config: WorkerConfig) -> shared.Limits:
    """The limits a worker's CAS decides by (:func:`tieredbuf.queue.shared.apply`)."""
    return shared.Limits(
        lease_ms=config.lease // _MS,
        claim_n=config.claim_batch,
        max_span=config.max_span,
        max_deliveries=config.max_deliveries,
        backoff_ms=config.redelivery_delay // _MS,
        backoff_max_ms=config.redelivery_delay_max // _MS,
    )


class RefillHub:
    """The refills of the workers attached to it (see the module docstring)."""

    def __init__(self, queue: ManifestQueue, subscriber: str, config: WorkerConfig) -> None:
        self.key = (subscriber, config)
        self.sub = NamedSubscription(
            queue,
            subscriber,
            shared=True,
            owner=f"w-{ULID()}",
            publish_interval_ms=config.publish_interval // _MS,
        )
        self.limits = limits_of(config)
        self.refiller = Refiller(
            queue,
            self.sub,
            self.limits,
            check_interval_s=config.check_interval.total_seconds(),
            skip_lost=config.on_lost == "skip",
            clock_ms=self.clock_ms,
        )
        self.lock = threading.RLock()
        """Held while the progress object or the cached root is read or written."""
        self._asked: list[tuple[Request, Future[Refilled]]] = []
        self._asked_lock = threading.Lock()
        self._draining = False
        self._registered = False
        self.retired = False
        """Its subscriber was removed: no worker joins it any more."""
        self._thread = started_pool(1, "tb-refill")

    def clock_ms(self) -> int:
        """The wall clock leases are judged by (the subscription's)."""
        return self.sub.clock_ms()

    def register(self, start: str) -> None:
        """Register the subscriber if new (once for every worker attached)."""
        with self._locked():
            if self._registered:
                return
            self.sub.register(start)
            if self.sub.registered_root is not None:
                self.refiller.adopt(self.sub.registered_root)
            self._registered = True

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The hub's lock; a SubscriberRemovedError under it retires the hub."""
        with self.lock:
            try:
                yield
            except SubscriberRemovedError:
                self.retired = True
                raise

    # --- refills -----------------------------------------------------------------------

    def submit(
        self,
        worker_id: bytes,
        ops: Sequence[shared.Op],
        claim_n: int,
        patience_s: float = 0.0,
        on_landed: Callable[[Sequence[shared.Op], shared.Applied], None] | None = None,
    ) -> Future[Refilled]:
        """Ask for a refill (:class:`~tieredbuf.consume.refill.Request`): it rides the next
        CAS, with whatever else is asked meanwhile."""
        req = Request(worker_id, list(ops), claim_n, patience_s, on_landed)
        out: Future[Refilled] = Future()
        with self._asked_lock:
            self._asked.append((req, out))
            if not self._draining:
                self._draining = True
                self._thread.submit(self._drain)
        return out

    def run(
        self,
        worker_id: bytes,
        ops: Sequence[shared.Op],
        claim_n: int,
        on_landed: Callable[[Sequence[shared.Op], shared.Applied], None] | None = None,
    ) -> Refilled:
        """A refill, waited for."""
        return self.submit(worker_id, ops, claim_n, 0.0, on_landed).result()

    def _drain(self) -> None:
        """On the hub's thread: one CAS for everything asked, until nothing is."""
        while True:
            with self._asked_lock:
                batch, self._asked = self._asked, []
                if not batch:
                    self._draining = False
                    return
            if len(batch) > 1:  # refills that rode another's CAS instead of writing their own
                self.refiller.queue.stats.incr("worker_refills_joined", len(batch) - 1)
            try:
                with self._locked():
                    outs = self.refiller.run([r for r, _ in batch])
            except BaseException as e:  # every part failed with it: each worker raises it
                for _, f in batch:
                    f.set_exception(e)
            else:
                for (_, f), o in zip(batch, outs, strict=True):
                    f.set_result(o)

    def waiting(self) -> int:
        """Refills asked and not yet taken into a CAS."""
        with self._asked_lock:
            return len(self._asked)

    # --- what the workers read ---------------------------------------------------------

    def reload(self) -> Progress:
        """The progress object, read now (an idle worker's look for handed-back entries)."""
        with self._locked():
            return self.sub.reload()

    def read_root(self) -> Snapshot:
        """A fresh root (also the next refill's)."""
        with self._locked():
            return self.refiller.read_root()

    def publish(self, force: bool = False) -> None:
        """Publish the queue's position into the root (:meth:`NamedSubscription.maybe_publish`)."""
        with self._locked():
            self.sub.maybe_publish(force=force)

    def known_tail(self) -> int:
        return self.refiller.known_tail()

    def more_known(self, now_ms: int) -> bool:
        return self.refiller.more_known(now_ms)

    def workers(self, now_ms: int) -> int:
        return self.refiller.workers(now_ms)

    def publisher(self, now_ms: int) -> bool:
        return self.refiller.publisher(now_ms)

    def close(self) -> None:
        """Stop the hub's thread (its last worker detached: nothing more is asked)."""
        self._thread.shutdown(wait=True)


class Hubs:
    """The hubs of one buffer, by work queue and worker configuration."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hubs: dict[tuple[str, WorkerConfig], RefillHub] = {}

    def attach(
        self, queue: ManifestQueue, subscriber: str, config: WorkerConfig, worker_id: bytes
    ) -> RefillHub:
        """The hub of ``subscriber`` with ``config`` (made if none is live), with
        ``worker_id`` attached."""
        with self._lock:
            hub = self._hubs.get((subscriber, config))
            if hub is None or hub.retired:
                hub = self._hubs[(subscriber, config)] = RefillHub(queue, subscriber, config)
            hub.refiller.local.add(worker_id)
            hub.refiller.ran_for.add(worker_id)
            return hub

    def detach(self, hub: RefillHub, worker_id: bytes) -> bool:
        """``worker_id`` is done with ``hub``.  True when it was the last one attached:
        the hub is out of the registry, and the caller closes it."""
        with self._lock:
            hub.refiller.local.discard(worker_id)
            if hub.refiller.local:
                return False
            if self._hubs.get(hub.key) is hub:
                del self._hubs[hub.key]
            return True

    def retire(self, subscriber: str) -> None:
        """``subscriber`` was removed: its hubs take no new worker."""
        with self._lock:
            for key in [k for k in self._hubs if k[0] == subscriber]:
                self._hubs.pop(key).retired = True
