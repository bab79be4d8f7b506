"""Local-tier benchmark: the stage (WAL + segments) against raw Python I/O on the same disk.

Every figure is a ratio against a baseline measured in the same run, on the same
filesystem (a temp directory under ``--tmpdir``, default ``$TMPDIR``/``/tmp``; the
device is printed), each run repeated ``--repeat`` times with the sides alternating;
medians are reported.

1. ``produce`` in ``durability="wal"`` with LOCAL acks awaited, at 1 KiB and 64 KiB
   records, vs a raw WAL: ``os.writev`` of the same records to one file by the same
   threads, and a flusher thread that fdatasyncs at most every 25 ms; a call is acked
   once an fdatasync covering it returned (the stage's own contract).  Producer threads
   keep up to ``--window`` calls in flight and wait on the oldest, so acks share
   fdatasyncs.  After each run its files are removed and ``os.sync()`` is called,
   untimed, so no run shares the disk with the previous run's write-back.  Measured
   on ``Stage.append_records`` directly and through
   ``StagedProducer.produce`` (which also runs its exporter), once exporting to a
   ``memory://`` store (the object store off this disk, as S3 is) and once to a
   ``file://`` store on the same disk (which takes each sealed segment as a hard
   link; ``--export memory|file`` runs one).  Target >= 0.6.
   A diagnostic side, ``raw_2x``, adds to raw what the stage adds on the disk: the same
   bytes written again into 32 MiB files (writev + fdatasync + rename) by a background
   thread, which bounds what a WAL + sealed-segment design can reach here.  The stage
   recycles purged WAL files (zeroed spares reused by the next rotation) instead of
   unlinking them: ``wal_rotations_into_recycled_files`` counts the rotations that did.
2. Bundle ingest (``Stage.append_bundle``) in ``segment_only`` (acked when the segment
   is sealed: written, fdatasynced, renamed, directory fsynced) vs writing the same
   RecordBatches with ``pa.ipc.new_file`` (one file per slot), fsynced at the end.
   Target >= 0.9.
3. The same bundle ingest in ``wal`` (acked after the WAL fdatasync) vs ``segment_only``.
   Target >= 0.6.
4. WAL replay: a child process stages N MiB in ``wal`` mode with sealing disabled,
   waits for every LOCAL ack, and is killed with SIGKILL.  Each repetition copies that
   stage, evicts the copy from the page cache (``posix_fadvise(DONTNEED)``), and times
   ``Stage(dir)`` (recovery scan, replay, re-sealing every entry into segments with
   fdatasync), ``WalWriter`` open + ``replay()`` iteration alone (decode only), and a
   raw sequential read of the same WAL files (cold, 1 MiB reads).  N (60 MiB) keeps
   the WAL in one file (the common case: the active file); ``--replay-mib 150`` spans
   three rotated files (recovery keeps its scans of the newest 2 x rotation_target
   bytes for replay; older files are decoded again).

Usage::

    python bench/stage.py            # full run (~1-2 minutes on 2 cores)
    python bench/stage.py --quick    # ~10-30 s
    python bench/stage.py --parts produce,replay --repeat 1

Results: tables on stdout and ``bench/results/stage.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa
from _common import print_table, run_threads, write_json

import tieredbuf
from tieredbuf.config import SegmentConfig, StageConfig, WalConfig
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage.stage import Stage
from tieredbuf.stage.stage_recovery import LAYOUT_CONTRACT
from tieredbuf.stage.wal import WalWriter

MiB = 1 << 20
GROUP = timedelta(milliseconds=25)
META = b"bench"
PRODUCER_ID = "bench"
PARTS = ("produce", "bundles", "replay")

DURABILITY = {
    "produce": {
        "tieredbuf": "durability='wal': a call's future/handle reaches LOCAL once an "
        "fdatasync of the WAL covering it returned (group commit, flush_interval=25ms); "
        "full 32 MiB segments are sealed (written + fdatasync + rename + dir fsync) in "
        "the background inside the timed window",
        "raw": "os.writev to one O_APPEND file; a flusher thread fdatasyncs at most every "
        "25 ms; a call is acked once an fdatasync covering it returned",
        "raw_2x": "raw, plus (diagnostic, stage rows only) the same bytes written again "
        "into 32 MiB files (writev + fdatasync + rename) by a background thread -- the "
        "stage's WAL + sealed-segment double write without its Python work",
    },
    "bundles": {
        "segment_only": "acked when its segment is sealed: written, fdatasynced, renamed, "
        "sidecar written atomically, directory fsynced (seal_all after the last bundle)",
        "wal": "acked after the WAL fdatasync covering it (group commit every 25 ms); "
        "segments sealed in the background",
        "ipc_file": "pa.ipc.new_file per slot to an OSFile, fsync of each file at the end",
    },
    "replay": {
        "stage_open": "Stage(dir): WAL recovery scan, replay, re-seal of every replayed "
        "entry into segment files (fdatasync), cursor advance",
        "wal_decode": "WalWriter(dir) (recovery scan) + iterating WalWriter.replay()",
        "raw_read": "sequential os.readv of the same WAL files, 1 MiB at a time",
    },
}


# --- helpers ---------------------------------------------------------------------------


def device_of(path: Path) -> str:
    """'<device> on <mountpoint> (<fstype>)' for the filesystem holding ``path``."""
    best = ("?", "/", "?")
    real = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    return f"{best[0]} on {best[1]} ({best[2]})"


def evict(paths: list[Path]) -> None:
    """fdatasync and drop ``paths`` from the page cache (only these files)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def med(xs: list[float]) -> float:
    return statistics.median(xs)


