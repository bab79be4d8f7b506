"""Jittered exponential backoff ("full jitter"): never a tight retry loop."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from tieredbuf.config import RetryConfig


def backoff_delay(retry: RetryConfig, attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to sleep before retry number ``attempt`` (0-based): U(0, min(cap, base*m^n))."""
    base = retry.initial_backoff.total_seconds()
    cap = retry.max_backoff.total_seconds()
    ceiling = min(cap, base * (retry.multiplier ** min(attempt, 64)))
    return (rng or random).uniform(ceiling / 2, ceiling) if ceiling > 0 else 0.0


@dataclass
class Stats:
    """Thread-safe counters a role reports (conflicts, retries, ...)."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    counts: dict[str, int] = field(default_factory=dict)

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def get(self, name: str) -> int:
        with self._lock:
            return self.counts.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)
