"""One worker's HTTP application (aiohttp): ingest, health, readiness, metrics.

    POST /v1/produce?durability=local|remote   body: ndjson | u32-prefixed records | Arrow stream
    GET  /healthz      200 while the producer works; 500 with the reason while a permanent
                       store error stops its exports or fails its store check
                       (credentials, access, bucket), a corrupt staged segment is
                       quarantined, or the buffer's committer has a clock too far ahead
                       (docs/architecture.md, "Clocks")
    GET  /readyz       200 while accepting writes that can be exported; 503 while starting,
                       draining, while the stage's disk is failing (DiskFullError /
                       DiskIOError), or while the store fails permanently

The store check: one LIST under queue/ when the worker starts, then at most every
``store_check_s`` while /readyz is asked (a service nobody asks makes no request); an
export that works or fails permanently is evidence too.
    GET  /metrics      Prometheus exposition (every worker's series, multiprocess mode)

With tokens configured, every route but ServiceConfig.open_paths needs
``Authorization: Bearer <token>`` (service/auth.py: 401 without, 403 wrong).  An open
``/healthz`` or ``/readyz`` names the error's type only; the message (stage paths, the
store's endpoint and bucket) goes to requests with a valid token.

A request's body is read by the handler under ``body_timeout_s`` (408) and
``max_body_bytes`` (413), then parsed and staged on the thread pool with only the
parser holding it (so it is freed once its records are made); the connection layer
before it (timeouts for the request head, the connection cap, 400 pages that quote
nothing) is service/http.py.

Blocking work (parsing, staging) runs on a thread pool; waiting for durability
does not hold a thread: the write handle's callback wakes the request's future.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

import tieredbuf
from tieredbuf.errors import (
    BackpressureError,
    ClosedError,
    DiskError,
    PermanentStoreError,
    StoreError,
    TieredBufError,
)
from tieredbuf.ops import metrics
from tieredbuf.produce.handles import Durability, WriteHandle
from tieredbuf.runtime.redact import redact
from tieredbuf.service import auth, bodies, idempotency
from tieredbuf.service.config import ServiceConfig
from tieredbuf.service.http import REFUSED, parse_error_reason, track_requests
from tieredbuf.service.tokens import TokenSet

log = logging.getLogger(__name__)

DURABILITIES = {"local": Durability.LOCAL, "remote": Durability.REMOTE}
MIRROR_INTERVAL_S = 1.0

REQUESTS = Counter(
    "tieredbuf_http_requests", "HTTP requests by route and status code.", ["route", "code"]
)
LATENCY = Histogram(
    "tieredbuf_http_request_duration_seconds",
    "Time to answer a successful POST /v1/produce, by durability asked for.",
    ["durability"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
IDEMPOTENT = Counter(
    "tieredbuf_service_idempotent_retries",
    "Requests whose Idempotency-Key was seen before: answered from this worker's table "
    "(replayed), found in the queue (found), or 409 while unknown (unknown).",
    ["how"],
)
BACKPRESSURE = Counter(
    "tieredbuf_service_backpressure_rejections",
    "Requests answered 503 because the stage was at a cap (BackpressureError).",
)


@dataclass
class WorkerState:
    config: ServiceConfig
    index: int
    buffer: Any = None
    producer: Any = None
    ready: bool = False
    draining: bool = False
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(16, thread_name_prefix="tb-http")
    )
    mirror: metrics.Mirror | None = None
    registry: CollectorRegistry | None = None
    tokens: TokenSet | None = None
    keys: idempotency.KeyTable = field(default_factory=lambda: idempotency.KeyTable(600.0, 200_000))
    """This worker's keyed requests (``Idempotency-Key``)."""
    store_fault: BaseException | None = None
    """The permanent store error the last store check met (None: it worked)."""
    store_checked: float = -1e9
    """When (monotonic) the last store check started."""
    checking: bool = False

    def store_error(self) -> BaseException | None:
        """What stops exports now: the exporter's permanent error, else the check's."""
        p = self.producer
        err = p.exporter.error if p is not None else None
        return err if err is not None else self.store_fault

    def check_store(self) -> None:
        """One store check (a LIST under ``queue/``: :meth:`Buffer.check_store`), on the pool."""
        try:
            self.buffer.check_store()
        except PermanentStoreError as e:
            if self.store_fault is None:
                log.error("worker %d: store check failed: %s", self.index, e)
            self.store_fault = e
        except StoreError as e:  # unreachable, 5xx: staging is for this; not a verdict
            log.warning("worker %d: store check: %s", self.index, e)
        else:
            if self.store_fault is not None:
                log.warning("worker %d: store check works again", self.index)
            self.store_fault = None
        finally:
            self.checking = False

    def maybe_check_store(self) -> None:
        """Start a check on the pool if the last is older than ``store_check_s``."""
        now = time.monotonic()
        if (
            self.checking
            or self.buffer is None
            or now - self.store_checked < (self.config.store_check_s)
        ):
            return
        self.checking, self.store_checked = True, now
        self.pool.submit(self.check_store)