class Scratch:
    """Fresh directories under one temp root; each run's directory is removed after it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._n = 0

    def new(self, tag: str) -> Path:
        self._n += 1
        d = self.root / f"{tag}-{self._n}"
        d.mkdir()
        return d


# --- 1. produce (wal) vs raw write + group fdatasync ------------------------------------


class RawGroupWal:
    """The baseline: one O_APPEND file, writes under a lock, a 25 ms group fdatasync."""

    def __init__(self, path: Path, interval: float) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.interval = interval
        self.cond = threading.Condition()
        self.written = self.durable = 0
        self.syncs = 0
        self.closing = False
        self.flusher = threading.Thread(target=self._flush_loop, name="raw-flusher", daemon=True)
        self.flusher.start()

    def append(self, parts: list[bytes]) -> int:
        n = sum(len(p) for p in parts)
        with self.cond:
            w = os.writev(self.fd, parts)
            if w != n:  # short write: finish it (never seen on a regular file)
                rest = memoryview(b"".join(parts))[w:]
                while rest:
                    rest = rest[os.write(self.fd, rest) :]
            self.written += n
            self.cond.notify_all()
            return self.written

    def wait(self, end: int) -> None:
        with self.cond:
            while self.durable < end:
                self.cond.wait()

    def _flush_loop(self) -> None:
        last = 0.0
        while True:
            with self.cond:
                while self.written <= self.durable and not self.closing:
                    self.cond.wait()
                if self.written <= self.durable:
                    return
            delay = last + self.interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with self.cond:
                target = self.written
            os.fdatasync(self.fd)
            last = time.monotonic()
            with self.cond:
                self.durable = target
                self.syncs += 1
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.flusher.join()
        os.close(self.fd)


class RawSegments:
    """Diagnostic for raw_2x: what the stage adds on the disk -- every byte written a
    second time into 32 MiB files (writev + fdatasync + rename) by a background thread."""

    def __init__(self, d: Path, target: int = 32 * MiB) -> None:
        self.d, self.target = d, target
        self.parts: list[bytes] = []
        self.nbytes = 0
        self.lock = threading.Lock()
        self.q: deque[list[bytes] | None] = deque()
        self.cv = threading.Condition()
        self.sealed = 0
        self.thread = threading.Thread(target=self._loop, name="raw-sealer", daemon=True)
        self.thread.start()

    def add(self, parts: list[bytes]) -> None:
        with self.lock:
            self.parts.extend(parts)
            self.nbytes += sum(len(p) for p in parts)
            if self.nbytes < self.target:
                return
            full, self.parts, self.nbytes = self.parts, [], 0
        with self.cv:
            self.q.append(full)
            self.cv.notify()

    def _loop(self) -> None:
        n = 0
        while True:
            with self.cv:
                while not self.q:
                    self.cv.wait()
                parts = self.q.popleft()
            if parts is None:
                return
            n += 1
            tmp, final = self.d / f"seg{n}.tmp", self.d / f"seg{n}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
            try:
                for i in range(0, len(parts), 1024):
                    os.writev(fd, parts[i : i + 1024])
                os.fdatasync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            self.sealed += 1

    def close(self) -> None:
        with self.cv:
            self.q.append(None)
            self.cv.notify()
        self.thread.join()


def make_records(threads: int, batch: int, size: int) -> list[list[bytes]]:
    """One produce() call's records per thread (distinct per thread), reused for every call."""
    base = os.urandom(size)
    return [
        [t.to_bytes(2, "big") + j.to_bytes(4, "big") + base[6:] for j in range(batch)]
        for t in range(threads)
    ]


