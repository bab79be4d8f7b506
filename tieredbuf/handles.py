"""WriteHandle / DurabilityWatcher: how a caller learns its data is durable."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import IntEnum


class Durability(IntEnum):
    """How far a write has got.  REMOTE implies LOCAL."""

    LOCAL = 1
    """fdatasync has returned for the bytes in the producer's WAL (staged producers).
    A stateless producer has no local copy: LOCAL is reached together with REMOTE."""
    REMOTE = 2
    """The data object is in the store and its entry is in the queue manifest."""


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """Where a produce() call's records ended up (set once REMOTE)."""

    sequence: int | None
    """Manifest sequence of the entry holding the records (None if unknown after a restart)."""
    location: str | None
    """Object key of the data object."""
    durability: Durability


class DurabilityWatcher:
    """Observe or await a write's durability (RFC 0001's DurabilityWatcher)."""

    __slots__ = ("_cond", "_error", "_level", "_outcome")

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._level = 0
        self._outcome: WriteOutcome | None = None
        self._error: BaseException | None = None

    # producer side
    def _reach(self, level: Durability, outcome: WriteOutcome | None = None) -> None:
        with self._cond:
            if level > self._level:
                self._level = int(level)
                if outcome is not None:
                    self._outcome = outcome
                self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None and self._level < Durability.REMOTE:
                self._error = error
                self._cond.notify_all()

    # caller side
    @property
    def level(self) -> Durability | None:
        with self._cond:
            return Durability(self._level) if self._level else None

    def result(self) -> WriteOutcome | None:
        """None while not yet REMOTE; the outcome once it is; raises the failure if it failed."""
        with self._cond:
            if self._error is not None:
                raise self._error
            return self._outcome if self._level >= Durability.REMOTE else None

    def wait(
        self, durability: Durability = Durability.REMOTE, timeout: float | None = None
    ) -> WriteOutcome:
        """Block until ``durability`` is reached; raises TimeoutError or the write's failure."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._error is not None or self._level >= durability, timeout
            )
            if self._error is not None:
                raise self._error
            if not ok:
                raise TimeoutError(f"write not {durability.name} after {timeout} s")
            return self._outcome or WriteOutcome(None, None, Durability(self._level))

    await_durable = wait


class WriteHandle:
    """Returned by produce() / ingest()."""

    __slots__ = ("watcher",)

    def __init__(self, watcher: DurabilityWatcher | None = None) -> None:
        self.watcher = watcher or DurabilityWatcher()

    def wait(
        self, durability: Durability = Durability.REMOTE, timeout: float | None = None
    ) -> WriteOutcome:
        return self.watcher.wait(durability, timeout)

    def result(self) -> WriteOutcome | None:
        return self.watcher.result()
