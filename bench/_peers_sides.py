"""The sides of bench/peers.py: one adapter per system, run inside a worker process.

Each adapter opens its system on one store ("local": a directory on this disk;
"moto": a moto S3 server over HTTP on loopback) and offers three ways to drive it:

* ``throughput``: ``threads`` threads (or asyncio tasks) call the system's write API
  with ``batch`` records per call until the deadline or the byte budget, each keeping
  at most ``window`` calls in flight where the API is asynchronous; the clock stops at
  the last ack of each level (see ``LEVELS``).
* ``latency``: one call of one record at a time on a steady schedule; each call's
  put -> ack time.
* ``probe``: ``n`` calls of one record, each awaited, for the strace durability check.

An adapter reports time as ``time.monotonic()`` (system-wide on Linux, so the driver
can compare workers' clocks). Nothing here is imported by tieredbuf.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

MiB = 1 << 20

#: Ack levels each system reports.  A tieredbuf staged producer reports both.
LEVELS: dict[str, tuple[str, ...]] = {
    "persist-queue": ("ack",),
    "slatedb": ("ack",),
    "slatedb-memmove": ("ack",),
    "deltalake": ("ack",),
    "tieredbuf-direct": ("ack",),
    "tieredbuf-staged": ("LOCAL", "REMOTE"),
}


def records_for(worker: int, thread: int, batch: int, size: int) -> list[bytes]:
    """One call's records (distinct per worker/thread/position), reused for every call."""
    pad = os.urandom(size)
    head = f"{worker:02d}{thread:02d}".encode()
    return [(head + j.to_bytes(4, "big") + pad)[:size] for j in range(batch)]


def schedule(rate: float, seconds: float, start: float, seed: int) -> list[float]:
    """Due times of a steady ``rate``: call i at a random point of its 1/rate slot.

    slatedb and the tieredbuf producers flush on fixed timers (100 ms here); a schedule
    commensurate with a timer (20/s) would hit the same timer phase every time and skew
    the percentiles, so each call's phase is drawn at random (same seed for every side).
    """
    rng = random.Random(seed)
    return [start + (i + rng.random()) / rate for i in range(int(rate * seconds))]


def steady(rate: float, seconds: float, start: float, seed: int = 0) -> Iterator[tuple[int, float]]:
    """(call number, due monotonic time) from ``schedule``, sleeping until each is due."""
    for i, due in enumerate(schedule(rate, seconds, start, seed)):
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        yield i, due


def sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


class Acks:
    """Counts acks per level from callbacks on any thread; remembers the last ack time
    and each call's put -> ack latency (latency runs)."""

    def __init__(self, levels: tuple[str, ...]) -> None:
        self.cond = threading.Condition()
        self.count = dict.fromkeys(levels, 0)
        self.last = dict.fromkeys(levels, 0.0)
        self.lat: dict[str, list[float]] = {lv: [] for lv in levels}
        self.errors: list[BaseException] = []

    def ack(self, level: str, t0: float | None = None, err: BaseException | None = None) -> None:
        now = time.monotonic()
        with self.cond:
            if err is not None:
                self.errors.append(err)
            self.count[level] += 1
            self.last[level] = max(self.last[level], now)
            if t0 is not None:
                self.lat[level].append((now - t0) * 1e3)
            self.cond.notify_all()

    def wait_for(self, level: str, n: int, timeout: float = 300.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.count[level] >= n, timeout):
                raise TimeoutError(f"{self.count[level]}/{n} {level} acks after {timeout} s")
            if self.errors:
                raise self.errors[0]


# --- synchronous APIs: persist-queue, deltalake -------------------------------------------


