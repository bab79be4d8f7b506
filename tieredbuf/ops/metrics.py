"""Prometheus metrics for producers, consumers, buffers and GC.

    from prometheus_client import start_http_server
    import tieredbuf

    buf = tieredbuf.open("s3://bucket/prefix")
    producer = buf.producer(staging_dir="./stage")
    tieredbuf.metrics.register(producer)        # counters of the producer, its stage and exporter
    tieredbuf.metrics.register(buf)             # queue depth/bytes/age, manifest CAS counters,
                                                # store requests by operation and object kind
    start_http_server(9100)

Every collector reads the counters the roles already keep (``Stats`` and the stage's
``StageStats``) when it is scraped: nothing on the write path changes.  Names follow
the Prometheus conventions: ``_total`` for counters, ``_seconds`` and ``_bytes`` for
units.  A latency is exported as two counters, the time spent and the number of
operations (``rate(x_seconds_total) / rate(xs_total)`` is the mean), which is all the
underlying counters hold.  docs/operations.md lists every series.

:class:`Mirror` copies collectors into ``prometheus_client``'s multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``) for a server with several worker processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tieredbuf.buffer import Buffer
from tieredbuf.consume.consumer import Consumer
from tieredbuf.keys import KINDS
from tieredbuf.ops.series import (
    BUFFER_GAUGES,
    BUFFER_WIDE,
    CONSUMER_GAUGES,
    CONSUMER_SERIES,
    FANIN_SERIES,
    GC_SERIES,
    PRODUCER_SERIES,
    QUEUE_SERIES,
    STORE_ERROR_SERIES,
    SUBSCRIBER_GAUGES,
    Series,
)
from tieredbuf.produce.fanin import hub_for
from tieredbuf.produce.producer import Producer
from tieredbuf.produce.staged import StagedProducer
from tieredbuf.queue.subscribers import listing
from tieredbuf.store.counting import OPS


def _families(
    series: Iterable[Series], stats: Mapping[str, float], labels: Mapping[str, str]
) -> Iterator[Metric]:
    names, values = list(labels), list(labels.values())
    for s in series:
        if s.key not in stats and s.type != "counter":
            continue  # counters start at 0 (so rate() works); an unknown gauge is left out
        v = float(stats.get(s.key, 0)) * s.scale
        fam: CounterMetricFamily | GaugeMetricFamily
        if s.type == "counter":
            fam = CounterMetricFamily(s.name, s.doc, labels=names)
        else:
            fam = GaugeMetricFamily(s.name, s.doc, labels=names)
        fam.add_metric(values, v)
        yield fam


class StatsCollector(Collector):
    """Exposes a stats mapping (read at scrape time) through a table of :class:`Series`.

    ``reads_store``: reading the mapping sends store requests (the manifest, for queue
    gauges and consumer lag); :class:`Mirror` then reads it only for a scrape, never in
    its background loop, so an idle service sends no requests."""

    def __init__(
        self,
        read: Callable[[], Mapping[str, float]],
        series: Iterable[Series],
        labels: Mapping[str, str] | None = None,
        *,
        reads_store: bool = False,
    ) -> None:
        self._read = read
        self._series = tuple(series)
        self._labels = dict(labels or {})
        self.reads_store = reads_store

    def collect(self) -> Iterator[Metric]:
        yield from _families(self._series, self._read(), self._labels)


class _Cached:
    """Call ``fn`` at most once per ``interval`` seconds (a scrape must not hammer S3)."""

    def __init__(self, fn: Callable[[], dict[str, float]], interval: float) -> None:
        self._fn, self._interval = fn, interval
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._value: dict[str, float] = {}

    def __call__(self) -> dict[str, float]:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self._interval:
                try:
                    self._value = self._fn()
                except Exception:  # a failed read keeps the last values; never fail a scrape
                    self._value = {
                        **self._value,
                        "scrape_errors": self._value.get("scrape_errors", 0) + 1,
                    }
                self._at = now
            return dict(self._value)


def _oldest_time_ms(entry: Any) -> int | None:
    times = [m.ingestion_time_ms for m in entry.metadata] if entry is not None else []
    return min(times) if times else None


def queue_figures(queue: Any, now_ms: int | None = None) -> dict[str, float]:
    """Depth, bytes, oldest age, sequence, epoch and tree height from one root read
    (plus at most one group GET per level for the oldest entry's time)."""
    snap = queue.read()
    root = snap.root
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    head = next(iter(snap.iter_from(snap.head)), None) if snap.footer.entry_count else None
    oldest = _oldest_time_ms(head)
    levels = 1 + (max(r.level for r in root.refs) + 1 if root.refs else 0)
    return {
        "depth": snap.footer.entry_count,
        "bytes": snap.total_bytes,
        "oldest_age": 0.0 if oldest is None else max(0.0, (now - oldest) / 1000),
        "next_sequence": snap.footer.next_sequence,
        "epoch": snap.footer.epoch,
        "manifest_bytes": len(snap.view.raw),
        "tree_levels": levels,
    }


def subscriber_figures(buffer: Any, now_ms: int | None = None) -> dict[str, dict[str, float]]:
    """Per subscriber: position, lag (entries, bytes, age), lost and work-queue counts, from
    one root read plus one GET per named subscriber (``buf.subscribers()``)."""
    out: dict[str, dict[str, float]] = {}
    for info in listing(buffer.queue, now_ms):
        work = info.work or {}
        out[info.name] = {
            "next_sequence": info.next_sequence,
            "lag_entries": info.lag_entries,
            "lag_bytes": info.lag_bytes,
            "lag_seconds": info.lag_seconds or 0.0,
            "lost": info.lost + info.lost_now,
            "rejected": work.get("rejected_total", 0),
            "leases": work.get("leased", 0),
        }
    return out


class SubscriberCollector(Collector):
    """Per-subscriber gauges (label ``subscriber``), read at most every ``min_interval``.
    They read the store, so :class:`Mirror` reads them only for a scrape."""

    reads_store = True

    def __init__(
        self, buffer: Any, labels: Mapping[str, str] | None = None, min_interval: float = 5.0
    ) -> None:
        self._buffer = buffer
        self._labels = dict(labels or {})
        self._interval = min_interval
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._figures: dict[str, dict[str, float]] = {}
        self._errors = 0

    def _read(self) -> dict[str, dict[str, float]]:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self._interval:
                try:
                    self._figures = subscriber_figures(self._buffer)
                except Exception:  # a failed read keeps the last values; never fail a scrape
                    self._errors += 1
                self._at = now
            return dict(self._figures)

    def collect(self) -> Iterator[Metric]:
        figures = self._read()
        names = [*self._labels, "subscriber"]
        for s in SUBSCRIBER_GAUGES:
            fam = GaugeMetricFamily(s.name, s.doc, labels=names)
            for sub, vals in sorted(figures.items()):
                fam.add_metric([*self._labels.values(), sub], float(vals.get(s.key, 0)))
            yield fam
        errs = CounterMetricFamily(
            "tieredbuf_subscriber_scrape_errors_total",
            "Failed reads of the subscribers for these gauges.",
            labels=list(self._labels),
        )
        errs.add_metric(list(self._labels.values()), float(self._errors))
        yield errs


def consumer_figures(consumer: Any, now_ms: int | None = None) -> dict[str, float]:
    """Lag of ``consumer``: entries after its last ack, and the age of the first of them."""
    snap = consumer.queue.read()
    acked = consumer.last_acked_sequence
    start = max(snap.head, 0 if acked is None else acked + 1)
    lag = max(0, snap.footer.next_sequence - start)
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    first = next(iter(snap.iter_from(start)), None) if lag else None
    oldest = _oldest_time_ms(first)
    return {
        "lag_sequences": lag,
        "lag_seconds": 0.0 if oldest is None else max(0.0, (now - oldest) / 1000),
    }


class RequestCollector(Collector):
    """A buffer's store requests by operation and object kind (``store/counting.py``):
    ``tieredbuf_store_requests_total{op,kind}`` and the refused conditional PUTs among
    them, ``tieredbuf_store_conflicts_total{kind}``.  Every (op, kind) pair is exported
    from the start, at 0, so ``rate()`` works from the first scrape."""

    def __init__(self, counts: Any, labels: Mapping[str, str] | None = None) -> None:
        self._counts = counts
        self._labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        snap = self._counts.snapshot()
        req = CounterMetricFamily(
            "tieredbuf_store_requests",
            "Object store requests sent, by operation (get, "
            "get_range, head, put, put_conditional, copy, list, delete) and object kind.",
            labels=[*names, "op", "kind"],
        )
        for op in OPS:
            for kind in KINDS:
                req.add_metric([*values, op, kind], float(snap.get((op, kind), 0)))
        yield req
        conflicts = self._counts.conflicts
        fam = CounterMetricFamily(
            "tieredbuf_store_conflicts",
            "Conditional PUTs the store refused (lost CAS, "
            "create of an existing key), by object kind; each is also a request.",
            labels=[*names, "kind"],
        )
        for kind in KINDS:
            fam.add_metric([*values, kind], float(conflicts.get(kind, 0)))
        yield fam


class GcMetrics(Collector):
    """Totals over :func:`tieredbuf.ops.gc.run_once` reports; call :meth:`observe` after each."""

    def __init__(self, labels: Mapping[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._labels = dict(labels or {})
        self._totals: dict[str, float] = {}

    def observe(self, report: Any, duration_s: float, now: float | None = None) -> None:
        with self._lock:
            t = self._totals
            for key in (
                "listed",
                "deleted",
                "groups_deleted",
                "failed",
                "candidates",
                "groups_read",
            ):
                t[key] = t.get(key, 0) + getattr(report, key, 0)
            t["requests"] = t.get("requests", 0) + sum(getattr(report, "requests", {}).values())
            t["runs"] = t.get("runs", 0) + 1
            t["last_run"] = time.time() if now is None else now
            t["last_duration"] = duration_s
            t["last_failed"] = report.failed

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            t = dict(self._totals)
        yield from _families(GC_SERIES, t, self._labels)


def collector_for(
    obj: Any, labels: Mapping[str, str] | None = None, *, min_interval: float = 5.0
) -> Collector:
    """The collector for a producer (staged or stateless), a consumer or a buffer."""
    if isinstance(obj, StagedProducer):
        return _Multi(
            [
                StatsCollector(lambda: obj.stats, PRODUCER_SERIES, labels),
                StatsCollector(
                    obj.exporter.stats.snapshot,
                    STORE_ERROR_SERIES,
                    {**(labels or {}), "role": "exporter"},
                ),
            ]
        )
    if isinstance(obj, Producer):
        return _Multi(
            [
                StatsCollector(obj.stats.snapshot, PRODUCER_SERIES, labels),
                StatsCollector(
                    obj.stats.snapshot, STORE_ERROR_SERIES, {**(labels or {}), "role": "producer"}
                ),
            ]
        )
    if isinstance(obj, Consumer):
        lag = _Cached(lambda: consumer_figures(obj), min_interval)
        return _Multi(
            [
                StatsCollector(obj.stats.snapshot, CONSUMER_SERIES, labels),
                StatsCollector(lag, CONSUMER_GAUGES, labels, reads_store=True),
            ]
        )
    if isinstance(obj, Buffer):
        figures = _Cached(lambda: queue_figures(obj.queue), min_interval)
        return _Multi(
            [
                StatsCollector(obj.queue.stats.snapshot, QUEUE_SERIES, labels),
                StatsCollector(hub_for(obj.store, obj.queue).stats.snapshot, FANIN_SERIES, labels),
                StatsCollector(figures, BUFFER_GAUGES, labels, reads_store=True),
                RequestCollector(obj.requests, labels),
                SubscriberCollector(obj, labels, min_interval),
            ]
        )
    raise TypeError(f"no tieredbuf metrics for {type(obj).__name__}")


class _Multi(Collector):
    def __init__(self, parts: list[Collector]) -> None:
        self._parts = parts

    @property
    def parts(self) -> list[Collector]:
        return list(self._parts)

    def collect(self) -> Iterator[Metric]:
        for p in self._parts:
            yield from p.collect()


def register(
    obj: Any,
    registry: CollectorRegistry | None = None,
    *,
    labels: Mapping[str, str] | None = None,
    min_interval: float = 5.0,
) -> Collector:
    """Register ``obj``'s metrics (producer, consumer or buffer) in ``registry``.

    ``labels`` are constant labels on every series (e.g. ``{"producer": "a"}`` when a
    process registers two producers).  Gauges that read the manifest (queue depth,
    consumer lag) re-read it at most every ``min_interval`` seconds.  Returns the
    collector (``registry.unregister(c)`` removes it).
    """
    c = collector_for(obj, labels, min_interval=min_interval)
    (REGISTRY if registry is None else registry).register(c)
    return c


def _flat(c: Collector) -> list[Collector]:
    return [x for p in c.parts for x in _flat(p)] if isinstance(c, _Multi) else [c]


class Mirror:
    """Copies collectors into native metrics, for prometheus_client's multiprocess mode.

    Multiprocess mode aggregates only values written by ``Counter``/``Gauge`` objects
    (to files under ``PROMETHEUS_MULTIPROC_DIR``), not custom collectors.  ``sync()``
    reads each collector and adds the counters' increase since the last sync (so the
    sum over workers is right, dead workers' counts included) and sets the gauges
    (summed over live workers; the buffer-wide ones report the most recent value).
    """

    def __init__(self, collectors: Iterable[Collector]) -> None:
        self._collectors = [c for top in collectors for c in _flat(top)]
        self._lock = threading.Lock()
        self._native: dict[str, Counter | Gauge] = {}
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def _metric(self, fam: Metric, labelnames: tuple[str, ...]) -> Counter | Gauge:
        m = self._native.get(fam.name)
        if m is None:
            if fam.type == "counter":
                m = Counter(fam.name, fam.documentation, labelnames, registry=None)
            else:
                if fam.name in BUFFER_WIDE:
                    m = Gauge(
                        fam.name,
                        fam.documentation,
                        labelnames,
                        registry=None,
                        multiprocess_mode="livemostrecent",
                    )
                else:
                    m = Gauge(
                        fam.name,
                        fam.documentation,
                        labelnames,
                        registry=None,
                        multiprocess_mode="livesum",
                    )
            self._native[fam.name] = m
        return m

    def sync(self, *, scrape: bool = True) -> None:
        """Copy the collectors' values.  ``scrape=False`` (a background refresh) skips the
        collectors that would read the store: an idle process sends no requests."""
        with self._lock:
            for c in self._collectors:
                if not scrape and getattr(c, "reads_store", False):
                    continue
                for fam in c.collect():
                    for s in fam.samples:
                        if s.name.endswith("_created"):
                            continue
                        labelnames = tuple(sorted(s.labels))
                        m = self._metric(fam, labelnames)
                        child = m.labels(**s.labels) if labelnames else m
                        if isinstance(m, Counter):
                            key = (s.name, tuple(sorted(s.labels.items())))
                            delta = s.value - self._last.get(key, 0.0)
                            if delta > 0:
                                child.inc(delta)  # type: ignore[union-attr]
                                self._last[key] = s.value
                        else:
                            child.set(s.value)  # type: ignore[union-attr]
