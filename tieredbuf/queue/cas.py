"""The one fenced-CAS primitive: every object tieredbuf overwrites goes through :func:`run`.

The root manifest, the subscribers' progress objects and the registry inside the root
are written the same way (slatedb's ``FenceableTransactionalObject`` and pyiceberg's
commit are the models)::

    read --> fence? --> landed? --> decide --> write (If-Match / If-None-Match)
      ^                    |           |          |
      |                 result      Skip:      ok: done(decision, etag)
      |                              result       |
      +--- back off <-- conflict / outcome unknown / transient error / Replan

* **read** the object's current state and version (an absent object has none: the
  write creates it).  Transient read errors are retried with the same back-off.
* **fence** (optional) raises :class:`~tieredbuf.errors.FencedError` when a newer
  writer owns the object (its epoch moved): nothing this writer decides lands.
* **landed** (optional) runs on every re-read after a failed write: a write whose
  response was lost (obstore retries a PUT, so a landed If-Match comes back as a
  precondition failure) is recognised from the state, and the primitive returns the
  result of **that attempt's decision** -- what it leased, refused, expired, numbered
  -- never one rebuilt from the state alone (I2).
* **decide** turns the state into a :class:`Write` (the bytes, or a builder that may
  write other objects first, and the decision they carry) or a :class:`Skip` (nothing
  to write: already done).  It may raise :class:`Replan` to re-read and decide again.
* **write** is one conditional PUT.  A permanent store error (credentials, access,
  bucket) is raised at once; a conflict, an unknown outcome and a transient error are
  counted, backed off (jittered exponential) and followed by a re-read.  A write the
  store refused for its rate (ThrottledError: 429, SlowDown; GCS and R2 allow about
  one write per second to one key) waits at least :data:`THROTTLE_PAUSE_S`: a retry
  within the second would be refused again, and billed.  A conflict is
  never taken as proof that the write did not land.

Errors keep pyiceberg's split: :class:`~tieredbuf.errors.ConflictError` ("lost the
race: re-read"), :class:`~tieredbuf.errors.OutcomeUnknownError` ("may have landed"),
:class:`~tieredbuf.errors.FencedError` ("a newer writer owns it").
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from tieredbuf.config import RetryConfig
from tieredbuf.errors import (
    ConflictError,
    OutcomeUnknownError,
    PermanentStoreError,
    StoreError,
    ThrottledError,
    TieredBufError,
)
from tieredbuf.runtime.retry import RetryLog, backoff_delay, give_up_or_log
from tieredbuf.runtime.stats import Stats

THROTTLE_PAUSE_S = 1.0
"""Least wait after the store refused a write for its request rate (ThrottledError)."""

T = TypeVar("T")
"""The decoded state of the object."""
D = TypeVar("D")
"""What one attempt decided (kept, so a landed attempt's result is its own)."""
R = TypeVar("R")
"""What :func:`run` returns."""


@dataclass(frozen=True, slots=True)
class Read(Generic[T]):
    """The object as read: its state and version (``None``: it does not exist yet)."""

    state: T
    etag: str | None


@dataclass(frozen=True, slots=True)
class Write(Generic[D]):
    """Write ``data`` (or what the builder returns; it may write other objects first and
    may raise :class:`Replan` or :class:`Unchanged`) carrying ``decision``."""

    data: bytes | Callable[[], bytes]
    decision: D


@dataclass(frozen=True, slots=True)
class Skip(Generic[R]):
    """Nothing to write: return ``result``."""

    result: R


class Replan(Exception):
    """Re-read and decide again (after the back-off); ``why`` names the stat counted."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Unchanged(Exception):
    """A builder found there is nothing to write after all: :func:`run` returns
    ``result`` without writing."""

    def __init__(self, result: object = None) -> None:
        super().__init__("nothing to write")
        self.result = result


class CasObject(Protocol[T]):
    """How to read and conditionally write one object."""

    def read(self) -> Read[T]: ...

    def write(self, data: bytes, etag: str | None) -> str:
        """Create (``etag`` None: If-None-Match) or replace-if-match; the new etag."""
        ...


@dataclass(frozen=True, slots=True)
class Retries:
    """How a CAS loop backs off: ``retry``'s jittered exponential delays, slept with
    ``sleep`` (an interruptible sleep stops a closing role), at most ``limit`` retries
    (None: until it succeeds, fails permanently, or ``sleep`` raises)."""

    retry: RetryConfig
    sleep: Callable[[float], None]
    limit: int | None = None
    log: RetryLog | None = None
    """Where store failures are logged (once per interval); with it, a direct call (not a
    background loop, :func:`~tieredbuf.runtime.retry.in_background`) gives up after
    ``retry.give_up_after``, raising the last store error."""
    conflict_delay: Callable[[int], float] | None = None
    """Seconds to sleep after a lost race before retry ``n`` (None: ``retry``'s back-off).
    Peers that write one object all the time (a work queue's workers) spread their
    retries over as many CAS times as there are peers: the exponential back-off either
    keeps them in step (all re-read after the winner's write, all write again, one wins)
    or grows one loser's pause to seconds while the others go on winning."""


def run(
    obj: CasObject[T],
    decide: Callable[[Read[T], int], Write[D] | Skip[R]],
    done: Callable[[D, str], R],
    *,
    retries: Retries,
    stats: Stats,
    fence: Callable[[T], None] | None = None,
    landed: Callable[[Read[T], Sequence[D]], R | None] | None = None,
    first: Read[T] | None = None,
    stat_prefix: str = "",
    what: str = "CAS",
) -> R:
    """Read, decide and conditionally write ``obj`` until one write lands, nothing is left
    to write, or a permanent error, a fence or the retry limit stops it.

    ``decide(read, attempt)`` and ``done(decision, etag)`` as in the module docstring;
    ``landed(read, tried)`` is given every decision written so far (oldest first) after a
    failed write and returns the result of the one the state shows landed, or None.
    ``first``: the state to decide the first attempt from without reading (a lone
    writer's optimistic CAS; a stale one only fails that write).  Stats are counted as
    ``<stat_prefix>conflicts``, ``unknown_outcomes``, ``transient_errors``, ``retries``
    and ``permanent_errors``.
    """
    tried: list[D] = []
    attempt = 0
    current = first if first is not None else _read(obj, retries, stats, stat_prefix, what)
    while True:
        if fence is not None:
            fence(current.state)
        if tried and landed is not None:
            found = landed(current, tried)
            if found is not None:
                stats.incr(f"{stat_prefix}found_landed")
                return found
        err: StoreError | None
        try:
            step = decide(current, attempt)
            if isinstance(step, Skip):
                return step.result
            data = step.data() if callable(step.data) else step.data
            tried.append(step.decision)
            etag = obj.write(data, current.etag)
            if attempt and retries.log is not None:
                retries.log.recovered(what)
            return done(step.decision, etag)
        except Unchanged as u:
            return u.result  # type: ignore[return-value]  # a builder of an R-returning run
        except PermanentStoreError:
            stats.incr(f"{stat_prefix}permanent_errors")
            raise  # credentials, access, bucket: retrying cannot help (stop, never spin)
        except Replan as r:
            why, err = r.why, None
        except ConflictError:
            why, err = "conflicts", None
        except OutcomeUnknownError as e:
            why, err = "unknown_outcomes", e
        except ThrottledError as e:
            why, err = "throttled", e
        except StoreError as e:
            why, err = "transient_errors", e
        _pause(retries, stats, stat_prefix, attempt, why, what, err)
        attempt += 1
        current = _read(obj, retries, stats, stat_prefix, what, attempt)


def _pause(
    retries: Retries,
    stats: Stats,
    prefix: str,
    attempt: int,
    why: str,
    what: str,
    error: StoreError | None = None,
) -> None:
    stats.incr(f"{prefix}{why}")
    stats.incr(f"{prefix}retries")
    if retries.limit is not None and attempt >= retries.limit:
        raise TieredBufError(f"{what} gave up after {attempt} retries ({why})")
    if why == "conflicts" and retries.conflict_delay is not None:
        delay = retries.conflict_delay(attempt)
    else:
        delay = backoff_delay(retries.retry, attempt)
    if why == "throttled":
        delay = max(delay, random.uniform(THROTTLE_PAUSE_S, 1.5 * THROTTLE_PAUSE_S))
    if retries.log is not None:
        give_up_or_log(retries.retry, attempt, error, delay, retries.log, what)
    retries.sleep(delay)


def _read(
    obj: CasObject[T], retries: Retries, stats: Stats, prefix: str, what: str, attempt: int = 0
) -> Read[T]:
    while True:
        try:
            return obj.read()
        except PermanentStoreError:
            stats.incr(f"{prefix}permanent_errors")
            raise
        except StoreError as e:
            _pause(retries, stats, prefix, attempt, "transient_errors", what, e)
            attempt += 1