def sync_throughput(
    write: Callable[[int, list[bytes]], None],
    spec: dict[str, Any],
    start: float,
    deadline: float,
) -> dict[str, Any]:
    """``threads`` threads call ``write(thread, records)`` until the deadline or budget;
    a call is acked when it returns."""
    threads, batch, size = spec["threads"], spec["batch"], spec["size"]
    budget_calls = max(1, spec["budget_bytes"] // (batch * size * threads))
    recs = [records_for(spec["worker"], t, batch, size) for t in range(threads)]
    calls = [0] * threads
    ends = [start] * threads
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            sleep_until(start)
            mine = recs[t]
            while calls[t] < budget_calls and time.monotonic() < deadline:
                write(t, mine)
                calls[t] += 1
            ends[t] = time.monotonic()
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    if errors:
        raise errors[0]
    n = sum(calls) * batch
    return {"records": n, "end": {"ack": max(ends)}}


def sync_latency(
    write: Callable[[bytes], None], spec: dict[str, Any], start: float
) -> dict[str, Any]:
    rec = records_for(spec["worker"], 0, 1, spec["size"])[0]
    lat: list[float] = []
    behind: list[float] = []
    warm = int(spec["rate"] * spec["warmup"])
    for i, due in steady(spec["rate"], spec["seconds"], start, spec["worker"]):
        t0 = time.monotonic()
        behind.append((t0 - due) * 1e3)
        write(rec)
        if i >= warm:
            lat.append((time.monotonic() - t0) * 1e3)
    return {
        "latency_ms": {"ack": lat},
        "behind_ms": behind,
        "achieved_rate": len(behind) / max(1e-9, time.monotonic() - start),
    }


class PersistQueue:
    """persist-queue's SQLiteQueue (local only): one row and one commit per put()."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from persistqueue import SQLiteQueue

        self.q = SQLiteQueue(str(Path(spec["dir"]) / "pq"), multithreading=True)

    def throughput(self, spec: dict[str, Any], start: float, deadline: float) -> dict[str, Any]:
        def write(_t: int, recs: list[bytes]) -> None:
            for r in recs:
                self.q.put(r)

        out = sync_throughput(write, spec, start, deadline)
        queued, expected = self.q.qsize(), out["records"] + spec["warm_records"]
        if queued != expected:
            raise AssertionError(f"persist-queue holds {queued}, expected {expected}")
        out["verified"] = "qsize"
        return out

    def warm(self, recs: list[bytes]) -> None:
        for r in recs:
            self.q.put(r)

    def latency(self, spec: dict[str, Any], start: float) -> dict[str, Any]:
        return sync_latency(self.q.put, spec, start)

    def probe(self, spec: dict[str, Any], n: int) -> None:
        rec = records_for(0, 0, 1, spec["size"])[0]
        for _ in range(n):
            self.q.put(rec)

    def close(self) -> None:
        self.q.close()


class DeltaLake:
    """deltalake (delta-rs) appends: one Parquet file and one commit per call."""

    RETRIES = 5

    def __init__(self, spec: dict[str, Any]) -> None:
        from deltalake import DeltaTable

        # A long-lived writer keeps its DeltaTable: write_deltalake() then updates it in
        # place instead of loading the log again on every append (half the cost here).
        uri, options = delta_location(spec)
        self.dt = DeltaTable(uri, storage_options=options)
        self.commit_failures = 0

    @staticmethod
    def table(recs: list[bytes]) -> Any:
        import pyarrow as pa

        return pa.table({"v": pa.array(recs, pa.binary())})

    def append(self, recs: list[bytes]) -> None:
        """One append; a commit that lost delta-rs's own retries (15 version conflicts)
        is retried here, as a writer must, up to RETRIES times, and counted."""
        from deltalake import write_deltalake
        from deltalake.exceptions import CommitFailedError

        for attempt in range(self.RETRIES + 1):
            try:
                write_deltalake(self.dt, self.table(recs), mode="append")
                return
            except CommitFailedError:
                self.commit_failures += 1
                if attempt == self.RETRIES:
                    raise

    def throughput(self, spec: dict[str, Any], start: float, deadline: float) -> dict[str, Any]:
        out = sync_throughput(lambda _t, recs: self.append(recs), spec, start, deadline)
        out["commit_failures_retried"] = self.commit_failures
        return out

    def warm(self, recs: list[bytes]) -> None:
        self.append(recs)

    def latency(self, spec: dict[str, Any], start: float) -> dict[str, Any]:
        return sync_latency(lambda r: self.append([r]), spec, start)

    def probe(self, spec: dict[str, Any], n: int) -> None:
        rec = records_for(0, 0, 1, spec["size"])[0]
        for _ in range(n):
            self.append([rec])

    def close(self) -> None:
        pass


def delta_location(spec: dict[str, Any]) -> tuple[str, dict[str, str] | None]:
    if spec["store"] == "local":
        return str(Path(spec["dir"]) / "delta"), None
    s3 = spec["s3"]
    return f"s3://{s3['bucket']}/delta", {
        "AWS_ENDPOINT_URL": s3["endpoint"],
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }


def delta_setup(spec: dict[str, Any]) -> None:
    """Create the table (an empty append) before the writers start."""
    import pyarrow as pa
    from deltalake import write_deltalake

    uri, options = delta_location(spec)
    write_deltalake(
        uri, pa.table({"v": pa.array([], pa.binary())}), mode="append", storage_options=options
    )


def delta_count(spec: dict[str, Any]) -> int:
    from deltalake import DeltaTable

    uri, options = delta_location(spec)
    return int(DeltaTable(uri, storage_options=options).count())


# --- slatedb (asyncio) ----------------------------------------------------------------------


class SlateDB:
    """slatedb: ``db.write(WriteBatch)`` then ``await handle.await_durable()`` (the WAL
    SST is in the object store).  Keys are worker/thread/counter, values the records."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from slatedb.uniffi import DbBuilder, ObjectStore, Settings

        if spec.get("slatedb_memmove"):
            patch_uniffi_copy()
        self.loop = asyncio.new_event_loop()
        if spec["store"] == "local":
            store = ObjectStore.resolve("file:///")
            path = str(Path(spec["dir"]) / "slatedb").lstrip("/")
        else:
            s3 = spec["s3"]
            os.environ.update(
                AWS_ENDPOINT=s3["endpoint"],
                AWS_ALLOW_HTTP="true",
                AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing",
                AWS_REGION="us-east-1",
            )
            store = ObjectStore.resolve(f"s3://{s3['bucket']}")
            path = "slatedb"
        settings = Settings.default()
        ms = int(spec["remote_flush_ms"])
        settings.set("flush_interval", f'"{ms}ms"')
        builder = DbBuilder(path, store)
        builder.with_settings(settings)
        self.db = self.loop.run_until_complete(builder.build())
        self.n = 0

    def _batch(self, key: bytes, recs: list[bytes]) -> Any:
        from slatedb.uniffi import WriteBatch

        b = WriteBatch()
        for r in recs:
            self.n += 1
            b.put(key + self.n.to_bytes(8, "big"), r)
        return b

    def throughput(self, spec: dict[str, Any], start: float, deadline: float) -> dict[str, Any]:
        threads, batch, size, window = spec["threads"], spec["batch"], spec["size"], spec["window"]
        budget_calls = max(1, spec["budget_bytes"] // (batch * size * threads))
        recs = [records_for(spec["worker"], t, batch, size) for t in range(threads)]
        calls = [0] * threads

        async def task(t: int) -> None:
            key = f"{spec['worker']:02d}{t:02d}".encode()
            pending: deque[Any] = deque()
            while calls[t] < budget_calls and time.monotonic() < deadline:
                h = await self.db.write(self._batch(key, recs[t]))
                pending.append(asyncio.ensure_future(h.await_durable()))
                calls[t] += 1
                if len(pending) >= window:
                    await pending.popleft()
            while pending:
                await pending.popleft()

        async def run() -> float:
            await asyncio.sleep(max(0.0, start - time.monotonic()))
            await asyncio.gather(*(task(t) for t in range(threads)))
            return time.monotonic()

        end = self.loop.run_until_complete(run())
        return {"records": sum(calls) * batch, "end": {"ack": end}}

    def latency(self, spec: dict[str, Any], start: float) -> dict[str, Any]:
        rec = records_for(spec["worker"], 0, 1, spec["size"])[0]
        rate, warm = spec["rate"], int(spec["rate"] * spec["warmup"])
        lat: list[float] = []
        behind: list[float] = []

        async def acked(h: Any, t0: float, keep: bool) -> None:
            await h.await_durable()
            if keep:
                lat.append((time.monotonic() - t0) * 1e3)

        async def run() -> None:
            tasks = []
            for i, due in enumerate(schedule(rate, spec["seconds"], start, spec["worker"])):
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                t0 = time.monotonic()
                behind.append((t0 - due) * 1e3)
                self.n += 1
                h = await self.db.put(b"lat" + self.n.to_bytes(8, "big"), rec)
                tasks.append(asyncio.ensure_future(acked(h, t0, i >= warm)))
            await asyncio.gather(*tasks)

        self.loop.run_until_complete(run())
        return {
            "latency_ms": {"ack": lat},
            "behind_ms": behind,
            "achieved_rate": len(behind) / max(1e-9, time.monotonic() - start),
        }

    def warm(self, recs: list[bytes]) -> None:
        async def run() -> None:
            h = await self.db.write(self._batch(b"warm", recs))
            await h.await_durable()

        self.loop.run_until_complete(run())

    def probe(self, spec: dict[str, Any], n: int) -> None:
        rec = records_for(0, 0, 1, spec["size"])[0]

        async def run() -> None:
            for i in range(n):
                h = await self.db.put(b"probe" + i.to_bytes(8, "big"), rec)
                await h.await_durable()

        self.loop.run_until_complete(run())

    def count(self) -> int:
        from slatedb.uniffi import KeyRange

        async def run() -> int:
            it = await self.db.scan(
                KeyRange(start=None, start_inclusive=False, end=None, end_inclusive=False)
            )
            n = 0
            while await it.next() is not None:
                n += 1
            return n

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        self.loop.run_until_complete(self.db.shutdown())
        self.loop.close()


def patch_uniffi_copy() -> None:
    """Diagnostic only (the ``slatedb-memmove`` side): slatedb 0.17's generated UniFFI
    code copies every key and value into the Rust buffer one byte at a time in a Python
    loop (``_UniffiRustBufferBuilder.write``), ~20 ms per 64 KiB value.  This replaces
    that loop with one ``ctypes.memmove`` so the row shows the engine without the
    binding's copy.  No user of the released package gets this."""
    import ctypes

    from slatedb.uniffi._slatedb_uniffi import slatedb as gen

    def write(self: Any, value: Any) -> None:
        data = bytes(value)
        with self._reserve(len(data)):
            base = ctypes.cast(self.rbuf.data, ctypes.c_void_p).value
            ctypes.memmove(base + self.rbuf.len, data, len(data))

    gen._UniffiRustBufferBuilder.write = write


# --- tieredbuf -----------------------------------------------------------------------------


class Tieredbuf:
    """tieredbuf, direct (stateless producer: REMOTE acks) or staged (LOCAL after the WAL
    fdatasync, REMOTE after export + manifest CAS)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import tieredbuf

        self.tb = tieredbuf
        if spec["store"] == "local":
            self.buf = tieredbuf.open(f"file://{Path(spec['dir']) / 'store'}")
        else:
            s3 = spec["s3"]
            self.buf = tieredbuf.open(
                f"s3://{s3['bucket']}/buf",
                endpoint=s3["endpoint"],
                region="us-east-1",
                access_key_id="testing",
                secret_access_key="testing",
                allow_http=True,
            )
        flush = timedelta(milliseconds=spec["remote_flush_ms"])
        if spec.get("probe_level") == "LOCAL":
            # strace check of the LOCAL ack alone: no segment seal between the writes
            # (they are sealed once, by close(), in both the N and the 0 run)
            flush = timedelta(seconds=60)
        self.staged = spec["system"] == "tieredbuf-staged"
        if self.staged:
            # The segment timer is the staged producer's remote flush interval: it seals
            # an open segment this long after its first entry, and the exporter ships it.
            self.producer = self.buf.producer(
                staging_dir=Path(spec["dir"]) / f"stage-{spec['worker']}", max_open_duration=flush
            )
            self.levels = {
                "LOCAL": tieredbuf.Durability.LOCAL,
                "REMOTE": tieredbuf.Durability.REMOTE,
            }
        else:
            self.producer = self.buf.producer(flush_interval=flush)
            self.levels = {"ack": tieredbuf.Durability.REMOTE}
        self.first = next(iter(self.levels.values()))

    def _watch(self, h: Any, acks: Acks, t0: float | None) -> None:
        for name, level in self.levels.items():

            def fire(name: str = name, level: Any = level) -> None:
                err = None
                try:
                    h.wait(level, timeout=0)
                except BaseException as e:
                    err = e
                acks.ack(name, t0, err)

            h.watcher.when(level, fire)

    def throughput(self, spec: dict[str, Any], start: float, deadline: float) -> dict[str, Any]:
        threads, batch, size, window = spec["threads"], spec["batch"], spec["size"], spec["window"]
        budget_calls = max(1, spec["budget_bytes"] // (batch * size * threads))
        recs = [records_for(spec["worker"], t, batch, size) for t in range(threads)]
        calls = [0] * threads
        acks = Acks(tuple(self.levels))
        errors: list[BaseException] = []

        def run(t: int) -> None:
            try:
                sleep_until(start)
                mine = recs[t]
                pending: deque[Any] = deque()
                while calls[t] < budget_calls and time.monotonic() < deadline:
                    h = self.producer.produce(mine)
                    self._watch(h, acks, None)
                    pending.append(h)
                    calls[t] += 1
                    if len(pending) >= window:
                        pending.popleft().wait(self.first, timeout=120)
            except BaseException as e:
                errors.append(e)

        ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        if errors:
            raise errors[0]
        for name in self.levels:
            acks.wait_for(name, sum(calls))
        return {
            "records": sum(calls) * batch,
            "end": dict(acks.last),
            "producer_stats": _stats(self.producer),
        }

    def latency(self, spec: dict[str, Any], start: float) -> dict[str, Any]:
        rec = records_for(spec["worker"], 0, 1, spec["size"])[0]
        warm = int(spec["rate"] * spec["warmup"])
        acks = Acks(tuple(self.levels))
        behind: list[float] = []
        n = 0
        for i, due in steady(spec["rate"], spec["seconds"], start, spec["worker"]):
            t0 = time.monotonic()
            behind.append((t0 - due) * 1e3)
            h = self.producer.produce([rec])
            self._watch(h, acks, t0 if i >= warm else None)
            n += 1
        for name in self.levels:
            acks.wait_for(name, n)
        return {
            "latency_ms": acks.lat,
            "behind_ms": behind,
            "achieved_rate": len(behind) / max(1e-9, time.monotonic() - start),
        }

    def warm(self, recs: list[bytes]) -> None:
        self.producer.produce(recs).wait(self.tb.Durability.REMOTE, timeout=60)

    def probe(self, spec: dict[str, Any], n: int) -> None:
        rec = records_for(0, 0, 1, spec["size"])[0]
        level = self.levels[spec.get("probe_level") or next(reversed(self.levels))]
        for _ in range(n):
            self.producer.produce([rec]).wait(level, timeout=60)

    def count(self) -> int:
        from tieredbuf.format.batch import decode_batch

        return sum(len(decode_batch(self.buf.read_object(e))) for e in self.buf.entries())

    def close(self) -> None:
        self.producer.close()
        self.buf.close()


def _stats(producer: Any) -> dict[str, Any]:
    s = producer.stats
    return dict(s.snapshot()) if hasattr(s, "snapshot") else dict(s)


SIDES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "persist-queue": PersistQueue,
    "slatedb": SlateDB,
    "slatedb-memmove": SlateDB,
    "deltalake": DeltaLake,
    "tieredbuf-direct": Tieredbuf,
    "tieredbuf-staged": Tieredbuf,
}
