"""One request's life: ``POST /v1/produce`` under one ``Idempotency-Key``, attempted
until an answer decides it (:mod:`tieredbuf.client.policy` says which answers are
retried, how long after, and where).

Every attempt of a request carries the same key and the same bytes, so a retry after a
lost answer, a 504, or a SIGKILLed instance is one the service can recognise as the
same request (the ``Idempotency-Key`` header, IETF httpapi draft).  Once an attempt's
outcome is unknown the later ones say so (``X-Tieredbuf-Retry: 1``): the service
answers them from the first request, or 409 while no instance can tell, and never
stores them again; after ``unknown_outcome_for`` of that the calls fail
(ServiceUnavailableError, ``may_have_landed``).  A 200 is evidence
only when it says what was asked: the number of records sent and, for
``durability=remote``, the entry's ``sequence`` and ``object`` -- the handle is made
REMOTE from those, never from a 200 alone (I10).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ulid import ULID

from tieredbuf.client.endpoints import Endpoint
from tieredbuf.client.policy import (
    EndpointPicker,
    Verdict,
    may_have_landed,
    retry_after_s,
    retry_delay,
    verdict,
)
from tieredbuf.client.transport import SendError, TokenSource, Transport
from tieredbuf.config import ServiceProducerConfig
from tieredbuf.errors import (
    ServiceError,
    ServiceRefusedError,
    ServiceUnavailableError,
)
from tieredbuf.produce.handles import RemoteOutcome
from tieredbuf.runtime.redact import redact
from tieredbuf.runtime.stats import Stats

OCTET_STREAM = "application/octet-stream"
METADATA_HEADER = "X-Tieredbuf-Metadata"
IDEMPOTENCY_HEADER = "Idempotency-Key"
RETRY_HEADER = "X-Tieredbuf-Retry"
"""``1`` on every attempt after one whose outcome is unknown: the service then answers
from the first request (found in its table or the queue), or 409, never stores it again."""


def new_key() -> str:
    """A fresh idempotency key: a ULID (80 random bits, and the time the service starts
    its search of the queue from, for a retry that reached another instance)."""
    return str(ULID())


@dataclass(frozen=True, slots=True)
class Request:
    body: bytes
    """The records, length-prefixed (``[len: u32 LE][bytes]`` each)."""
    records: int
    metadata: bytes
    key: str
    durability: str


class Stopped(Exception):
    """The producer stopped retrying this request (its close ran out of time)."""

    def __init__(self, last: str | None, may_have_landed: bool) -> None:
        super().__init__(last or "stopped before an answer")
        self.last = last
        self.may_have_landed = may_have_landed


def error_text(body: bytes) -> str:
    """The service's own words for a refusal (its JSON ``error``), else the body's start."""
    try:
        doc = json.loads(body)
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            return redact(doc["error"][:500])
    except ValueError:
        pass
    return redact(body[:200].decode("utf-8", "replace").strip() or "(no body)")


def reached_local(body: bytes) -> bool:
    """A 504's body says the request was staged (``"durability": "local"``)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("durability") in ("local", "remote")


