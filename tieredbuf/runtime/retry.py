"""Jittered exponential backoff ("full jitter"): never a tight retry loop."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tieredbuf.config import RetryConfig
from tieredbuf.errors import (
    OutcomeUnknownError,
    StoreError,
    StoreUnreachableError,
    TieredBufError,
    TransientStoreError,
)


def backoff_delay(retry: RetryConfig, attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to sleep before retry number ``attempt`` (0-based): U(0, min(cap, base*m^n))."""
    base = retry.initial_backoff.total_seconds()
    cap = retry.max_backoff.total_seconds()
    ceiling = min(cap, base * (retry.multiplier ** min(attempt, 64)))
    return (rng or random).uniform(ceiling / 2, ceiling) if ceiling > 0 else 0.0


_local = threading.local()


@contextmanager
def background() -> Iterator[None]:
    """While inside, this thread is a background loop (the fan-in hub, an exporter): its
    store retries go on until the loop is stopped, never give up on their own."""
    prev = getattr(_local, "background", False)
    _local.background = True
    try:
        yield
    finally:
        _local.background = prev


def in_background() -> bool:
    """True inside :func:`background`: a loop that retries until it is stopped, not a
    direct call that gives up on its own (``RetryConfig.give_up_after``)."""
    return bool(getattr(_local, "background", False))


def give_up_or_log(
    retry: RetryConfig,
    attempt: int,
    error: BaseException | None,
    retry_in: float,
    retry_log: RetryLog,
    subject: str,
) -> None:
    """Before the sleep of retry ``attempt`` of one operation on this thread (attempt 0
    starts its clock): a store ``error`` is logged at WARNING, once per interval; in a
    direct call it is raised instead once ``retry.give_up_after`` has passed since the
    operation's first retry, saying so (the message keeps the store's own words).  A
    conflict (``error`` None) is contention, not a failure: never logged, never given up."""
    now = time.monotonic()
    if attempt == 0 or getattr(_local, "since", None) is None:
        _local.since = now
    if error is None:
        return
    limit = retry.give_up_after
    waited = now - _local.since
    if limit is not None and not in_background() and waited + retry_in > limit.total_seconds():
        retry_log.failed(subject, error, None, raised=True)
        raise gave_up(error, waited, attempt + 1) from error
    retry_log.failed(subject, error, retry_in)


def gave_up(error: BaseException, seconds: float, attempts: int) -> TieredBufError:
    """``error`` (a transient store error) as the final one of a call that stopped retrying:
    the same class where its constructor takes one message, else TransientStoreError."""
    text = (
        f"{error} -- gave up after {seconds:.1f} s and {attempts} "
        f"{'attempt' if attempts == 1 else 'attempts'}"
    )
    cls = type(error)
    if cls in (StoreError, TransientStoreError, StoreUnreachableError, OutcomeUnknownError):
        return cls(text)  # type: ignore[no-any-return]
    return TransientStoreError(text)


class RetryLog:
    """Logs a retried failure at most once per ``interval`` seconds per subject, not once
    per attempt: a store that is down for an hour writes a line every ``interval``, each
    saying how many attempts failed since the last one, and one line when it recovers."""

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}
        self._failing: dict[str, int] = {}

    def failed(
        self,
        subject: str,
        error: BaseException,
        retry_in: float | None = None,
        *,
        raised: bool = False,
    ) -> bool:
        """Note a failed attempt; returns True when it was logged.  ``raised``: the error
        is also raised to a caller (the record carries ``tb_raised``, so a front end that
        prints the raised error can skip the log line)."""
        now = self._clock()
        with self._lock:
            self._failing[subject] = self._failing.get(subject, 0) + 1
            last = self._last.get(subject)
            if last is not None and now - last < self._interval:
                self._quiet[subject] = self._quiet.get(subject, 0) + 1
                return False
            self._last[subject] = now
            quiet = self._quiet.pop(subject, 0)
            total = self._failing[subject]
        more = f" ({quiet} more failed attempts since the last report)" if quiet else ""
        when = f"; retrying in {retry_in:.1f} s" if retry_in is not None else "; retrying"
        self._log.warning(
            "%s failed, attempt %d%s: %s%s",
            subject,
            total,
            more,
            error,
            when,
            extra={"tb_raised": raised},
        )
        return True

    def recovered(self, subject: str) -> None:
        """The subject succeeded: log once if it had failed, and start over."""
        with self._lock:
            n = self._failing.pop(subject, 0)
            self._last.pop(subject, None)
            self._quiet.pop(subject, None)
        if n:
            self._log.warning("%s succeeded after %d failed attempts", subject, n)


class StallWatch:
    """When a wait on background work (a producer's close, an exporter's drain) gives
    up by itself: ``limit`` seconds after the store's first failure (``failures()``
    grew) with nothing getting through (``progress()`` stood still) since -- the
    ``RetryConfig.give_up_after`` of a direct call, applied to the whole wait.  Progress
    stops the clock, so a long export that keeps moving is never cut short, and a
    healthy store that is only slow never starts it.  ``limit`` None: never."""

    def __init__(
        self,
        limit: float | None,
        progress: Callable[[], int],
        failures: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self._progress, self._failures, self._clock = progress, failures, clock
        self._seen = progress()
        self._failed = failures()
        self._since: float | None = None
        """When the store first failed since the last progress (None: it has not)."""

    def stalled(self) -> bool:
        """True ``limit`` seconds after a failure with nothing moving since."""
        if self.limit is None:
            return False
        now, moved, failed = self._clock(), self._progress(), self._failures()
        if moved != self._seen:
            self._seen, self._failed, self._since = moved, failed, None
            return False
        if failed != self._failed and self._since is None:
            self._since = now
        self._failed = failed
        return self._since is not None and now - self._since >= self.limit

    def next_check(self) -> float:
        """Seconds to wait before asking again (a fraction of the limit, at most 1 s)."""
        return 1.0 if self.limit is None else max(0.05, min(1.0, self.limit / 10))
