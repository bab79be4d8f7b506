"""The service producer: the producer API over ``tieredbuf serve``.

``produce()`` adds the call to the open batch and returns a :class:`WriteHandle`.  A
batch is cut when it is ``flush_interval`` old, before a call would take it past
``flush_size_bytes`` or ``max_request_records``, when it holds half of a backpressure
budget, on ``flush()`` and ``close()``, and before a call with other metadata (the
service takes one metadata payload per request, below).  Up to ``max_in_flight``
sender threads each take a cut batch and send it as one ``POST /v1/produce`` (its
records length-prefixed, as the RFC's batch framing), retried under one
``Idempotency-Key`` until an answer decides it (:mod:`tieredbuf.client.request`).
While every sender is out the open batch keeps filling, so under load the requests
grow rather than multiply.

A handle reaches LOCAL and REMOTE when the answer names the entry that holds its
records (``sequence`` and ``object``): its :class:`RemoteOutcome` (I10).  Several
calls sent in one request share that entry.  Backpressure: ``produce()`` blocks while
``max_buffered_inputs`` calls or ``max_buffered_bytes`` bytes are not answered yet.

**Metadata.** The service stores one metadata payload per request (the
``X-Tieredbuf-Metadata`` header), so consecutive calls with the same metadata share a
request and, in the queue, one metadata item at the first of their records; a call
with other metadata starts another request.  A header carries UTF-8 text only, so
metadata must be UTF-8 without control characters or spaces at either end (what an
HTTP header keeps byte for byte), at most 4 KiB: anything else is refused at
``produce()`` with ValueError.

**Order.** A request's records stay in their order.  With ``max_in_flight=1`` (the
default) and ``durability="remote"`` each request is in the queue before the next is
sent, so calls land in the order they were made (I3); requests in flight at once may
land in either order (on different instances, surely).
"""

from __future__ import annotations

import logging
import random
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tieredbuf.client.endpoints import Endpoint, parse_endpoints
from tieredbuf.client.request import Request, Sender, Stopped, new_key
from tieredbuf.client.transport import TokenSource, Transport, tls_context
from tieredbuf.config import ServiceProducerConfig
from tieredbuf.errors import (
    BackpressureError,
    ClosedError,
    ConfigError,
    FlushTimeoutError,
    RemoteNotRequestedError,
    ServiceError,
    ServiceRefusedError,
    ServiceUnavailableError,
)
from tieredbuf.produce.handles import Durability, DurabilityWatcher, WriteHandle
from tieredbuf.produce.producer import as_records
from tieredbuf.runtime.forks import ForkGuard, stop_at_exit
from tieredbuf.runtime.stats import Stats

log = logging.getLogger(__name__)

MAX_METADATA_BYTES = 4096
_LEN = struct.Struct("<I")
ABORT_SETTLE_S = 2.0
"""A close() that ran out of time waits this much longer, at most, for the senders to
fail the handles of the requests they had out (their sockets are shut: it takes ms)."""
STOPPING_STATUSES = frozenset({401, 403})
"""Refusals every later request would meet too: the producer stops (as a direct
producer does on a permanent store error)."""


def header_metadata(metadata: object) -> bytes:
    """``metadata`` as the bytes the service will store, or ValueError (TypeError) when
    an HTTP header cannot carry it unchanged."""
    if not isinstance(metadata, (bytes, bytearray, memoryview)):
        raise TypeError(f"metadata must be bytes, got {type(metadata).__name__}")
    meta = bytes(metadata)
    if not meta:
        return meta
    if len(meta) > MAX_METADATA_BYTES:
        raise ValueError(
            f"metadata of {len(meta)} bytes: through the service it travels in an HTTP "
            f"header, at most {MAX_METADATA_BYTES} bytes"
        )
    try:
        meta.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"metadata is not UTF-8 (byte {e.start}): through the service it travels in an "
            "HTTP header, which carries UTF-8 text"
        ) from None
    bad = next((i for i, b in enumerate(meta) if b < 0x20 or b == 0x7F), None)
    if bad is not None:
        raise ValueError(
            f"metadata holds control character 0x{meta[bad]:02x} at byte {bad}: an HTTP "
            "header cannot carry it"
        )
    if meta[:1] == b" " or meta[-1:] == b" ":
        raise ValueError("metadata starts or ends with a space, which an HTTP header drops")
    return meta


