"""The power-cut harness: run the real stage (and exporter) on a SimFs, cut the power at
a seeded random operation, rebuild the disk a reboot would find, recover with the real
code -- possibly cutting again during recovery -- and check what came back.

One *cut* (``run_cut(seed)``):

1. A stage on a fresh SimFs, two writer threads appending records (and some Arrow
   bundles) ``w<t>:<i>``, each noted as LOCAL-acked when its future completes.  With
   ``export`` an exporter runs beside them into a ``memory://`` buffer (the remote
   store: it survives the cut); with ``link`` too, the data objects are hard links of
   the sealed segments in a store directory on the same simulated disk
   (:class:`SimLinkStore`), so the cut takes what was not fsynced there as well.
   Small rotation and segment targets make the cut land in appends, WAL rotation and
   purge, sealing and recycling, and export/release.
2. The power goes at operation k (seeded, uniform); every later operation fails.
3. ``reconstruct(mode)``: ``drop`` (only durable state), ``keep`` (everything, as a
   SIGKILL would leave it) or ``subset`` (a seeded random subset of the non-durable
   operations; tests/stage/simfs.py).
4. Up to ``recovery_cuts`` times: open the stage on that disk (recovery), seal, export
   -- and cut again at a random operation of it, and rebuild.
5. Last recovery with no cut: seal everything and (``export``) drain it, sometimes on
   the real file system (the rebuilt directory copied to ``real_dir``).
6. The check: every LOCAL-acked record is in the result (I1: the stage's sealed
   segments, or with ``export`` the buffer's queue) and no record is there twice (I2);
   with ``export`` each writer's records of one stream are in order (I3).

Everything that decides what happens is drawn from ``random.Random(seed)``; the
threads still interleave as the OS schedules them, so a seed reproduces the
configuration and cut point, and most failures, but not necessarily the exact
interleaving.  A failure report names the seed, the cut and the last operations.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa

import tieredbuf
from tests.stage.simfs import SimFs
from tieredbuf.buffer import Buffer
from tieredbuf.config import RetryConfig, SegmentConfig, StageConfig, WalConfig
from tieredbuf.errors import AlreadyExistsError, DiskError
from tieredbuf.format.batch import decode_batch
from tieredbuf.format.segment import SegmentReader
from tieredbuf.produce.exporter import Exporter
from tieredbuf.stage.filesystem import FileSystem
from tieredbuf.stage.stage import Stage
from tieredbuf.store.base import GetResult

ROOT = Path("/sim/staging")
PID = "p"
MODES = ("drop", "keep", "subset")
FAST_RETRY = RetryConfig(
    initial_backoff=timedelta(milliseconds=1), max_backoff=timedelta(milliseconds=20)
)


@dataclass
class CutResult:
    seed: int
    desc: str
    acked: set[str]
    found: Counter[str]
    produced: set[str]
    order_errors: list[str] = field(default_factory=list)
    traces: list[list[str]] = field(default_factory=list)
    error: str | None = None
    """Recovery raised instead of opening the stage."""

    @property
    def lost(self) -> set[str]:
        return self.acked - set(self.found)

    @property
    def doubled(self) -> list[str]:
        return sorted(r for r, n in self.found.items() if n > 1)

    @property
    def invented(self) -> set[str]:
        return set(self.found) - self.produced

    def ok(self) -> bool:
        return not (self.lost or self.doubled or self.invented or self.order_errors or self.error)

    def report(self) -> str:
        lines = [
            f"power cut seed={self.seed}: {self.desc}",
            f"  LOCAL-acked {len(self.acked)}, recovered {len(self.found)} distinct",
        ]
        if self.error:
            lines.append(f"  {self.error}")
        if self.lost:
            lines.append(f"  I1 LOST acked records: {sorted(self.lost)[:10]}")
        if self.doubled:
            lines.append(f"  I2 records twice: {self.doubled[:10]}")
        if self.invented:
            lines.append(f"  records never produced: {sorted(self.invented)[:10]}")
        if self.order_errors:
            lines.append(f"  I3 out of order: {self.order_errors[:5]}")
        for i, t in enumerate(self.traces):
            lines.append(f"  --- operations before cut {i + 1} ---")
            lines += [f"    {x}" for x in t[-25:]]
        lines.append(f"  reproduce: run_cut({self.seed}, ...) in tests/stage/powercut.py")
        return "\n".join(lines)


def stage_config(rng: random.Random) -> StageConfig:
    return StageConfig(
        wal=WalConfig(
            flush_interval=timedelta(milliseconds=rng.choice([0, 0, 1, 3])),
            rotation_target=rng.choice([700, 2000, 6000]),
            max_rotated_files=64,
        ),
        segment=SegmentConfig(
            target_size=rng.choice([400, 1500, 5000]),
            max_open_duration=timedelta(milliseconds=rng.choice([2, 20, 200])),
            max_open_bytes=1 << 20,
        ),
        backpressure_timeout=timedelta(seconds=2),
    )


def _bundle(rec: str) -> dict[int, pa.RecordBatch]:
    return {0: pa.record_batch({"id": pa.array([rec])})}


def _ids_of_bundles(bundles: list[dict[int, pa.RecordBatch]]) -> list[str]:
    return [str(v) for b in bundles for v in b[0].column("id").to_pylist()]


STORE_ROOT = Path("/sim/store")


class SimLinkStore:
    """The buffer's store for power cuts during export by hard link: data objects are
    created as LocalDirStore.put_link creates them -- the stage links the sealed segment
    to a temp name in the key's directory, the store links that to the key
    (create-if-absent), drops the temp name and fsyncs the directory -- but in
    ``STORE_ROOT`` on the simulated disk, so a power cut judges them like the stage's
    own files.  Everything else (the manifest) is the memory store's, which survives a
    cut as a remote store would.  A stand-in for LocalDirStore, which runs on real files
    only (tests/store, and the SIGKILL test in tests/test_crash.py); ``dir_fsync=False``
    is the broken twin that forgets the directory fsync."""

    def __init__(self, inner: Any, disk: SimFs, dir_fsync: bool = True) -> None:
        self.inner = inner
        self.disk = disk
        """The current disk (replaced by the rebuilt one after each cut)."""
        self.dir_fsync = dir_fsync
        self.linked = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put_link(self, key: str, link: Callable[[str], None], *, crc32: int | None = None) -> None:
        disk = self.disk  # (a simulated disk keeps no extended attributes: no checksum)
        final = STORE_ROOT / key
        disk.makedirs(final.parent)
        tmp = final.with_name(f".tmp-{uuid.uuid4().hex}")
        link(str(tmp))
        try:
            try:
                disk.link(tmp, final)
            except FileExistsError:
                if self.dir_fsync:  # found: made durable before the answer, as there
                    disk.fsync_dir(final.parent)
                raise AlreadyExistsError(key) from None
        finally:
            disk.unlink(tmp, missing_ok=True)
        if self.dir_fsync:
            disk.fsync_dir(final.parent)
        self.linked += 1

    def get(self, key: str) -> GetResult:
        try:
            data = self.disk.read_bytes(STORE_ROOT / key)
        except (FileNotFoundError, NotADirectoryError):
            return self.inner.get(key)  # the manifest, or an object uploaded (no link)
        return GetResult(data, "linked")

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        try:
            data = self.disk.read_bytes(STORE_ROOT / key)
        except (FileNotFoundError, NotADirectoryError):
            return self.inner.get_if_changed(key, etag)
        return None if etag == "linked" else GetResult(data, "linked")


class _Writers:
    """Writer threads appending until the power goes (or ``limit`` each)."""

    def __init__(
        self,
        rng: random.Random,
        n: int = 2,
        limit: int = 400,
        bundle_share: float = 0.2,
        sim: SimFs | None = None,
    ) -> None:
        self._sim = sim
        """With injected faults: a DiskError only skips that record, until the cut."""
        self.acked: set[str] = set()
        self.produced: set[str] = set()
        self._lock = threading.Lock()
        self._seeds = [rng.random() for _ in range(n)]
        self._limit = limit
        self._bundle_share = bundle_share

    def run(self, stage: Stage) -> None:
        """Append from every writer thread until each stops; returns when all did."""
        threads = [
            threading.Thread(
                target=self._run, args=(stage, t, s), name=f"pc-writer-{t}", daemon=True
            )
            for t, s in enumerate(self._seeds)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
            assert not t.is_alive(), "a writer thread did not stop"

    def _acked(self, rec: str, f: Future[Any]) -> None:
        if f.exception() is None:
            with self._lock:
                self.acked.add(rec)

    def _run(self, stage: Stage, t: int, seed: float) -> None:
        rng = random.Random(seed)
        for i in range(self._limit):
            rec = f"w{t}:{i}"
            with self._lock:
                self.produced.add(rec)
            try:
                if rng.random() < self._bundle_share:
                    fut = stage.append_bundle(_bundle(rec))
                else:
                    fut = stage.append_records([rec.encode()], f"m{t}".encode())
            except DiskError:
                if self._sim is None or self._sim.dead:
                    return
                continue  # an injected fault: this record is not acked; go on
            except Exception:
                return  # the power is off (or the stage closed): stop writing
            fut.add_done_callback(lambda f, rec=rec: self._acked(rec, f))


def _open_stage(fs: FileSystem, cfg: StageConfig) -> Stage:
    return Stage(ROOT, PID, cfg, fs=fs)


def _shut(stage: Stage | None, exporter: Exporter | None) -> None:
    """Stop what ran on a machine whose power is gone (every operation fails)."""
    if exporter is not None:
        exporter.stop()
    if stage is not None:
        with contextlib.suppress(Exception):
            stage.close()


def _drain_while_powered(exporter: Exporter, disk: SimFs) -> None:
    """Drain, unless the power goes first (the exporter then retries until stopped)."""
    while not disk.dead:
        try:
            exporter.drain(timeout=0.05)
            return
        except TimeoutError:
            continue


def _segment_records(stage: Stage) -> list[str]:
    out: list[str] = []
    for seg in stage.sealed_segments():
        data = stage.read_segment(seg)
        if seg.stream == "batch":
            out += [r.decode() for r in decode_batch(data, str(seg.path))]
        else:
            out += _ids_of_bundles(
                [dict(b.slots) for b in SegmentReader(data, str(seg.path)).bundles()]
            )
    return out


def _queue_records(buf: tieredbuf.Buffer) -> tuple[list[str], list[str]]:
    """(records in queue order, I3 violations: a writer's records of one stream out of
    order)."""
    if not buf.exists():  # nothing was ever exported (a consumer never creates a buffer)
        return [], []
    c = buf.consumer()
    c.initialize()
    out: list[str] = []
    last: dict[tuple[str, str], int] = {}
    errors: list[str] = []
    while (b := c.next_batch()) is not None:
        stream = "batch" if b.location.endswith(".batch") else "qseg"
        recs = (
            [r.decode() for r in b.entries] if stream == "batch" else _ids_of_bundles(b.bundles())
        )
        for r in recs:
            w, i = r.split(":")
            if last.get((w, stream), -1) >= int(i):
                errors.append(f"{stream} {r} after {w}:{last[(w, stream)]}")
            last[(w, stream)] = int(i)
        out += recs
    c.close()
    return out, errors


def run_cut(
    seed: int,
    *,
    export: bool,
    modes: tuple[str, ...] = MODES,
    recovery_cuts: int | None = None,
    max_ops: int = 900,
    real_dir: Path | None = None,
    patch: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    faults: int = 0,
    link: bool = False,
    link_dir_fsync: bool = True,
) -> CutResult:
    """One power cut (and its recovery cuts); see the module doc.  ``patch``: a context
    manager active while the stage runs before the first cut (the broken twins)."""
    rng = random.Random(seed)
    cfg = stage_config(rng)
    mode = rng.choice(modes)
    rec_cuts = rng.choice([0, 0, 1, 2]) if recovery_cuts is None else recovery_cuts
    cut_at = rng.randint(1, max_ops)
    desc = (
        f"{'link export' if link else 'export' if export else 'stage'} cut at op "
        f"{cut_at}, mode {mode}, "
        f"{faults} injected fault(s), "
        f"{rec_cuts} recovery cut(s), flush {cfg.wal.flush_interval.total_seconds()}s, "
        f"rotate {cfg.wal.rotation_target}, seal {cfg.segment.target_size}"
    )
    buf = tieredbuf.open(f"memory://pc-{uuid.uuid4().hex}") if export or link else None
    sim = SimFs()
    sim.makedirs_durable(ROOT)
    links: SimLinkStore | None = None
    if link:
        assert buf is not None and real_dir is None
        sim.makedirs_durable(STORE_ROOT)
        links = SimLinkStore(buf.store, sim, link_dir_fsync)
        buf = Buffer(links)  # type: ignore[arg-type]
    traces: list[list[str]] = []
    logging.disable(logging.CRITICAL)  # a power cut makes every thread complain
    try:
        with patch() if patch is not None else contextlib.nullcontext():
            sim.arm(cut_at)
            for _ in range(faults):  # ENOSPC / EIO here and there before the cut
                sim.fail(
                    rng.choice(
                        [
                            "writev",
                            "fdatasync",
                            "rename",
                            "fsync_dir",
                            "open",
                            "ftruncate",
                            "unlink",
                            "*",
                        ]
                    ),
                    rng.choice([errno.ENOSPC, errno.EIO]),
                    rng.choice(["/wal/", "/segments/", ""]),
                    times=rng.randint(1, 4),
                    after=rng.randint(0, 300),
                )
            writers = _Writers(rng, sim=sim if faults else None)
            stage: Stage | None = None
            exporter: Exporter | None = None
            with contextlib.suppress(Exception):  # the power may go while it is created
                stage = _open_stage(sim, cfg)
            if stage is not None:
                if buf is not None:
                    exporter = Exporter(stage, buf.store, buf.queue, retry=FAST_RETRY)
                writers.run(stage)
            sim.cut()  # if the writers finished before op k: cut now
            _shut(stage, exporter)
        traces.append(list(sim.trace))
        disk = sim.reconstruct(mode, rng)
        if links is not None:
            links.disk = disk
        for _ in range(rec_cuts):
            disk.arm(rng.randint(1, 80))
            stage = exporter = None
            with contextlib.suppress(Exception):
                stage = _open_stage(disk, cfg)
                exporter = Exporter(stage, buf.store, buf.queue, retry=FAST_RETRY) if buf else None
                stage.seal_all()
                if exporter is not None:
                    _drain_while_powered(exporter, disk)
            disk.cut()
            _shut(stage, exporter)
            traces.append(list(disk.trace))
            disk = disk.reconstruct(rng.choice(modes), rng)
            if links is not None:
                links.disk = disk
        fs: FileSystem = disk
        if real_dir is not None:
            disk.materialize(ROOT, real_dir)
            fs = FileSystem()
        root = real_dir if real_dir is not None else ROOT
        found: list[str] = []
        order: list[str] = []
        error = None
        try:
            stage = Stage(root, PID, cfg, fs=fs)
            try:
                stage.seal_all()
                if buf is not None:
                    exporter = Exporter(stage, buf.store, buf.queue, retry=FAST_RETRY)
                    try:
                        exporter.drain(timeout=60)
                    finally:
                        exporter.stop()
                    found, order = _queue_records(buf)
                else:
                    found = _segment_records(stage)
            finally:
                stage.close()
        except Exception as e:  # recovery itself failed: a failure of this cut
            error = f"recovery failed: {type(e).__name__}: {e}"
    finally:
        logging.disable(logging.NOTSET)
    return CutResult(
        seed, desc, writers.acked, Counter(found), writers.produced, order, traces, error
    )