STATE = web.AppKey("state", WorkerState)


def _json_error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status, headers=headers)


def _stage(
    state: WorkerState,
    content_type: str,
    held: list[bytes | bytearray],
    meta: bytes,
    key: str | None = None,
    fp: bytes | None = None,
) -> tuple[WriteHandle, dict[str, Any]]:
    """Parse the whole body, then stage it in one produce()/ingest() call (thread pool).
    ``held`` is the body's only reference: taken out, it is freed once parsed."""
    cfg = state.config
    body = held.pop()
    if content_type != bodies.ARROW_STREAM:
        bodies.check_record_count(content_type, body, cfg.max_records)
        body = bytes(body)  # records are bytes; the bytearray is freed here
    parsed = bodies.parse(
        content_type, body, max_records=cfg.max_records, max_decoded=cfg.max_body_bytes
    )
    del body  # (Arrow: the batch's buffers still point into it)
    wait = cfg.backpressure_wait_s
    if isinstance(parsed, bodies.Records):
        handle = state.producer.produce(
            parsed.records, meta, timeout=wait, idempotency_key=key, fingerprint=fp
        )
        return handle, {"records": len(parsed.records)}
    handle = state.producer.ingest({0: parsed.batch}, timeout=wait)
    return handle, {"bundles": 1, "rows": parsed.batch.num_rows, "batches": parsed.batches}


async def _read_body(request: web.Request, limit: int) -> bytearray:
    """The body as sent (after any Content-Encoding, which aiohttp undoes in bounded
    steps); TooLarge as soon as it passes ``limit`` bytes.  Grown as bytes arrive (a
    client that stalls holds only what it sent), in place: no second copy."""
    out = bytearray()
    async for chunk in request.content.iter_any():
        if len(out) + len(chunk) > limit:
            raise bodies.TooLarge(f"body exceeds {limit} bytes")
        out += chunk
    return out


def _details(request: web.Request) -> bool:
    """Whether this request may read error messages that name stage paths and the
    store's endpoint: yes without tokens configured, else only with a valid token
    (an open /healthz answers anyone)."""
    tokens = request.app[STATE].tokens
    return tokens is None or tokens.check(request.headers.get("Authorization")).status == 200


def _describe(e: BaseException, details: bool) -> str:
    if details:
        return f"{type(e).__name__}: {e}"
    return f"{type(e).__name__} (details with a valid token)"


