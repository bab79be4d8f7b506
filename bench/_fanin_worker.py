"""One producer process of bench/fanin.py: ``python bench/_fanin_worker.py CONFIG_JSON``.

It runs under whichever tieredbuf its ``PYTHONPATH`` names (this tree, or the baseline
tree of ``--baseline-tree``), so it uses only the API both have: ``tieredbuf.open``,
``Buffer.producer(flush_interval=..., manifest_writes_per_s=...)``, ``produce()``, the
handle's ``watcher.when(REMOTE, ...)`` and ``Buffer.requests``.

``threads`` producers (one thread each, one Buffer for the process) each produce one
record of ``record_bytes`` every ``period_s`` from a wall-clock start for
``warmup_s + seconds``, phase-shifted by their global index so that the N producers of
the run are spread over the period (it prints ``READY`` once its producers exist and
reads the start time from stdin).  The REMOTE latency of every record produced after
the warm-up is timed from its ``produce()`` call to its handle's REMOTE callback.  The
buffer's request counts are snapshotted at the start and the end of the measured window
(what the window cost, the root's conditional PUTs among them).  After the window it
waits up to ``drain_s`` for every handle, closes the producers and prints one JSON line.

With ``staging`` (a directory) the process runs one staged producer shared by its
threads (the local tier's deployment: one per process).  With ``service`` (a URL list)
the producers are service producers
(``tieredbuf.service_producer``) writing through ``tieredbuf serve``
(bench/fanin_service.py): the store requests are then the service's to count, and the
windows hold the producers' HTTP requests instead.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta
from typing import Any

MANIFEST = "queue/manifest"


class RootWrites:
    """Forwards to a store; notes the wall-clock times of the requests that make a
    timeline of the commits: every root write it accepted (a conditional PUT of
    ``queue/manifest`` that returned; exact rates and gaps across processes, which
    counts in a window cannot give), full root reads, footer reads and LISTs of the
    announcements (their start).  A conditional GET of the root (``get_if_changed``)
    is a root read when it answers the object, a footer read (a poll) when it answers
    304."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.times: list[float] = []
        self.root_reads: list[float] = []
        self.footer_reads: list[float] = []
        self.lists: list[float] = []

    def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> str:
        etag: str = self._inner.put(key, data, mode=mode)
        if key == MANIFEST and mode != "create":
            self.times.append(time.time())
        return etag

    def get(self, key: str) -> Any:
        got = self._inner.get(key)
        if key == MANIFEST:
            self.root_reads.append(time.time())
        return got

    def get_if_changed(self, key: str, etag: str) -> Any:
        # a conditional GET of the root: a root read when it answers the object, else a
        # poll that found it unchanged (what a footer read was before)
        got = self._inner.get_if_changed(key, etag)
        if key == MANIFEST:
            (self.footer_reads if got is None else self.root_reads).append(time.time())
        return got

    def get_suffix(self, key: str, length: int) -> Any:
        got = self._inner.get_suffix(key, length)
        if key == MANIFEST:
            self.footer_reads.append(time.time())
        return got

    def list(self, prefix: str) -> Any:
        if prefix.startswith("queue/pending"):
            self.lists.append(time.time())
        return self._inner.list(prefix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _counts(buf: Any, producers: list[Any]) -> dict[str, Any]:
    if buf is None:  # through the service: its instances count the store requests
        http = [p.stats.snapshot() for p in producers]
        return {
            "requests": [],
            "conflicts": {},
            "http_requests": sum(h.get("requests", 0) for h in http),
            "http_attempts": sum(h.get("attempts", 0) for h in http),
        }
    return {
        "requests": [[op, kind, n] for (op, kind), n in buf.requests.snapshot().items()],
        "conflicts": dict(buf.requests.conflicts),
    }


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import tieredbuf
    from tieredbuf.store import open_store

    n, threads, period = cfg["n"], cfg["threads"], cfg["period_s"]
    timed: RootWrites | None = None
    buf: Any = None
    if cfg.get("service"):  # service producers (this tree only): bench/fanin_service.py
        more = {"max_in_flight": cfg["max_in_flight"]} if cfg.get("max_in_flight") else {}
        producers = [
            tieredbuf.service_producer(
                cfg["service"], flush_interval=timedelta(milliseconds=cfg["flush_ms"]), **more
            )
            for _ in range(threads)
        ]
    elif cfg.get("staging"):  # one staged producer for the process, shared by its threads
        timed = RootWrites(open_store(cfg["url"], **cfg["store_options"]))
        buf = tieredbuf.Buffer(timed)
        staged = buf.producer(staging_dir=cfg["staging"], manifest_writes_per_s=cfg["rate"])
        producers = [staged] * threads
    else:
        timed = RootWrites(open_store(cfg["url"], **cfg["store_options"]))
        buf = tieredbuf.Buffer(timed)
        producers = [
            buf.producer(
                flush_interval=timedelta(milliseconds=cfg["flush_ms"]),
                manifest_writes_per_s=cfg["rate"],
            )
            for _ in range(threads)
        ]
    # ready: the parent sends the wall-clock start shared by every process once all are
    print("READY", flush=True)
    start = float(sys.stdin.readline())
    t_start = time.monotonic() + (start - time.time())
    t_measure = t_start + cfg["warmup_s"]
    t_end = t_measure + cfg["seconds"]
    lock = threading.Lock()
    lat: list[tuple[float, float]] = []  # (produced at, s after t_measure; latency s)
    failed: list[str] = []
    lags: list[float] = []  # how late each produce() call was against its schedule
    handles: list[tuple[float, Any]] = []
    windows: dict[str, Any] = {}

    def record(t0: float, h: Any) -> None:
        now = time.monotonic()
        try:
            h.wait(tieredbuf.Durability.REMOTE, timeout=0)
        except Exception as e:  # the write failed: counted, never a latency
            with lock:
                failed.append(repr(e)[:200])
            return
        with lock:
            lat.append((t0 - t_measure, now - t0))

    def run(i: int) -> None:
        p = producers[i]
        phase = (cfg["first_index"] + i) / n * period
        rec = (f"{cfg['name']}-{i}:".encode() + b"x" * cfg["record_bytes"])[: cfg["record_bytes"]]
        k = 0
        while True:
            at = t_start + phase + k * period
            if at >= t_end:
                return
            k += 1
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            t0 = time.monotonic()
            h = p.produce([rec])
            if t0 >= t_measure:
                with lock:
                    lags.append(t0 - at)
                    handles.append((t0, h))
                h.watcher.when(tieredbuf.Durability.REMOTE, lambda t0=t0, h=h: record(t0, h))

    def snapshot_at(name: str, at: float) -> None:
        delay = at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        windows[name] = {"t": time.monotonic(), "wall": time.time(), **_counts(buf, producers)}

    snaps = [
        threading.Thread(target=snapshot_at, args=(name, at), daemon=True)
        for name, at in (("begin", t_measure), ("end", t_end))
    ]
    workers = [
        threading.Thread(target=run, args=(i,), name=f"producer-{i}") for i in range(threads)
    ]
    for t in (*snaps, *workers):
        t.start()
    for t in workers:
        t.join()
    for t in snaps:
        t.join(timeout=cfg["seconds"] + 60)
    deadline = time.monotonic() + cfg["drain_s"]
    unresolved: list[float] = []  # produced at (s after t_measure) of writes never REMOTE
    for t0, h in handles:
        try:
            h.wait(tieredbuf.Durability.REMOTE, timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            unresolved.append(t0 - t_measure)
        except Exception:  # counted by its callback
            pass
    gave_up = time.monotonic()
    hub: dict[str, Any] = {}
    try:  # this tree only: the fan-in hub's counters (commits, lists, announcements, ...)
        from tieredbuf.produce.fanin import hub_for

        if buf is not None:
            hub = hub_for(buf.store, buf.queue).stats.snapshot()
    except ImportError:
        pass
    closed = time.monotonic()
    for p in {id(p): p for p in producers}.values():
        try:
            p.close(timeout=cfg["close_s"])
        except Exception as e:  # a close that timed out is reported, not fatal here
            failed.append(f"close: {e!r}"[:200])
    print(
        json.dumps(
            {
                "index": cfg["index"],
                "threads": threads,
                "latency": lat,
                "failed": failed,
                "unresolved": unresolved,
                "unresolved_waited_s": [gave_up - t_measure - t for t in unresolved],
                "schedule_lag_s": sorted(lags)[int(0.99 * (len(lags) - 1))] if lags else None,
                "window_s": windows["end"]["t"] - windows["begin"]["t"]
                if len(windows) == 2
                else None,
                "begin": windows.get("begin"),
                "end": windows.get("end"),
                "close_s": time.monotonic() - closed,
                "hub": hub,
                "root_writes": timed.times if timed else [],
                "root_reads": timed.root_reads if timed else [],
                "footer_reads": timed.footer_reads if timed else [],
                "lists": timed.lists if timed else [],
            }
        ),
        flush=True,
    )
    if buf is not None:
        buf.close()


if __name__ == "__main__":
    main()
