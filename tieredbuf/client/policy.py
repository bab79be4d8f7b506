"""What a service producer does with an answer: decisions only (no I/O, no clock).

* **Which answers are retried.**  200 is done.  408 and 429 (the service or a proxy
  asks to come back), 409 (the same ``Idempotency-Key`` is still in flight elsewhere),
  500, 502, 503 and 504, and any other 5xx, are retried under the same key.  Every
  other 4xx (and a 3xx: redirects are not followed) is a refusal: retrying the same
  bytes would be refused again.
* **How long to wait.**  ``Retry-After`` (seconds or an HTTP date) is honoured, capped
  at ``max_retry_after``, plus up to 20 % of jitter on top (never sooner than asked);
  otherwise full-jitter exponential backoff (:func:`tieredbuf.runtime.retry.backoff_delay`).
* **Where to.**  :class:`EndpointPicker`: each request starts at the next endpoint in
  turn, so a client spreads its requests over the instances; an endpoint that failed
  rests for the attempt's delay, and the retry goes to the next endpoint that is not
  resting (failover), or waits for the first to be back.
* **Could it have landed.**  An answer that is not a clean refusal -- 409, a 5xx but a
  503 that says it staged nothing (backpressure, draining, starting, too many
  connections), no answer after the whole request was sent -- leaves the request's
  outcome unknown: the service may have stored it.  Every later attempt then says so
  (``X-Tieredbuf-Retry: 1``), and the service answers it from the first request (its
  own table, or the queue, where the key's tag travels with the records) instead of
  storing it again, or 409 while no instance can tell.
"""

from __future__ import annotations

import enum
import random
import threading
from email.utils import parsedate_to_datetime

from tieredbuf.config import RetryConfig
from tieredbuf.runtime.retry import backoff_delay


class Verdict(enum.Enum):
    DONE = "done"
    RETRY = "retry"
    REFUSED = "refused"


RETRIED_4XX = frozenset({408, 409, 429})
NOT_STAGED_503 = ("backpressure", "draining", "not accepting writes", "too many connections")
"""How a 503 that refused the request before staging it begins its ``error``."""
RETRY_AFTER_JITTER = 0.2


def verdict(status: int) -> Verdict:
    if 200 <= status < 300:
        return Verdict.DONE
    if status in RETRIED_4XX or status >= 500:
        return Verdict.RETRY
    return Verdict.REFUSED


def may_have_landed(status: int, error: str = "") -> bool:
    """Whether a request answered ``status`` (``error``: the answer's own words) may have
    been stored by the service: a 5xx or a 409, but not a 503 that says it refused the
    request before staging it (at a cap, draining, starting, too many connections)."""
    if status == 503 and error.startswith(NOT_STAGED_503):
        return False
    return status >= 500 or status == 409


def retry_after_s(value: str | None, now_wall: float) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP date, RFC
    9110 section 10.2.3), None when absent or unreadable."""
    if value is None:
        return None
    v = value.strip()
    if v.isdigit():
        return float(int(v))
    try:
        when = parsedate_to_datetime(v)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - now_wall)


def retry_delay(
    retry: RetryConfig,
    attempt: int,
    retry_after: float | None,
    max_retry_after: float,
    rng: random.Random | None = None,
) -> float:
    """Seconds before retry number ``attempt`` (0-based) of one request."""
    if retry_after is not None:
        base = min(retry_after, max_retry_after)
        return base + (rng or random).uniform(0.0, max(0.05, base * RETRY_AFTER_JITTER))
    return backoff_delay(retry, attempt, rng)


class EndpointPicker:
    """Which endpoint the next attempt goes to (thread-safe; time is passed in)."""

    def __init__(self, count: int, start: int = 0) -> None:
        if count < 1:
            raise ValueError("at least one endpoint")
        self._lock = threading.Lock()
        self._rest_until = [0.0] * count
        self._next = start % count

    @property
    def count(self) -> int:
        return len(self._rest_until)

    def first(self) -> int:
        """Where a new request starts: the next endpoint in turn."""
        with self._lock:
            i = self._next
            self._next = (i + 1) % len(self._rest_until)
            return i

    def pick(self, preferred: int, now: float) -> tuple[int, float]:
        """The first endpoint from ``preferred`` on that is not resting at ``now``
        (and 0.0), else the one back first and how long until it is."""
        with self._lock:
            n = len(self._rest_until)
            for k in range(n):
                i = (preferred + k) % n
                if self._rest_until[i] <= now:
                    return i, 0.0
            i = min(range(n), key=lambda j: self._rest_until[j])
            return i, self._rest_until[i] - now

    def failed(self, index: int, now: float, delay: float) -> None:
        """Endpoint ``index`` failed an attempt at ``now``: it rests ``delay`` seconds."""
        with self._lock:
            self._rest_until[index] = max(self._rest_until[index], now + delay)

    def succeeded(self, index: int) -> None:
        with self._lock:
            self._rest_until[index] = 0.0