async def _durable(handle: WriteHandle, level: Durability, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def wake() -> None:
        loop.call_soon_threadsafe(done.set)

    handle.watcher.when(level, wake)
    await asyncio.wait_for(done.wait(), timeout)


async def produce(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cfg = state.config
    given = request.query.getall("durability", [])
    if len(given) > 1:
        return _json_error(400, f"durability given {len(given)} times: give it once")
    name = given[0] if given else "local"
    level = DURABILITIES.get(name)
    if level is None:
        return _json_error(400, f"unknown durability {name!r}: use local or remote")
    ctype = request.content_type if "Content-Type" in request.headers else ""
    if ctype not in bodies.CONTENT_TYPES:
        return _json_error(
            415, f"unsupported content type {ctype!r}; use one of {', '.join(bodies.CONTENT_TYPES)}"
        )
    limit = cfg.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return _json_error(413, f"body of {request.content_length} bytes exceeds {limit}")
    if not state.ready or state.draining:
        return _json_error(
            503,
            "not accepting writes (starting or draining)",
            **{"Retry-After": str(cfg.retry_after_s)},
        )
    try:
        key = idempotency.parse_key(request.headers.get(idempotency.HEADER))
    except idempotency.BadKey as e:
        return _json_error(400, str(e))
    try:  # aiohttp decodes header bytes as UTF-8, a bad byte as a lone surrogate
        meta = request.headers.get("X-Tieredbuf-Metadata", "").encode()
    except UnicodeEncodeError as e:
        return _json_error(
            400, f"X-Tieredbuf-Metadata is not UTF-8 (at position {e.start}): send its UTF-8 bytes"
        )
    try:
        async with asyncio.timeout(cfg.body_timeout_s):
            body = await _read_body(request, limit)
    except bodies.TooLarge as e:
        return _json_error(413, str(e))
    except TimeoutError:
        resp = _json_error(408, f"request body not received within {cfg.body_timeout_s:g} s")
        resp.force_close()
        return resp
    except web.RequestPayloadError as e:  # a Content-Encoding or chunk framing that breaks
        request.content.feed_eof()  # read no further (aiohttp would, and log a traceback)
        resp = _json_error(400, f"the body cannot be read: {parse_error_reason(e.__cause__)}")
        resp.force_close()
        return resp
    t0 = time.perf_counter()
    seen: idempotency.Seen | None = None
    if key is not None:
        fp = idempotency.fingerprint(ctype, meta, body)
        again = await _again(request, state, key, fp, level, name)
        if again is not None:
            return again
        seen = idempotency.Seen(fp, None, {}, time.monotonic())
        state.keys.claim(key, seen)  # on the loop: no await between the look and this
    held: list[bytes | bytearray] = [body]
    del body  # the parser's reference is then the only one
    loop = asyncio.get_running_loop()
    fp_or_none = None if seen is None else seen.fingerprint
    staged = partial(_stage, state, ctype, held, meta, key, fp_or_none)
    # staged whatever becomes of this request (a client that hangs up cancels it): a
    # retry waiting on it must learn its handle, or that it was not staged
    job = asyncio.ensure_future(loop.run_in_executor(state.pool, staged))
    if seen is not None and key is not None:
        job.add_done_callback(partial(_staged, state, key, seen))
    try:
        handle, counts = await asyncio.shield(job)
    except (bodies.BadBody, bodies.TooLarge, BackpressureError, ClosedError, DiskError) as e:
        return _refused(state, e)
    return await _answer(state, handle, counts, level, name, t0)


def _staged(
    state: WorkerState,
    key: str,
    seen: idempotency.Seen,
    job: asyncio.Future[tuple[WriteHandle, dict[str, Any]]],
) -> None:
    """A keyed request's staging ended: a retry waiting on it goes on with its handle, or
    (refused, failed) finds the key free again."""
    if job.cancelled() or job.exception() is not None:
        state.keys.forget(key, seen)
    else:
        seen.handle, seen.counts = job.result()
    seen.staged.set()


def _refused(state: WorkerState, e: Exception) -> web.Response:
    """The answer to a request not staged."""
    retry = {"Retry-After": str(state.config.retry_after_s)}
    if isinstance(e, bodies.BadBody):
        return _json_error(400, str(e))
    if isinstance(e, bodies.TooLarge):
        return _json_error(413, str(e))
    if isinstance(e, BackpressureError):
        BACKPRESSURE.inc()
        return _json_error(503, f"backpressure: {e}", **retry)
    if isinstance(e, ClosedError):
        return _json_error(503, "draining", **retry)
    # a DiskError: not stored; the stage recovers when its disk does
    return _json_error(503, f"stage disk failing: {type(e).__name__}: {e}", **retry)


async def _again(
    request: web.Request,
    state: WorkerState,
    key: str,
    fp: bytes,
    level: Durability,
    name: str,
) -> web.Response | None:
    """A keyed request sent before: its first answer (422 for another body, 409 while it
    may be in flight elsewhere); None when it is new (docs: service/idempotency.py)."""
    while (first := state.keys.get(key)) is not None:
        if first.fingerprint != fp:
            return _json_error(422, f"{idempotency.HEADER} was used for another request")
        if first.handle is None:  # the first is being staged: wait for it
            await first.staged.wait()
            continue
        IDEMPOTENT.labels("replayed").inc()
        return await _answer(state, first.handle, first.counts, level, name, time.perf_counter())
    if request.headers.get(idempotency.RETRY_HEADER) != "1":
        return None  # not a retry of something this worker does not know: new
    loop = asyncio.get_running_loop()
    found = await loop.run_in_executor(state.pool, state.buffer.find_keyed, key)
    if found is None:
        IDEMPOTENT.labels("unknown").inc()
        return _json_error(
            409,
            "a request with this Idempotency-Key may be in flight at another instance: ask "
            "again later",
            **{"Retry-After": str(state.config.retry_after_s)},
        )
    if found.fingerprint != fp:
        return _json_error(422, f"{idempotency.HEADER} was used for another request")
    IDEMPOTENT.labels("found").inc()
    return web.json_response(
        {
            "durability": name,
            "producer": state.producer.producer_id,
            "sequence": found.sequence,
            "object": found.location,
            "duplicate": True,
        }
    )


async def _answer(
    state: WorkerState,
    handle: WriteHandle,
    counts: dict[str, Any],
    level: Durability,
    name: str,
    t0: float,
) -> web.Response:
    """Wait for ``handle`` to reach ``level`` and say so (or why not)."""
    cfg = state.config
    try:
        await _durable(handle, level, cfg.remote_timeout_s)
        outcome = handle.wait(level, timeout=0)
    except TimeoutError:
        reached = handle.watcher.level
        return web.json_response(
            {
                "error": f"not {name} after {state.config.remote_timeout_s} s",
                "status": 504,
                "durability": reached.name.lower() if reached else None,
                **counts,
            },
            status=504,
        )
    except DiskError as e:  # not LOCAL: the stage's disk failed (it may still land)
        log.error("write failed: %s", e)
        return _json_error(
            503,
            f"stage disk failing: {type(e).__name__}: {e}",
            **{"Retry-After": str(state.config.retry_after_s)},
        )
    except TieredBufError as e:
        log.error("write failed: %s", e)
        return _json_error(500, redact(f"{type(e).__name__}: {e}"))
    LATENCY.labels(name).observe(time.perf_counter() - t0)
    out: dict[str, Any] = {"durability": name, **counts, "producer": state.producer.producer_id}
    if level == Durability.REMOTE:
        out["sequence"] = outcome.sequence
        out["object"] = outcome.location
    return web.json_response(out)


async def healthz(request: web.Request) -> web.Response:
    """500 with the reason while a permanent store error stops exports (writes are still
    staged; REMOTE requests fail fast) or while a corrupt segment sits quarantined in the
    stage (data loss an operator must see); 200 otherwise, naming a transient error
    being retried.  Paths and messages only for :func:`_details`."""
    state = request.app[STATE]
    details = _details(request)
    p = state.producer
    stopped = state.store_error()
    if p is not None and stopped is not None:
        body: dict[str, Any] = {
            "error": f"exports stopped: {_describe(stopped, details)}",
            "status": 500,
            "staged_segments": len(p.stage.sealed_segments()),
            "worker": state.index,
        }
        if details:
            body["stage"] = str(p.stage.path)
        return web.json_response(body, status=500)
    stalled = p.commit_health() if p is not None else None
    if stalled is not None:  # a committer's clock too far off: REMOTE writes wait
        return web.json_response(
            {"error": f"commits stalled: {stalled}", "status": 500, "worker": state.index},
            status=500,
        )
    bad = p.stage.quarantined() if p is not None else []
    if bad:
        where = (
            f": {', '.join(str(s.path) for s in bad)}" if details else " (paths with a valid token)"
        )
        return web.json_response(
            {
                "error": f"{len(bad)} corrupt staged segment(s) quarantined, their records "
                f"lost{where} (docs/failure-modes.md)",
                "status": 500,
                "worker": state.index,
            },
            status=500,
        )
    body = {"status": "ok", "worker": state.index, "pid": os.getpid()}
    if p is not None and p.exporter.last_transient_error is not None:
        body["export"] = f"retrying: {_describe(p.exporter.last_transient_error, details)}"
    return web.json_response(body)


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.ready and not state.draining:
        state.maybe_check_store()  # answers from what is known; the check runs beside
    fault = state.producer.disk_fault() if state.producer is not None else None
    stopped = state.store_error()
    if state.ready and not state.draining and fault is None and stopped is None:
        return web.json_response({"status": "ready", "worker": state.index})
    if fault is not None:  # the stage's disk is failing: writes fail until it recovers
        return _json_error(503, f"stage disk failing: {_describe(fault, _details(request))}")
    if stopped is not None:  # writes would be staged but never exported
        return _json_error(503, f"store failing: {_describe(stopped, _details(request))}")
    return _json_error(503, "draining" if state.draining else "starting")


def _exposition(state: WorkerState) -> bytes:
    if state.mirror is not None:
        state.mirror.sync()
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path)  # type: ignore[no-untyped-call]
        return bytes(generate_latest(registry))
    assert state.registry is not None
    return bytes(generate_latest(state.registry))


async def metrics_view(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = await asyncio.get_running_loop().run_in_executor(state.pool, _exposition, state)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def count_requests(request: web.Request, handler: Any) -> web.StreamResponse:
    route = request.match_info.route.resource
    name = route.canonical if route is not None else "other"
    try:
        resp: web.StreamResponse = await handler(request)
    except web.HTTPException as e:
        REQUESTS.labels(name, str(e.status)).inc()
        raise
    REQUESTS.labels(name, str(resp.status)).inc()
    return resp


async def _producer_ctx(app: web.Application) -> Any:
    """Open the buffer and this worker's staged producer; on shutdown seal, export, close."""
    state = app[STATE]
    cfg = state.config
    loop = asyncio.get_running_loop()

    def open_producer() -> None:
        state.buffer = tieredbuf.open(cfg.url, **cfg.store_options)
        state.producer = state.buffer.producer(
            staging_dir=cfg.worker_stage(state.index), **cfg.producer_kwargs()
        )
        collectors = [metrics.collector_for(state.producer), metrics.collector_for(state.buffer)]
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            state.mirror = metrics.Mirror(collectors)
        else:
            state.registry = CollectorRegistry()
            for c in [*collectors, REQUESTS, LATENCY, BACKPRESSURE, REFUSED]:
                state.registry.register(c)

    await loop.run_in_executor(state.pool, open_producer)
    state.store_checked = time.monotonic()
    await loop.run_in_executor(state.pool, state.check_store)  # before the first "ready"
    state.ready = True
    log.info(
        "worker %d ready: producer %s, stage %s",
        state.index,
        state.producer.producer_id,
        cfg.worker_stage(state.index),
    )
    mirror_task = asyncio.create_task(_mirror_loop(state)) if state.mirror else None
    yield
    state.draining = True
    if mirror_task is not None:
        mirror_task.cancel()
    try:
        await loop.run_in_executor(state.pool, state.producer.close, cfg.drain_timeout_s)
        log.info("worker %d drained: stage sealed and exported", state.index)
    except TimeoutError:
        log.error(
            "worker %d: stage not exported within %.0f s; it stays staged (LOCAL) for "
            "the next start or `tieredbuf drain`",
            state.index,
            cfg.drain_timeout_s,
        )
        app["drain_incomplete"] = True
    except TieredBufError as e:
        log.error(
            "worker %d: stage not exported (%s: %s); it stays staged (LOCAL) for the "
            "next start or `tieredbuf drain`",
            state.index,
            type(e).__name__,
            e,
        )
        app["drain_incomplete"] = True
    finally:
        if state.mirror is not None:
            await loop.run_in_executor(state.pool, partial(state.mirror.sync, scrape=False))
        state.buffer.close()
        state.pool.shutdown(wait=False)


async def _mirror_loop(state: WorkerState) -> None:
    loop = asyncio.get_running_loop()
    assert state.mirror is not None
    refresh = partial(state.mirror.sync, scrape=False)
    while True:
        await asyncio.sleep(MIRROR_INTERVAL_S)
        try:
            # counters only: the queue gauges read the manifest, so only a scrape does
            await loop.run_in_executor(state.pool, refresh)
        except Exception:
            log.exception("metrics mirror failed")


async def _seal_on_shutdown(app: web.Application) -> None:
    """Sites are closed: seal now, so requests waiting for REMOTE finish quickly."""
    state = app[STATE]
    state.draining = True
    if state.producer is not None:
        await asyncio.get_running_loop().run_in_executor(state.pool, state.producer.stage.seal_all)


def build_app(config: ServiceConfig, index: int, tokens: TokenSet | None = None) -> web.Application:
    """The worker's application; with ``tokens``, bearer authentication (service/auth.py)
    on every route but ``config.open_paths``."""
    guard = [auth.middleware(tokens, config.open_paths)] if tokens is not None else []
    app = web.Application(
        client_max_size=config.max_body_bytes, middlewares=[track_requests, count_requests, *guard]
    )
    app[STATE] = WorkerState(
        config,
        index,
        pool=ThreadPoolExecutor(config.threads, thread_name_prefix="tb-http"),
        tokens=tokens,
        keys=idempotency.KeyTable(config.idempotency_window_s, config.idempotency_keys),
    )
    app.router.add_post("/v1/produce", produce)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_view)
    app.cleanup_ctx.append(_producer_ctx)
    app.on_shutdown.append(_seal_on_shutdown)
    return app