def windowed(
    n_calls: int, window: int, submit: Callable[[], Any], wait: Callable[[Any], None]
) -> None:
    pending: deque[Any] = deque()
    for _ in range(n_calls):
        pending.append(submit())
        if len(pending) >= window:
            wait(pending.popleft())
    while pending:
        wait(pending.popleft())


def produce_raw(
    d: Path, recs: list[list[bytes]], calls: int, window: int, twice: bool = False
) -> dict[str, Any]:
    wal = RawGroupWal(d / "raw.wal", GROUP.total_seconds())
    segs = RawSegments(d) if twice else None

    def work(i: int, barrier: threading.Barrier) -> None:
        mine = recs[i]
        barrier.wait()
        if segs is None:
            windowed(calls, window, lambda: wal.append(mine), wal.wait)
        else:

            def submit() -> int:
                end = wal.append(mine)
                segs.add(mine)
                return end

            windowed(calls, window, submit, wal.wait)

    started = run_threads(len(recs), work)
    secs = time.perf_counter() - started
    wal.close()
    out: dict[str, Any] = {"seconds": secs, "fdatasyncs": wal.syncs}
    if segs is not None:
        out["segments_sealed_in_window"] = segs.sealed
        segs.close()
    return out


def stage_config(durability: str, **seg: Any) -> StageConfig:
    return StageConfig(
        durability=durability, wal=WalConfig(flush_interval=GROUP), segment=SegmentConfig(**seg)
    )


def produce_stage(d: Path, recs: list[list[bytes]], calls: int, window: int) -> dict[str, Any]:
    stage = Stage(d, PRODUCER_ID, stage_config("wal"))

    def work(i: int, barrier: threading.Barrier) -> None:
        mine = recs[i]
        barrier.wait()
        windowed(calls, window, lambda: stage.append_records(mine, META), lambda f: f.result())

    started = run_threads(len(recs), work)
    secs = time.perf_counter() - started
    sealed = len(stage.sealed_segments())
    wal = stage.wal
    recycled = wal.recycled if wal is not None else None
    t = time.perf_counter()
    stage.close()
    return {
        "seconds": secs,
        "segments_sealed_in_window": sealed,
        "wal_rotations_into_recycled_files": recycled,
        "close_seconds": time.perf_counter() - t,
    }


def produce_producer(
    d: Path, recs: list[list[bytes]], calls: int, window: int, export: str, remote: bool = False
) -> dict[str, Any]:
    """``remote``: every call waits for REMOTE (each one asks for a prompt seal), not LOCAL."""
    url = "memory://" if export == "memory" else f"file://{d}/store"
    buf = tieredbuf.open(url)
    producer = buf.producer(staging_dir=d / "stage", durability="wal", flush_interval=GROUP)
    level = tieredbuf.Durability.REMOTE if remote else tieredbuf.Durability.LOCAL

    def work(i: int, barrier: threading.Barrier) -> None:
        mine = recs[i]
        barrier.wait()
        windowed(calls, window, lambda: producer.produce(mine, META), lambda h: h.wait(level))

    started = run_threads(len(recs), work)
    secs = time.perf_counter() - started
    stats = producer.stats
    t = time.perf_counter()
    producer.close()
    close_s = time.perf_counter() - t
    buf.close()
    sealed = stats.get("segments_sealed", 0)
    return {
        "seconds": secs,
        "close_seconds": close_s,
        "objects_uploaded_in_window": stats.get("objects_uploaded"),
        "of_them_hard_links": stats.get("objects_linked"),
        "segments_sealed_in_window": sealed,
        "prompt_seals": stats.get("prompt_seals"),
        "mean_segment_mib": stats.get("bytes_exported", 0) / MiB / max(1, sealed)
        if remote
        else None,
    }


