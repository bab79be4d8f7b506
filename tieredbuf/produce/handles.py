"""WriteHandle / DurabilityWatcher: how a caller learns its data is durable."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Literal, overload

if TYPE_CHECKING:
    from tieredbuf.runtime.retry import StallWatch


class Durability(IntEnum):
    """How far a write has got.  REMOTE implies LOCAL."""

    LOCAL = 1
    """fdatasync has returned for the bytes in the producer's WAL (staged producers).
    A stateless producer has no local copy: LOCAL is reached together with REMOTE."""
    REMOTE = 2
    """The data object is in the store and its entry is in the queue manifest: the entry
    was found there, at a sequence the outcome names (I10)."""


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """How far a produce() call's records got; once REMOTE, where they are (a
    :class:`RemoteOutcome`: never without its sequence)."""

    sequence: int | None
    """Manifest sequence of the entry holding the records (None before REMOTE)."""
    location: str | None
    """Object key of the data object (None before REMOTE)."""
    durability: Durability

    def __post_init__(self) -> None:
        if self.durability >= Durability.REMOTE and (
            not isinstance(self.sequence, int) or not self.location
        ):
            raise ValueError(
                "a REMOTE outcome names the entry found in the manifest: its sequence and "
                f"its data object (I10); got sequence={self.sequence!r}, "
                f"location={self.location!r}"
            )


@dataclass(frozen=True, slots=True)
class RemoteOutcome(WriteOutcome):
    """REMOTE: the entry holding the records, as found in a manifest (I10)."""

    sequence: int
    """Manifest sequence of the entry holding the records."""
    location: str
    """Object key of the data object that entry names."""
    durability: Durability = Durability.REMOTE


@dataclass(frozen=True, slots=True)
class GiveUp:
    """When a :meth:`DurabilityWatcher.wait` without ``timeout`` stops by itself: the
    producer's ``retry.give_up_after`` applied to the wait, as its close() applies it.
    ``watch()`` starts a StallWatch over the producer's store progress and failures;
    ``error(durability)`` is what the wait raises once it stalled (the write itself is
    not failed by that: it is still retried, or stays staged)."""

    watch: Callable[[], StallWatch]
    error: Callable[[Durability], BaseException]


class DurabilityWatcher:
    """Observe or await a write's durability (RFC 0001's DurabilityWatcher)."""

    __slots__ = (
        "_callbacks",
        "_error",
        "_give_up",
        "_level",
        "_lock",
        "_on_remote_wait",
        "_outcome",
        "_waiters",
    )

    def __init__(
        self,
        on_remote_wait: Callable[[], None] | None = None,
        give_up: GiveUp | None = None,
    ) -> None:
        # A plain Lock, and a lock per *blocked* waiter made only when someone blocks
        # (threading.Condition's own scheme): a staged producer makes one watcher per
        # produce() call and building a Condition each time was ~4% of its Python time
        # with four producer threads (py-spy, docs/architecture.md).
        self._lock = threading.Lock()
        self._waiters: list[threading.Lock] | None = None
        self._level = 0
        self._outcome: RemoteOutcome | None = None
        self._error: BaseException | None = None
        self._callbacks: list[tuple[int, Callable[[], None]]] | None = None
        self._on_remote_wait = on_remote_wait
        """Called once, the first time someone waits for REMOTE before it is reached (a
        staged producer then seals the write's segment promptly)."""
        self._give_up = give_up
        """A wait without ``timeout`` gives up by this (None: it waits until reached)."""

    def _someone_waits(self, durability: Durability) -> None:
        """Outside the lock: tell the producer a REMOTE waiter arrived (once)."""
        if durability < Durability.REMOTE or self._on_remote_wait is None:
            return
        with self._lock:
            fn: Callable[[], None] | None = self._on_remote_wait
            self._on_remote_wait = None
            if self._level >= Durability.REMOTE or self._error is not None:
                fn = None
        if fn is not None:
            fn()

    # producer side
    def reach(self, level: Durability, outcome: RemoteOutcome | None = None) -> None:
        """``level`` is reached; REMOTE only with the outcome naming its entry (I10)."""
        if level >= Durability.REMOTE and not isinstance(outcome, RemoteOutcome):
            raise TypeError("REMOTE is reached only with the entry found in the manifest (I10)")
        with self._lock:
            if level > self._level:
                self._level = int(level)
                if outcome is not None:
                    self._outcome = outcome
                self._wake_all()
            fire = self._due_callbacks()
        for fn in fire:
            fn()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None and self._level < Durability.REMOTE:
                self._error = error
                self._wake_all()
            fire = self._due_callbacks()
        for fn in fire:
            fn()

    def _wake_all(self) -> None:
        """Under the lock: release every blocked waiter (each re-checks its level)."""
        waiters, self._waiters = self._waiters, None
        if waiters:
            for w in waiters:
                w.release()

    def _due_callbacks(self) -> list[Callable[[], None]]:
        """Under the lock: pop the callbacks whose level is reached (all, on failure)."""
        if not self._callbacks:
            return []
        done = self._error is not None
        fire = [fn for lvl, fn in self._callbacks if done or lvl <= self._level]
        self._callbacks = [
            (lvl, fn) for lvl, fn in self._callbacks if not (done or lvl <= self._level)
        ]
        return fire

    def when(self, durability: Durability, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once ``durability`` is reached or the write failed (at once if so).

        For event loops: ``fn`` runs on a producer thread and must be quick, e.g.
        ``lambda: loop.call_soon_threadsafe(event.set)``; then call :meth:`wait` with
        ``timeout=0`` for the outcome.
        """
        with self._lock:
            ready = self._error is not None or self._level >= durability
            if not ready:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append((int(durability), fn))
        if ready:
            fn()
        else:
            self._someone_waits(durability)

    # caller side
    @property
    def level(self) -> Durability | None:
        with self._lock:
            return Durability(self._level) if self._level else None

    def result(self) -> RemoteOutcome | None:
        """None while not yet REMOTE; the outcome once it is; raises the failure if it failed.

        A level reached wins over a failure reported earlier: a staged write whose REMOTE
        wait failed on a store error reaches REMOTE once the store works again."""
        with self._lock:
            if self._level >= Durability.REMOTE:
                return self._outcome
            if self._error is not None:
                raise self._error
            return None

    @overload
    def wait(
        self, durability: Literal[Durability.REMOTE] = ..., timeout: float | None = None
    ) -> RemoteOutcome: ...

    @overload
    def wait(self, durability: Durability, timeout: float | None = None) -> WriteOutcome: ...

    def wait(
        self, durability: Durability = Durability.REMOTE, timeout: float | None = None
    ) -> WriteOutcome:
        """Block until ``durability`` is reached; raises TimeoutError or the write's failure
        (for a staged write: LOCAL may be reached and REMOTE fail on a store error).

        Without ``timeout`` a producer's write gives up once its store has failed with
        nothing getting through for ``retry.give_up_after`` (30 s by default): it raises
        FlushTimeoutError (a TimeoutError), and the write goes on (still retried, or
        staged); wait again to go on waiting."""
        if timeout != 0:
            self._someone_waits(durability)
        deadline = None if timeout is None else time.monotonic() + timeout
        watch: StallWatch | None = None
        stalled = False
        while True:
            with self._lock:
                if self._level >= durability:  # reached: a later failure (REMOTE) does not matter
                    return self._outcome or WriteOutcome(None, None, Durability.LOCAL)
                if self._error is not None:
                    raise self._error
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"write not {durability.name} after {timeout} s")
                if stalled:
                    assert self._give_up is not None
                    raise self._give_up.error(durability)
                w = threading.Lock()
                w.acquire()
                if self._waiters is None:
                    self._waiters = []
                self._waiters.append(w)
            if remaining is None and self._give_up is not None:
                watch = watch or self._give_up.watch()  # only once a wait blocks
                wait_s = watch.next_check()
            else:
                wait_s = -1 if remaining is None else remaining
            # released by _wake_all; on a timeout the loop above re-checks and raises
            if not w.acquire(timeout=wait_s):
                with self._lock:
                    if self._waiters is not None and w in self._waiters:
                        self._waiters.remove(w)
                stalled = watch is not None and watch.stalled()

    await_durable = wait


class WriteHandle:
    """Returned by produce() / ingest()."""

    __slots__ = ("watcher",)

    def __init__(self, watcher: DurabilityWatcher | None = None) -> None:
        self.watcher = watcher or DurabilityWatcher()

    @overload
    def wait(
        self, durability: Literal[Durability.REMOTE] = ..., timeout: float | None = None
    ) -> RemoteOutcome: ...

    @overload
    def wait(self, durability: Durability, timeout: float | None = None) -> WriteOutcome: ...

    def wait(
        self, durability: Durability = Durability.REMOTE, timeout: float | None = None
    ) -> WriteOutcome:
        """Block until ``durability`` is reached (REMOTE: its outcome names the entry found
        in the manifest); raises TimeoutError or the write's failure."""
        return self.watcher.wait(durability, timeout)

    def result(self) -> RemoteOutcome | None:
        return self.watcher.result()
