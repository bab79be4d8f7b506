"""Idempotent produce over HTTP: the ``Idempotency-Key`` request header (the IETF httpapi
draft's name).

A request sent again with the same key and the same body -- after a lost answer, a 504,
a 503 from a draining instance -- is stored once, and answered with the first request's
result; the same key with another body is 422.  Three places tell a retry from a new
request:

1. **This worker's table** (:class:`KeyTable`): every keyed request it staged, by key,
   for ``idempotency_window_s`` (10 minutes by default).  A retry finds the first
   request here -- still in flight (it waits for it) or done (its result) -- whichever
   it is.
2. **The queue** (:mod:`tieredbuf.queue.dedupe`): a keyed call carries its key's tag
   into the manifest, so a retry that another instance took first, or this one before
   it was restarted, is found among the linked entries -- its sequence and data object
   are the answer (a documented duplicate, I10).  Only a retry the client marks as one
   (``X-Tieredbuf-Retry: 1``: an earlier attempt's outcome is unknown to it) is looked
   for there: a root read and a search of the entries since the key's time, too dear
   for every request.
3. **Neither**: a marked retry that is not in the queue yet may be in flight at another
   instance, or staged in one that died: it is answered 409 with Retry-After (stored by
   nobody here), and the client asks again until it is found or its deadline passes.
   An unmarked request is new: it is staged, with its key.

What bounds it: the table holds at most ``idempotency_keys`` keys (the oldest go
first), and the queue search finds only linked entries -- one consumed and dequeued
without retention is gone, and a marked retry of it is answered 409 until the client
gives up (it then reports the outcome unknown, never a second copy).  Retention
(``tieredbuf retention URL --max-age 2h``) keeps entries linked for hours.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tieredbuf.format import idem
from tieredbuf.produce.handles import WriteHandle

HEADER = "Idempotency-Key"
RETRY_HEADER = "X-Tieredbuf-Retry"
"""``1``: the client sent this request before and does not know what became of it."""
_KEY_RE = re.compile(r"[\x21-\x7e]{1,255}")


class BadKey(ValueError):
    """An ``Idempotency-Key`` that is not 1-255 visible ASCII characters."""


def parse_key(value: str | None) -> str | None:
    """The key a request carries, or None; BadKey when it is malformed."""
    if value is None:
        return None
    if not _KEY_RE.fullmatch(value):
        raise BadKey(f"{HEADER} must be 1-255 visible ASCII characters (no spaces)")
    return value


def fingerprint(content_type: str, metadata: bytes, body: bytes | bytearray) -> bytes:
    """What a request asks to store, as 16 bytes: its content type, metadata and body."""
    h = hashlib.sha256()
    for part in (content_type.encode(), metadata):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    h.update(body)
    return h.digest()[:16]


@dataclass
class Seen:
    """A keyed request this worker staged (or is staging: ``handle`` None until then)."""

    fingerprint: bytes
    handle: WriteHandle | None
    counts: dict[str, Any]
    at: float
    staged: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once it is staged (``handle``) or refused (gone from the table)."""


class KeyTable:
    """This worker's keyed requests, by key digest (thread-safe; bounded by count and
    age)."""

    def __init__(self, window_s: float, cap: int) -> None:
        self.window_s = window_s
        self.cap = cap
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, Seen] = OrderedDict()

    def get(self, key: str) -> Seen | None:
        with self._lock:
            self._prune()
            return self._seen.get(idem.digest(key))

    def claim(self, key: str, seen: Seen) -> Seen | None:
        """Record ``seen`` for ``key`` unless the key is there already: then the first."""
        d = idem.digest(key)
        with self._lock:
            self._prune()
            first = self._seen.get(d)
            if first is None:
                self._seen[d] = seen
            return first

    def forget(self, key: str, seen: Seen) -> None:
        """The request was not staged after all (refused): a retry is new again."""
        d = idem.digest(key)
        with self._lock:
            if self._seen.get(d) is seen:
                del self._seen[d]

    def _prune(self) -> None:
        old = time.monotonic() - self.window_s
        while self._seen and (
            len(self._seen) > self.cap or next(iter(self._seen.values())).at < old
        ):
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
