"""``Stats``: the thread-safe counters every role reports (conflicts, retries, ...);
``ewma``: the moving average the roles time their work with."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Stats:
    """Thread-safe counters a role reports (conflicts, retries, ...)."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    counts: dict[str, int] = field(default_factory=dict)

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def set(self, name: str, value: int) -> None:
        """A gauge: the latest value, not a count."""
        with self._lock:
            self.counts[name] = value

    def get(self, name: str) -> int:
        with self._lock:
            return self.counts.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def ewma(average: float, sample: float) -> float:
    """The moving average of how long something took: ``sample`` weighs a fifth, and the
    first sample (``average`` still 0) is taken as it is."""
    return sample if not average else 0.8 * average + 0.2 * sample