@dataclass
class _Batch:
    records: list[bytes] = field(default_factory=list)
    metadata: bytes = b""
    watchers: list[DurabilityWatcher] = field(default_factory=list)
    size: int = 0
    opened: float = 0.0


def _body(records: Sequence[bytes]) -> bytes:
    parts: list[bytes] = []
    for r in records:
        parts.append(_LEN.pack(len(r)))
        parts.append(r)
    return b"".join(parts)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class ServiceProducer:
    """Writes through ``tieredbuf serve`` (one or several instances); thread-safe.  A
    :class:`~tieredbuf.produce.api.RecordProducer`, like ``buf.producer()``."""

    def __init__(
        self, urls: str | Sequence[str], config: ServiceProducerConfig | None = None
    ) -> None:
        self.config = cfg = config or ServiceProducerConfig()
        self.endpoints: tuple[Endpoint, ...] = parse_endpoints(urls)
        https = any(ep.scheme == "https" for ep in self.endpoints)
        if cfg.ca_file is not None and not https:
            raise ConfigError("ca_file is given but no service URL is https://")
        tokens = TokenSource(cfg.token, cfg.token_file)
        self._guard = ForkGuard("service producer")
        self.stats = Stats()
        self._stop = threading.Event()
        stop_at_exit(self._stop)
        self._transport = Transport(
            cfg.request_timeout.total_seconds(), tls_context(cfg.ca_file) if https else None
        )
        self._sender = Sender(
            self.endpoints,
            cfg,
            self._transport,
            tokens,
            self._stop,
            self.stats,
            start=random.randrange(len(self.endpoints)),
        )
        self._cond = threading.Condition()
        self._open = _Batch()
        self._ready: deque[_Batch] = deque()
        self._buffered_inputs = 0
        self._buffered_bytes = 0
        self._senders: list[threading.Thread] = []
        self._idle = 0
        self._closing = False
        self._closed = False
        self._flush_now = False
        self._error: BaseException | None = None
        self._aborted: FlushTimeoutError | None = None
        self._refused: list[ServiceError] = []

    # --- public API ----------------------------------------------------------

    def produce(
        self,
        entries: object,
        metadata: bytes = b"",
        *,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        fingerprint: bytes | None = None,
    ) -> WriteHandle:
        """Buffer ``entries`` (a list of byte records) with one ``metadata`` payload.

        Blocks under backpressure; with ``timeout`` raises BackpressureError instead of
        waiting longer.  ``idempotency_key`` and ``fingerprint`` are refused: this
        producer keys each request itself (a fresh ``Idempotency-Key``, kept for its
        retries)."""
        if idempotency_key is not None or fingerprint is not None:
            raise ValueError(
                "the service producer keys each request itself (a fresh Idempotency-Key "
                "per request, kept for its retries): give no idempotency_key or fingerprint"
            )
        records = as_records(entries)
        meta = header_metadata(metadata)
        size = sum(len(r) + 4 for r in records) + len(meta) + 16
        cfg = self.config
        handle = WriteHandle()
        with self._cond:
            self._check_open()
            ok = self._cond.wait_for(
                lambda: (
                    self._closing
                    or self._error is not None
                    or (
                        self._buffered_inputs < cfg.max_buffered_inputs
                        and (
                            self._buffered_bytes == 0
                            or self._buffered_bytes + size <= cfg.max_buffered_bytes
                        )
                    )
                ),
                timeout,
            )
            self._check_open()
            if not ok:
                self.stats.incr("backpressure_timeouts")
                raise BackpressureError(
                    f"service producer buffer full ({self._buffered_inputs} calls, "
                    f"{self._buffered_bytes} bytes not answered) for {timeout} s"
                    f"{self._why()}"
                )
            b = self._open
            if b.watchers and (
                b.metadata != meta
                or b.size + size > cfg.flush_size_bytes
                or len(b.records) + len(records) > cfg.max_request_records
            ):
                self._cut()
                b = self._open
            if not b.watchers:
                b.opened = time.monotonic()
                b.metadata = meta
            b.records.extend(records)
            b.watchers.append(handle.watcher)
            b.size += size
            self._buffered_inputs += 1
            self._buffered_bytes += size
            self.stats.incr("records_in", len(records))
            self.stats.incr("bytes_in", size)
            if self._pressing(b):
                self._cut()
            self._wake()
        return handle

    def flush(self, timeout: float | None = None) -> None:
        """Send the open batch now and wait until every call is answered.

        Raises what stopped the producer (a 401 or 403, a certificate that does not
        verify), FlushTimeoutError saying what is not answered yet (it is still
        retried), or the first refusal since the last flush (ServiceError: 400, 413,
        422, ..., or a retry that gave up) with how many calls failed."""
        self._guard.check()
        with self._cond:
            self._flush_now = True
            self._wake()
            ok = self._cond.wait_for(
                lambda: self._buffered_inputs == 0 or self._error is not None, timeout
            )
            if self._error is not None:
                raise self._error
            if not ok:
                raise FlushTimeoutError(
                    f"flush() ran out of time after {timeout} s: {self._pending()} not "
                    f"answered yet, held in this process's memory and still retried"
                    f"{self._why()}"
                )
            self._raise_refused("flush()")

    def close(self, timeout: float | None = None) -> None:
        """Send everything, wait for every answer, stop the senders.

        With ``timeout``: when it runs out, what is not answered is dropped (it is held
        in memory only), its handles fail, and FlushTimeoutError says how much; a
        request already sent may still be stored by the service.  Raises what stopped
        the producer, or the first refusal since the last flush."""
        self._guard.check()
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._wake()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._buffered_inputs == 0 or self._error is not None, _left(deadline)
            )
            if not done:
                err = FlushTimeoutError(
                    f"close() ran out of time after {timeout} s: {self._pending()} not "
                    f"answered; a service producer holds them in memory only, so they are "
                    f"dropped and their handles fail (a request already sent may still be "
                    f"stored by the service){self._why()}"
                )
                self._aborted = err
                self._fail_queued(err)
        if not done:
            self._stop.set()  # retries stop; the attempts in flight fail at once
            self._transport.abort()
            settle = time.monotonic() + ABORT_SETTLE_S  # their handles fail before we return
            for t in list(self._senders):
                t.join(max(0.0, settle - time.monotonic()))
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            raise err
        self._stop.set()
        for t in list(self._senders):
            t.join(_left(deadline))
        self._transport.close()
        with self._cond:
            self._closed = True
            if self._error is not None:
                raise self._error
            self._raise_refused("close()")

    def commit_health(self) -> str | None:
        """What keeps this producer's writes from being answered now (the last failure
        of a request being retried: a 503, an instance that does not answer, ...), or
        None."""
        return self._sender.trouble()

    def __enter__(self) -> ServiceProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- batching (under the lock) --------------------------------------------

    def _check_open(self) -> None:
        self._guard.check()
        if self._closing or self._closed:
            raise ClosedError("service producer is closed")
        if self._error is not None:
            raise self._error

    def _pending(self) -> str:
        return f"{self._buffered_inputs} produce() call(s) ({self._buffered_bytes} bytes)"

    def _why(self) -> str:
        trouble = self._sender.trouble()
        return f"; last failure: {trouble}" if trouble else ""

    def _raise_refused(self, what: str) -> None:
        refused, self._refused = self._refused, []
        if refused:
            first = refused[0]
            raise type(first)(
                f"{len(refused)} request(s) failed since the last flush, before {what}; "
                f"the first: {first}",
                status=first.status,
                may_have_landed=any(e.may_have_landed for e in refused),
            ) from first

    def _pressing(self, b: _Batch) -> bool:
        """Cut now: the batch is full, or holds half of a backpressure budget."""
        cfg = self.config
        return (
            b.size >= cfg.flush_size_bytes
            or len(b.records) >= cfg.max_request_records
            or len(b.watchers) * 2 >= cfg.max_buffered_inputs
            or b.size * 2 >= cfg.max_buffered_bytes
        )

    def _cut(self) -> None:
        if self._open.watchers:
            self._ready.append(self._open)
            self._open = _Batch()
        self._flush_now = False

    def _due(self) -> float | None:
        """Seconds until the open batch is sent (<= 0: now), None if it is empty."""
        b = self._open
        if not b.watchers:
            return None
        if self._closing or self._flush_now:
            return 0.0
        return b.opened + self.config.flush_interval.total_seconds() - time.monotonic()

    def _wake(self) -> None:
        """Wake the senders; start one more while work waits and none is idle."""
        self._cond.notify_all()
        work = bool(self._ready) or bool(self._open.watchers)
        if (
            work
            and self._idle == 0
            and len(self._senders) < self.config.max_in_flight
            and not self._stop.is_set()
        ):
            t = threading.Thread(
                target=self._send_loop, name=f"tb-service-send-{len(self._senders)}", daemon=True
            )
            self._senders.append(t)
            self._idle += 1  # counted idle until it takes work
            t.start()

    def _take(self) -> _Batch | None:
        if not self._ready:
            due = self._due()
            if due is None or due > 0:
                return None
            self._cut()
        return self._ready.popleft()

    # --- senders ---------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stop.is_set() and self._aborted is not None:
                        self._idle -= 1
                        return
                    batch = self._take() if self._error is None else None
                    if batch is not None:
                        break
                    if self._closing and not self._open.watchers and not self._ready:
                        self._idle -= 1
                        return
                    self._cond.wait(self._due())
                self._idle -= 1
                if self._ready or self._open.watchers:
                    self._wake()  # more work waits: another sender may take it
            try:
                self._send(batch)
            finally:
                with self._cond:
                    self._idle += 1
                    self._buffered_inputs -= len(batch.watchers)
                    self._buffered_bytes -= batch.size
                    self._cond.notify_all()

    def _send(self, batch: _Batch) -> None:
        cfg = self.config
        req = Request(
            _body(batch.records), len(batch.records), batch.metadata, new_key(), cfg.durability
        )
        self.stats.incr("requests")

        def local() -> None:
            for w in batch.watchers:
                w.reach(Durability.LOCAL)

        try:
            outcome = self._sender.send(req, local)
        except Stopped as e:
            err: BaseException = (
                self._error or self._aborted or FlushTimeoutError("the producer was stopped")
            )
            if e.may_have_landed:  # this one's outcome is unknown, not just unanswered
                err = ServiceUnavailableError(
                    f"{err}; this request's outcome is unknown: the service may have stored "
                    f"it (once at most)",
                    may_have_landed=True,
                )
            self._fail(batch, err)
            return
        except ServiceRefusedError as e:
            if e.status is None or e.status in STOPPING_STATUSES:
                self._die(e, batch)
                return
            self._refuse(batch, e)
            return
        except ServiceError as e:
            self._refuse(batch, e)
            return
        except BaseException as e:  # a bug: loud, and nothing is left waiting
            self._die(e, batch)
            raise
        if outcome is None:
            local()
            err = RemoteNotRequestedError(
                'sent with durability="local": the service confirmed LOCAL only'
            )
            self._fail(batch, err)
            return
        for w in batch.watchers:
            w.reach(Durability.REMOTE, outcome)
        self.stats.incr("requests_remote")

    def _fail(self, batch: _Batch, err: BaseException) -> None:
        for w in batch.watchers:
            w.fail(err)

    def _refuse(self, batch: _Batch, err: ServiceError) -> None:
        log.error("service producer: %d produce() call(s) failed: %s", len(batch.watchers), err)
        self.stats.incr("requests_failed")
        with self._cond:
            self._refused.append(err)
        self._fail(batch, err)

    def _fail_queued(self, err: BaseException) -> None:
        """Under the lock: fail every batch not taken by a sender (their budget too)."""
        queued = [*self._ready, self._open]
        self._ready.clear()
        self._open = _Batch()
        for b in queued:
            self._buffered_inputs -= len(b.watchers)
            self._buffered_bytes -= b.size
            self._fail(b, err)
        self._cond.notify_all()

    def _die(self, err: BaseException, batch: _Batch) -> None:
        log.error("service producer stopped: %s", err, extra={"tb_raised": True})
        self._fail(batch, err)
        with self._cond:
            if self._error is None:
                self._error = err
            self._fail_queued(err)
        self._stop.set()  # the requests being retried stop and fail with ``err``
