"""Sealed segments are CRC-checked at open and before upload; a corrupt one is set aside
(``.corrupt``), never uploaded, and reported as data loss -- never silently (I7, I1)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import tieredbuf
from tieredbuf import Durability
from tieredbuf.config import SegmentConfig, StageConfig, WalConfig
from tieredbuf.errors import StagedDataLossError
from tieredbuf.produce.exporter import Exporter
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.segment_check import verify
from tieredbuf.stage.stage import Stage
from tieredbuf.store import open_store

CFG = StageConfig(
    segment=SegmentConfig(max_open_duration=timedelta(seconds=60)),
    wal=WalConfig(flush_interval=timedelta(milliseconds=2)),
)


def _sealed_stage(root: Path, pid: str = "p1", bundle: bool = False) -> SealedSegment:
    """A closed stage holding one sealed, unexported segment; returns it."""
    st = Stage(root, pid, CFG)
    try:
        if bundle:
            st.append_bundle({0: pa.record_batch({"n": [1, 2, 3]})}).result(10)
        else:
            st.append_records([b"alpha", b"beta"], b"m").result(10)
            st.append_records([b"gamma"], b"m").result(10)
        (seg,) = st.seal_all()
    finally:
        st.close()
    return seg


def _flip(path: Path, offset: int = 2) -> None:
    os.chmod(path, 0o640)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("bundle", [False, True])
def test_I7_verify_detects_a_flipped_bit_in_either_kind(tmp_path: Path, bundle: bool) -> None:
    seg = _sealed_stage(tmp_path, bundle=bundle)
    data = seg.path.read_bytes()
    assert verify(seg) is None and verify(seg, data) is None
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x10
    assert "CRC mismatch" in (verify(seg, bytes(bad)) or "")
    assert "bytes" in (verify(seg, data[:-1]) or "")
    if not bundle:
        assert seg.crc32 is not None
        old = SealedSegment(*[getattr(seg, f) for f in SealedSegment.__slots__[:-1]])
        assert old.crc32 is None and verify(old, bytes(bad)) is None, "old sidecars: unchecked"


def test_I7_a_corrupt_segment_is_quarantined_at_open_never_uploaded_and_reported(
    tmp_path: Path,
) -> None:
    stage_root = tmp_path / "stage"
    seg = _sealed_stage(stage_root)
    _flip(seg.path)
    buf = tieredbuf.open(f"file://{tmp_path}/buf")
    p = buf.producer(
        staging_dir=stage_root, producer_id="p1", max_open_duration=timedelta(milliseconds=20)
    )
    bad = seg.path.with_name(seg.path.name + ".corrupt")
    assert bad.exists() and not seg.path.exists()
    assert bad.with_name(bad.name + ".json").exists(), "the sidecar says which sequences"
    assert p.stats["segments_quarantined"] == 1 and p.stats["quarantined_segments"] == 1
    assert [q.path for q in p.stage.quarantined()] == [bad]
    # the next write gets a new sequence (a reused one would be skipped by the watermark)
    h = p.produce([b"after"])
    p.close()
    assert h.result() is not None
    snap = buf.snapshot()
    assert [e.location for e in snap.entries()] == [h.result().location]  # type: ignore[union-attr]
    assert len(list((tmp_path / "buf" / "data").iterdir())) == 1, "nothing corrupt uploaded"


def test_I7_drain_of_a_stage_with_a_corrupt_segment_exits_3_naming_it(tmp_path: Path) -> None:
    stage_root = tmp_path / "stage"
    seg = _sealed_stage(stage_root)
    _flip(seg.path)
    exe = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
    r = subprocess.run(
        [exe, "drain", str(stage_root), f"file://{tmp_path}/buf"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 3, r.stderr
    assert "StagedDataLossError" in r.stderr and ".corrupt" in r.stderr
    assert "Traceback" not in r.stderr


def test_I7_quarantined_sequences_are_never_reused_even_without_wal_or_sidecar(
    tmp_path: Path,
) -> None:
    seg = _sealed_stage(tmp_path)
    _flip(seg.path)
    shutil.rmtree(tmp_path / "p1" / "wal")
    (tmp_path / "p1" / "sequence").unlink()
    st = Stage(tmp_path, "p1", CFG)
    try:
        assert st.stats.segments_quarantined == 1
        ack = st.append_records([b"new"]).result(10)
        assert ack.sequence > seg.last_sequence
    finally:
        st.close()


class _GatedStore:
    """Forwards to a memory store; the first data PUT waits until ``go`` is set."""

    def __init__(self) -> None:
        self.inner = open_store("memory://")
        self.go = threading.Event()
        self.entered = threading.Event()
        self.data_puts: list[str] = []

    def put(self, key: str, data: Any, **kw: Any) -> str:
        if key.startswith("data/"):
            self.data_puts.append(key)
            if len(self.data_puts) == 1:
                self.entered.set()
                assert self.go.wait(60)
        return self.inner.put(key, data, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_I7_a_segment_corrupted_before_upload_fails_its_handles_with_data_loss(
    tmp_path: Path,
) -> None:
    store = _GatedStore()
    buf = tieredbuf.Buffer(store)  # type: ignore[arg-type]
    # one upload at a time: segment 2 is read (and checked) only after segment 1's
    # upload, i.e. after the flip below (with more, it would be read, checked good and
    # uploaded as soon as it is sealed)
    p = buf.producer(
        staging_dir=tmp_path / "stage",
        max_open_duration=timedelta(hours=1),
        max_uploads_in_flight=1,
    )
    h1 = p.produce([b"one"])
    p.stage.seal_all()
    assert store.entered.wait(30)  # the exporter is uploading segment 1
    (first,) = p.stage.sealed_segments()
    h2 = p.produce([b"two"])
    h2.wait(Durability.LOCAL, timeout=10)
    p.stage.seal_all()
    (second,) = [s for s in p.stage.sealed_segments() if s.ulid != first.ulid]
    _flip(second.path, offset=0)
    store.go.set()
    with pytest.raises(StagedDataLossError) as ei:
        h2.wait(Durability.REMOTE, timeout=30)
    assert ".corrupt" in ei.value.path and ei.value.sequences == second.sequences
    assert h2.wait(Durability.LOCAL, timeout=0), "LOCAL was reached; REMOTE never will be"
    assert h1.wait(Durability.REMOTE, timeout=30).sequence == 0
    h3 = p.produce([b"three"])  # the next one is unaffected
    p.close()
    assert h3.result() is not None
    assert p.stats["segments_quarantined"] == 1
    assert len(store.data_puts) == 2, "the corrupt segment was never uploaded"


@pytest.mark.parametrize("where", ["memory", "file"])
def test_I7_exporter_quarantines_a_segment_corrupted_after_open(tmp_path: Path, where: str) -> None:
    """Uploaded (memory://) or handed over as a hard link (a file:// store on the same
    disk, checked in place): a segment whose bytes changed after the open never lands."""
    seg = _sealed_stage(tmp_path)
    st = Stage(tmp_path, "p1", CFG)  # verified fine at open
    _flip(seg.path)
    store = open_store("memory://" if where == "memory" else f"file://{tmp_path}/store")
    lost: list[StagedDataLossError] = []
    ex = Exporter(st, store, ManifestQueue(store), on_lost=lambda k, e: lost.append(e))
    assert ex._linking == (where == "file")
    try:
        ex.drain(timeout=30)
    finally:
        ex.stop()
        st.close()
    assert [e.sequences for e in lost] == [seg.sequences]
    assert ex.stats.get("segments_quarantined") == 1
    assert list(store.list("data/")) == []


@pytest.mark.slow
def test_I7_the_service_reports_a_quarantined_segment_on_healthz_and_metrics(
    tmp_path: Path,
) -> None:
    from tests.service.server import start_server
    from tests.service.util import samples

    worker_stage = tmp_path / "stage" / "worker-0"
    st = Stage(worker_stage, None, CFG)  # the producer id the service will use
    try:
        st.append_records([b"doomed"]).result(10)
        (seg,) = st.seal_all()
    finally:
        st.close()
    _flip(seg.path)
    srv = start_server(f"file://{tmp_path}/buf", tmp_path, workers=1)
    try:
        h = srv.request("GET", "/healthz")
        assert h.status == 500 and "corrupt" in h.json()["error"], h.body
        assert ".corrupt" in h.json()["error"]
        m = samples(srv.metrics())
        assert m["tieredbuf_stage_quarantined_segments"] == 1
        assert m["tieredbuf_stage_segments_quarantined_total"] == 1
    finally:
        srv.terminate()