def read_reply(body: bytes, req: Request, where: str) -> RemoteOutcome | None:
    """The outcome a 200 proves: REMOTE with its entry, or (``durability=local``) None.
    ServiceError when it proves less than was asked (never a REMOTE without its entry)."""
    try:
        doc: Any = json.loads(body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise ServiceError(f"{where}: a 200 whose body is not a JSON object", may_have_landed=True)
    # a retry the service found in the queue ("duplicate") is answered with the first
    # request's entry, matched by its fingerprint (content type, metadata, body), not counts
    if doc.get("records") != req.records and not (
        "records" not in doc and doc.get("duplicate") is True
    ):
        raise ServiceError(
            f"{where}: answered {doc.get('records')!r} records for a request of "
            f"{req.records}: not confirmed",
            status=200,
            may_have_landed=True,
        )
    if req.durability != "remote":
        if doc.get("durability") not in ("local", "remote"):
            raise ServiceError(
                f"{where}: a 200 without the durability reached", status=200, may_have_landed=True
            )
        return None
    seq, obj = doc.get("sequence"), doc.get("object")
    if doc.get("durability") != "remote" or type(seq) is not int or seq < 0 or not obj:
        raise ServiceError(
            f"{where}: a 200 for durability=remote without the entry's sequence and object "
            f"(got durability={doc.get('durability')!r}, sequence={seq!r}, object={obj!r}): "
            "not confirmed REMOTE (I10)",
            status=200,
            may_have_landed=True,
        )
    if not isinstance(obj, str):
        raise ServiceError(
            f"{where}: object {obj!r} is not a key", status=200, may_have_landed=True
        )
    return RemoteOutcome(seq, obj)


class Sender:
    """Sends requests to the endpoints, retrying each until it is decided (thread-safe:
    one request per calling thread)."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        config: ServiceProducerConfig,
        transport: Transport,
        tokens: TokenSource,
        stop: threading.Event,
        stats: Stats,
        start: int = 0,
    ) -> None:
        self.endpoints = tuple(endpoints)
        self._config = config
        self._transport = transport
        self._tokens = tokens
        self._stop = stop
        self._stats = stats
        self._picker = EndpointPicker(len(self.endpoints), start)
        self._lock = threading.Lock()
        self._trouble: dict[str, str] = {}

    def trouble(self) -> str | None:
        """What a request being retried last met, or None while none is."""
        with self._lock:
            return next(iter(self._trouble.values()), None)

    def _note(self, key: str, text: str | None) -> None:
        with self._lock:
            if text is None:
                self._trouble.pop(key, None)
            else:
                self._trouble[key] = text

    def send(self, req: Request, on_local: Callable[[], None]) -> RemoteOutcome | None:
        """Attempt ``req`` until an answer decides it: its outcome (None for a LOCAL-only
        request), or ServiceRefusedError, ServiceError (a 200 that proves less than was
        asked), ServiceUnavailableError (``give_up_after``), Stopped."""
        try:
            return self._attempts(req, on_local)
        finally:
            self._note(req.key, None)

    def _attempts(self, req: Request, on_local: Callable[[], None]) -> RemoteOutcome | None:
        cfg = self._config
        give_up = (
            None if cfg.retry.give_up_after is None else cfg.retry.give_up_after.total_seconds()
        )
        headers: dict[str, str | bytes] = {
            "Content-Type": OCTET_STREAM,
            IDEMPOTENCY_HEADER: req.key,
        }
        if req.metadata:
            headers[METADATA_HEADER] = req.metadata
        query = f"?durability={req.durability}"
        started = time.monotonic()
        attempt = 0
        unknown_since: float | None = None
        """When an attempt's outcome first became unknown (None: none has)."""
        last: str | None = None
        status: int | None = None
        where = self._picker.first()
        while True:
            unknown = unknown_since is not None
            if self._stop.is_set():
                raise Stopped(last, unknown)
            i, wait = self._picker.pick(where, time.monotonic())
            if wait > 0:
                now = time.monotonic()
                if (give_up is not None and now - started + wait > give_up) or (
                    unknown_since is not None
                    and now - unknown_since + wait > cfg.unknown_outcome_for.total_seconds()
                ):
                    raise self._gave_up(started, attempt, last, status, unknown)
                self._stop.wait(wait)
                continue
            ep = self.endpoints[i]
            auth = self._tokens.header()
            sent = dict(headers) if auth is None else {**headers, "Authorization": auth}
            if unknown:
                sent[RETRY_HEADER] = "1"
            self._stats.incr("attempts")
            delay: float
            try:
                ans = self._transport.post(ep, ep.produce_path + query, req.body, sent)
            except SendError as e:
                if e.permanent:
                    raise ServiceRefusedError(str(e), may_have_landed=unknown) from None
                if e.sent and unknown_since is None:
                    unknown_since = time.monotonic()
                last, status = redact(str(e)), None
                self._stats.incr("attempts_unanswered")
                delay = retry_delay(cfg.retry, attempt, None, cfg.max_retry_after.total_seconds())
            else:
                self._stats.incr(f"answers_{ans.status}")
                v = verdict(ans.status)
                if v is Verdict.DONE:
                    self._picker.succeeded(i)
                    return read_reply(ans.body, req, ep.url)
                said = error_text(ans.body)
                last, status = f"{ep.url}: {ans.status} {said}", ans.status
                if v is Verdict.REFUSED:
                    raise ServiceRefusedError(last, status=status, may_have_landed=unknown)
                if ans.status == 504 and reached_local(ans.body):
                    on_local()
                if unknown_since is None and may_have_landed(ans.status, said):
                    unknown_since = time.monotonic()
                asked = retry_after_s(ans.headers.get("retry-after"), time.time())
                delay = retry_delay(cfg.retry, attempt, asked, cfg.max_retry_after.total_seconds())
            attempt += 1
            unknown = unknown_since is not None
            self._stats.incr("retries")
            self._note(req.key, f"{last} (attempt {attempt}; retrying)")
            self._picker.failed(i, time.monotonic(), delay)
            where = (i + 1) % len(self.endpoints)

    def _gave_up(
        self, started: float, attempts: int, last: str | None, status: int | None, unknown: bool
    ) -> ServiceUnavailableError:
        waited = time.monotonic() - started
        maybe = (
            "; it may have been stored (an attempt's outcome is unknown), once at most"
            if unknown
            else ""
        )
        return ServiceUnavailableError(
            f"gave up after {waited:.1f} s and {attempts} attempt(s): {last}{maybe}",
            status=status,
            may_have_landed=unknown,
        )