def bench_produce(args: argparse.Namespace, scratch: Scratch) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for threads in args.threads:
        for size, batch in ((1024, args.batch_1k), (65536, args.batch_64k)):
            out.update(bench_produce_case(args, scratch, threads, size, batch))
    return out


def bench_produce_case(
    args: argparse.Namespace, scratch: Scratch, threads: int, size: int, batch: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    per_call = size * batch
    calls = max(1, args.produce_mib * MiB // (per_call * threads))
    recs = make_records(threads, batch, size)
    n_rec = calls * threads * batch
    nbytes = n_rec * size
    exports = ("memory", "file") if args.export == "both" else (args.export,)
    remote_rows = ("producer-memory-remote",) if args.remote_row else ()
    for via in ("stage", *(f"producer-{e}" for e in exports), *remote_rows):
        key = f"{size // 1024}KiB/{via}/{threads}t"
        sides = (
            ("tieredbuf", "raw", "raw_2x")
            if via == "stage" and args.raw_2x
            else ("tieredbuf", "raw")
        )
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
        for rep in range(args.repeat):
            order = sides[rep % len(sides) :] + sides[: rep % len(sides)]
            for side in order:
                print(f"[produce {key}] run {rep + 1}/{args.repeat}: {side}", flush=True)
                d = scratch.new(f"p-{side}")
                if side.startswith("raw"):
                    r = produce_raw(d, recs, calls, args.window, side == "raw_2x")
                elif via == "stage":
                    r = produce_stage(d, recs, calls, args.window)
                elif via.endswith("-remote"):
                    # enough calls in flight for two full segments, or REMOTE waits
                    # would stall every segment short of target_size
                    win = max(args.window, -(-2 * 32 * MiB // (per_call * threads)))
                    r = produce_producer(d, recs, calls, win, "memory", remote=True)
                    r["window_calls"] = win
                else:
                    r = produce_producer(d, recs, calls, args.window, via[9:])
                shutil.rmtree(d, ignore_errors=True)
                # untimed: the next run (the other side, often) starts with nothing of
                # this one still being written back or discarded on the same disk
                os.sync()
                r["records_per_s"] = n_rec / r["seconds"]
                r["mib_per_s"] = nbytes / MiB / r["seconds"]
                r["loadavg"] = loadavg()
                runs[side].append(r)
        m = {s: med([r["records_per_s"] for r in runs[s]]) for s in sides}
        out[key] = {
            "record_size": size,
            "records_per_call": batch,
            "threads": threads,
            "window_calls": args.window,
            "records": n_rec,
            "bytes": nbytes,
            "export": via[9:].removesuffix("-remote") if via != "stage" else None,
            "awaited": "REMOTE" if via.endswith("-remote") else "LOCAL",
            **{
                s: {"records_per_s": m[s], "mib_per_s": m[s] * size / MiB, "runs": runs[s]}
                for s in sides
            },
            "ratio": m["tieredbuf"] / m["raw"],
            "target": 0.6,
        }
        if "raw_2x" in m:
            out[key]["ratio_raw_2x_over_raw"] = m["raw_2x"] / m["raw"]
    return out


# --- 2/3. bundle ingest: segment_only, wal, plain IPC file ------------------------------


def make_bundles(n: int, rows: int) -> list[dict[int, pa.RecordBatch]]:
    """``n`` bundles of two slots (different schemas); 8 distinct bundles, cycled."""
    import numpy as np

    rng = np.random.default_rng(7)
    pool = []
    for k in range(8):
        a = pa.record_batch(
            {
                "ts": pa.array(np.arange(rows, dtype=np.int64) + k * rows),
                "value": pa.array(rng.random(rows)),
                "count": pa.array(rng.integers(0, 1 << 30, rows, dtype=np.int32)),
                "name": pa.array([f"service-{i % 97:03d}-{k}" for i in range(rows)]),
            }
        )
        b = pa.record_batch(
            {
                "span_id": pa.array(rng.integers(0, 1 << 62, rows // 2, dtype=np.int64)),
                "duration": pa.array(rng.random(rows // 2)),
                "attrs": pa.array([f"k={i % 13};v={i}" for i in range(rows // 2)]),
            }
        )
        pool.append({0: a, 1: b})
    return [pool[i % len(pool)] for i in range(n)]


def ingest_stage(
    d: Path, bundles: list[dict[int, pa.RecordBatch]], durability: str
) -> dict[str, Any]:
    stage = Stage(d, PRODUCER_ID, stage_config(durability))
    t0 = time.perf_counter()
    futs: list[Future[Any]] = [stage.append_bundle(b) for b in bundles]
    if durability == "segment_only":
        stage.seal_all()
    for f in futs:
        f.result()
    secs = time.perf_counter() - t0
    sealed = len(stage.sealed_segments())
    stage.close()
    return {"seconds": secs, "segments": sealed}


def ingest_ipc(d: Path, bundles: list[dict[int, pa.RecordBatch]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    files: dict[int, tuple[Any, Any]] = {}
    for b in bundles:
        for slot, batch in b.items():
            if slot not in files:
                sink = pa.OSFile(str(d / f"slot{slot}.arrow"), "wb")
                files[slot] = (sink, pa.ipc.new_file(sink, batch.schema))
            files[slot][1].write_batch(batch)
    for slot, (sink, w) in files.items():
        w.close()
        sink.close()
        fd = os.open(d / f"slot{slot}.arrow", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return {"seconds": time.perf_counter() - t0}


def bench_bundles(args: argparse.Namespace, scratch: Scratch) -> dict[str, Any]:
    one = make_bundles(1, args.bundle_rows)[0]
    per = sum(b.get_total_buffer_size() for b in one.values())
    n = max(8, args.bundle_mib * MiB // per)
    bundles = make_bundles(n, args.bundle_rows)
    nbytes = sum(b.get_total_buffer_size() for bb in bundles for b in bb.values())
    sides = ("segment_only", "wal", "ipc_file")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for rep in range(args.repeat):
        order = sides[rep % 3 :] + sides[: rep % 3]
        for side in order:
            print(f"[bundles] run {rep + 1}/{args.repeat}: {side}", flush=True)
            d = scratch.new(f"b-{side}")
            r = ingest_ipc(d, bundles) if side == "ipc_file" else ingest_stage(d, bundles, side)
            shutil.rmtree(d, ignore_errors=True)
            r["bundles_per_s"] = n / r["seconds"]
            r["mib_per_s"] = nbytes / MiB / r["seconds"]
            r["loadavg"] = loadavg()
            runs[side].append(r)
    m = {s: med([r["mib_per_s"] for r in runs[s]]) for s in sides}
    return {
        "bundles": n,
        "bytes": nbytes,
        "bundle_bytes": per,
        "rows_per_bundle": [one[0].num_rows, one[1].num_rows],
        "slots": 2,
        **{
            s: {"mib_per_s": m[s], "bundles_per_s": m[s] * MiB / per, "runs": runs[s]}
            for s in sides
        },
        "ratio_segment_only_over_ipc": m["segment_only"] / m["ipc_file"],
        "target_segment_only_over_ipc": 0.9,
        "ratio_wal_over_segment_only": m["wal"] / m["segment_only"],
        "target_wal_over_segment_only": 0.6,
    }


# --- 4. WAL replay ------------------------------------------------------------------------


def replay_writer(d: Path, kind: str, mib: int, rows: int) -> None:
    """Child process: stage ``mib`` MiB with sealing disabled, wait for LOCAL, report ready."""
    cfg = stage_config(
        "wal", target_size=8 << 30, max_open_bytes=8 << 30, max_open_duration=timedelta(hours=1)
    )
    stage = Stage(d, PRODUCER_ID, cfg)
    futs: deque[Future[Any]] = deque()
    total = 0
    if kind == "records":
        recs = make_records(1, 100, 1024)[0]
        while total < mib * MiB:
            futs.append(stage.append_records(recs, META))
            total += 100 * 1024
    else:
        for b in make_bundles(max(8, mib * MiB // (rows * 40)), rows):
            futs.append(stage.append_bundle(b))
            total += sum(x.get_total_buffer_size() for x in b.values())
            if total >= mib * MiB:
                break
    for f in futs:
        f.result()
    print("ready", total, flush=True)
    time.sleep(3600)


def make_killed_stage(d: Path, kind: str, args: argparse.Namespace) -> int:
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--_replay-writer",
            str(d),
            kind,
            str(args.replay_mib),
            str(args.bundle_rows),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        if not line or line[0] != "ready":
            raise RuntimeError(f"replay writer failed: {line!r}")
        return int(line[1])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def wal_files(stage_dir: Path) -> list[Path]:
    w = stage_dir / PRODUCER_ID / "wal"
    return sorted(
        p for p in w.iterdir() if p.name.startswith("quiver.wal") and not p.name.endswith(".cursor")
    )


def raw_read(files: list[Path]) -> int:
    buf = bytearray(MiB)
    total = 0
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return total


def bench_replay(args: argparse.Namespace, scratch: Scratch) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("records", "bundles"):
        template = scratch.new(f"r-{kind}-template")
        payload = make_killed_stage(template, kind, args)
        files = wal_files(template)
        wal_bytes = sum(p.stat().st_size for p in files)
        sides = ("stage_open", "wal_decode", "raw_read")
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
        for rep in range(args.repeat):
            order = sides[rep % 3 :] + sides[: rep % 3]
            for side in order:
                print(f"[replay {kind}] run {rep + 1}/{args.repeat}: {side}", flush=True)
                d = scratch.new(f"r-{kind}-{side}")
                shutil.copytree(template, d, dirs_exist_ok=True)
                evict([p for p in (d / PRODUCER_ID).rglob("*") if p.is_file()])
                r: dict[str, Any] = {}
                t0 = time.perf_counter()
                if side == "stage_open":
                    try:
                        stage = Stage(d, PRODUCER_ID)
                    except Exception as e:
                        # (a WAL of several rotated files failed here until c33d929:
                        # a seal during replay purged files replay had not read)
                        print(f"   Stage() failed: {e!r}", flush=True)
                        r.update(seconds=float("nan"), error=repr(e))
                        runs[side].append(r)
                        shutil.rmtree(d, ignore_errors=True)
                        continue
                    r["seconds"] = time.perf_counter() - t0
                    r["replayed_entries"] = stage.stats.replayed_entries
                    r["segments"] = len(stage.sealed_segments())
                    stage.close()
                elif side == "wal_decode":
                    w = WalWriter(
                        d / PRODUCER_ID / "wal",
                        wal_fmt.segment_cfg_hash(LAYOUT_CONTRACT),
                        WalConfig(),
                    )
                    t_open = time.perf_counter() - t0
                    r["entries"] = sum(1 for _ in w.replay())
                    r["seconds"] = time.perf_counter() - t0
                    r["recovery_scan_seconds"] = t_open
                    w.close()
                else:
                    n = raw_read(wal_files(d))
                    r["seconds"] = time.perf_counter() - t0
                    assert n == wal_bytes, (n, wal_bytes)
                shutil.rmtree(d, ignore_errors=True)
                r["mib_per_s"] = wal_bytes / MiB / r["seconds"]
                r["loadavg"] = loadavg()
                runs[side].append(r)
        shutil.rmtree(template, ignore_errors=True)
        m = {s: med([r.get("mib_per_s", float("nan")) for r in runs[s]]) for s in sides}
        out[kind] = {
            "wal_bytes": wal_bytes,
            "payload_bytes": payload,
            "wal_files": len(files),
            "entry": "produce() calls of 100 x 1 KiB records"
            if kind == "records"
            else f"2-slot bundles, {args.bundle_rows} + {args.bundle_rows // 2} rows",
            **{s: {"mib_per_s": m[s], "runs": runs[s]} for s in sides},
            "ratio_stage_open_over_raw": m["stage_open"] / m["raw_read"],
            "ratio_wal_decode_over_raw": m["wal_decode"] / m["raw_read"],
        }
    return out


# --- report -----------------------------------------------------------------------------


def spread(runs: list[dict[str, Any]], key: str) -> str:
    return "[" + ", ".join(f"{r[key]:,.0f}" for r in runs) + "]"


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    if "produce" in res:
        print()
        threads = "/".join(map(str, args.threads))
        print(
            f"1. produce, durability='wal', LOCAL acks awaited ({threads} threads, "
            f"<= {args.window} calls in flight each); raw = writev + group fdatasync "
            "every 25 ms; target ratio >= 0.6; median of "
            f"{args.repeat}"
        )
        rows = []
        for key, r in res["produce"].items():
            for side in ("tieredbuf", "raw", "raw_2x"):
                if side not in r:
                    continue
                s = r[side]
                ratio = {"tieredbuf": r["ratio"], "raw_2x": r.get("ratio_raw_2x_over_raw")}
                rows.append(
                    [
                        key,
                        side,
                        f"{r['records_per_call']}",
                        f"{r['bytes'] / MiB:.0f}",
                        f"{s['records_per_s']:,.0f}",
                        f"{s['mib_per_s']:.1f}",
                        f"{ratio[side]:.2f}" if side in ratio else "",
                        spread(s["runs"], "records_per_s"),
                    ]
                )
        print_table(
            ["case", "side", "rec/call", "MiB", "rec/s", "MiB/s", "ratio", "runs rec/s"], rows
        )
        print(
            "   'producer-*' rows: StagedProducer, its exporter uploading in the background "
            "(not awaited: the clock stops at the last LOCAL ack) to a memory:// store "
            "(-memory: the object store off this disk, as S3 is) or a file:// store on the "
            "same disk (-file: it takes each sealed segment as a hard link)"
        )
        print(
            "   'raw_2x' (diagnostic): raw plus the same bytes rewritten into 32 MiB files "
            "by a background thread, i.e. the stage's double write without its Python work"
        )
        for key, r in res["produce"].items():
            if r.get("awaited") == "REMOTE":
                t = r["tieredbuf"]["runs"]
                print(
                    f"   {key}: every call waits for REMOTE (prompt seals asked for), "
                    f"{t[0].get('window_calls')} calls in flight per thread; mean sealed "
                    f"segment {med([x['mean_segment_mib'] for x in t]):.1f} MiB (target "
                    f"32), prompt seals {[x['prompt_seals'] for x in t]}"
                )
    if "bundles" in res:
        b = res["bundles"]
        print()
        print(
            f"2/3. bundle ingest, {b['bundles']} bundles x {b['bundle_bytes'] / MiB:.2f} MiB "
            f"(2 slots), one thread; median of {args.repeat}"
        )
        rows = [
            [
                s,
                f"{b[s]['mib_per_s']:.1f}",
                f"{b[s]['bundles_per_s']:,.0f}",
                spread(b[s]["runs"], "mib_per_s"),
            ]
            for s in ("segment_only", "wal", "ipc_file")
        ]
        print_table(["side", "MiB/s", "bundles/s", "runs MiB/s"], rows)
        print(
            f"   segment_only / ipc_file = {b['ratio_segment_only_over_ipc']:.2f} (target >= 0.9)"
        )
        print(
            f"   wal / segment_only      = {b['ratio_wal_over_segment_only']:.2f} (target >= 0.6)"
        )
    if "replay" in res:
        print()
        print(f"4. WAL replay after SIGKILL, cold page cache; median of {args.repeat}")
        rows = []
        for kind, r in res["replay"].items():
            for s in ("stage_open", "wal_decode", "raw_read"):
                rows.append(
                    [
                        kind,
                        f"{r['wal_bytes'] / MiB:.0f}",
                        r["wal_files"],
                        s,
                        f"{r[s]['mib_per_s']:.1f}",
                        f"{r[s]['mib_per_s'] / r['raw_read']['mib_per_s']:.2f}",
                        spread([x for x in r[s]["runs"] if "mib_per_s" in x], "mib_per_s"),
                    ]
                )
        print_table(["WAL holds", "MiB", "files", "side", "MiB/s", "vs raw", "runs MiB/s"], rows)
    print()
    print("Durability each side had:")
    for part in res:
        for side, text in DURABILITY[part].items():
            print(f"  {part:8} {side:12}: {text}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, one run, ~10-30 s")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of: {', '.join(PARTS)}")
    p.add_argument("--repeat", type=int, help="runs per side (median reported); default 3")
    p.add_argument(
        "--threads",
        default="1,4",
        help="produce: comma list of producer thread counts (one row each)",
    )
    p.add_argument(
        "--no-raw-2x",
        dest="raw_2x",
        action="store_false",
        help="produce: skip the diagnostic raw_2x side of the stage rows",
    )
    p.add_argument("--window", type=int, default=64, help="produce: calls in flight per thread")
    p.add_argument("--batch-1k", type=int, default=100, help="records per call at 1 KiB")
    p.add_argument("--batch-64k", type=int, default=4, help="records per call at 64 KiB")
    p.add_argument("--produce-mib", type=int, help="produce: MiB per run")
    p.add_argument(
        "--export",
        choices=("both", "file", "memory"),
        default="both",
        help="StagedProducer's buffer: memory://, file:// on the same disk, or both",
    )
    p.add_argument(
        "--no-remote-row",
        dest="remote_row",
        action="store_false",
        help="skip the producer-memory-remote rows (calls wait for REMOTE)",
    )
    p.add_argument("--bundle-mib", type=int, help="bundles: MiB per run")
    p.add_argument("--bundle-rows", type=int, default=16384, help="rows in slot 0's batch")
    p.add_argument("--replay-mib", type=int, help="replay: MiB staged before the kill")
    p.add_argument("--tmpdir", help="where the temp directory goes (default: $TMPDIR or /tmp)")
    p.add_argument("--out", default="stage", help="results file name under bench/results/")
    a = p.parse_args(argv)
    a.repeat = a.repeat or (1 if a.quick else 3)
    try:
        a.threads = [int(t) for t in str(a.threads).split(",")]
    except ValueError:
        p.error(f"--threads takes a comma list of integers, not {a.threads!r}")
    a.produce_mib = a.produce_mib or (48 if a.quick else 256)
    a.bundle_mib = a.bundle_mib or (64 if a.quick else 256)
    # one WAL file (under the 64 MiB rotation target); --replay-mib 150 for three
    a.replay_mib = a.replay_mib or (32 if a.quick else 60)
    for part in a.parts.split(","):
        if part not in PARTS:
            p.error(f"unknown part {part!r}")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_replay-writer"]:
        replay_writer(Path(argv[1]), argv[2], int(argv[3]), int(argv[4]))
        return 0
    args = parse_args(argv)
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="tb-stage-bench-", dir=args.tmpdir))
    disk = device_of(root)
    load_start = loadavg()
    print(
        f"temp dir {root} on {disk}; load average {load_start}; {os.cpu_count()} cpus", flush=True
    )
    scratch = Scratch(root)
    res: dict[str, Any] = {}
    try:
        parts = args.parts.split(",")
        if "produce" in parts:
            res["produce"] = bench_produce(args, scratch)
        if "bundles" in parts:
            res["bundles"] = bench_bundles(args, scratch)
        if "replay" in parts:
            res["replay"] = bench_replay(args, scratch)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_end = loadavg()
    report(res, args)
    print(
        f"\nload average: start {load_start}, end {load_end} ({os.cpu_count()} cpus); disk: {disk}"
    )
    path = write_json(
        args.out,
        {
            "benchmark": "stage",
            "config": vars(args),
            "disk": {"tmpdir": str(root), "device": disk},
            "loadavg": {"start": load_start, "end": load_end},
            "durability": {k: DURABILITY[k] for k in res},
            "results": res,
            "wall_seconds": time.perf_counter() - started,
        },
    )
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
