"""What the WAL writer's parts share: :class:`WalState`, one object with public fields
that the writer (stage/wal.py), its sync rounds (stage/wal_sync.py), rotation
(stage/wal_rotation.py), purge (stage/wal_purge.py) and repair (stage/wal_repair.py)
each hold a reference to.  Fields are read and written under ``lock`` unless their
note says otherwise.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tieredbuf.config import WalConfig
from tieredbuf.errors import ClosedError, DiskError
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage.filesystem import FileSystem, IoGate
from tieredbuf.stage.wal_recovery import WalSpan

Done = list[tuple[Future[Any], object]]
"""Acks (or failures) decided under the lock, resolved after releasing it (resolve())."""


@dataclass(slots=True)
class OpenFile:
    """An open WAL file."""

    fd: int
    sync_lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    recycled: bool = False
    """A reused spare: zeros (allocated blocks) may follow the last entry."""


@dataclass(slots=True)
class Rotation:
    """A rotation begun under the lock (the old file renamed ``quiver.wal.N``, appends
    going to a fresh ``quiver.wal.new``) whose fdatasyncs, rename to ``quiver.wal`` and
    directory fsync are still to do -- outside the lock, by the next sync round."""

    old: OpenFile
    old_size: int
    """The old file's size up to its last entry (a recycled one is truncated to it)."""
    new: OpenFile
    span: WalSpan
    """The new active file's span (its path is the temp name until committed)."""
    tmp: Path


def resolve(done: Done) -> None:
    """Complete the futures decided under the lock (a DiskError value fails its future)."""
    for fut, value in done:
        if isinstance(value, DiskError):
            fut.set_exception(value)
        else:
            fut.set_result(value)


class WalState:
    """One WAL's files, positions, pending acks and failure state (the module doc)."""

    __slots__ = (
        "active",
        "active_span",
        "broken",
        "broken_at",
        "cfg_hash",
        "closing",
        "cond",
        "config",
        "cursor",
        "dir",
        "durable",
        "epoch",
        "frames",
        "fs",
        "gate",
        "last_error",
        "lock",
        "next_rotation",
        "pending",
        "resolve_later",
        "rotated",
        "rotating",
        "rotation",
        "scans",
        "spares",
        "written",
    )

    def __init__(
        self,
        directory: Path,
        cfg_hash: bytes,
        config: WalConfig,
        fs: FileSystem,
        gate: IoGate | None,
        spans: list[WalSpan],
        active: OpenFile,
        cursor: int,
        scans: deque[tuple[Path, wal_fmt.ScanResult, int]],
    ) -> None:
        self.dir = directory
        self.cfg_hash = cfg_hash
        self.config = config
        self.fs = fs
        """Every file operation goes through this (stage/filesystem.py)."""
        self.gate = gate
        """Marks sync rounds so segment write-back yields to them (filesystem.IoGate)."""
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.pending: deque[tuple[int, Future[Any], object]] = deque()
        """(end, future, value) of every append not yet durable, oldest first."""
        self.frames: deque[tuple[int, Sequence[bytes | memoryview]]] = deque()
        """(end, parts) of every frame written but not yet durable, oldest first: what
        a repair writes again (stage/wal_repair.py).  Bounded by one group commit."""
        self.broken: DiskError | None = None
        """A write or fdatasync failed and the repair has not succeeded yet."""
        self.broken_at: WalSpan | None = None
        """The committed file the repair cuts back to the durable position."""
        self.epoch = 0
        """Bumped when the WAL breaks: a sync round begun before must not ack."""
        self.last_error: DiskError | None = None
        """The last disk error, cleared by the next successful write (readiness)."""
        self.resolve_later: Done = []
        """Acks (or failures) decided under the lock, to resolve after releasing it."""
        self.closing = False
        self.rotation: Rotation | None = None
        """A begun rotation no sync round has claimed yet."""
        self.rotating = False
        """A sync round is finishing a rotation outside the lock."""
        self.rotated: list[WalSpan] = spans[:-1]
        """The rotated files, oldest first."""
        self.active_span: WalSpan = spans[-1]
        self.active = active
        self.spares: list[tuple[Path, int]] = []
        """(path, size) of zeroed purged files ready for reuse."""
        self.next_rotation = max((s.rotation_id or 0 for s in self.rotated), default=0) + 1
        self.cursor = cursor
        """The earliest position still needed (persisted in the cursor sidecar)."""
        self.written = self.active_span.end
        """Logical position after the last written byte."""
        self.durable = self.written
        """Every byte before this was covered by an fdatasync that returned."""
        self.scans = scans
        """The newest files' recovery scans, for the first replay (bounded, I8)."""

    def check_open(self) -> None:
        if self.closing:
            raise ClosedError("WAL is closed")

    def pop_durable(self) -> Done:
        """Under the lock: the appends up to ``durable``, to resolve (and their frames
        forgotten: they need no repair any more)."""
        done = []
        while self.pending and self.pending[0][0] <= self.durable:
            _, fut, value = self.pending.popleft()
            done.append((fut, value))
        while self.frames and self.frames[0][0] <= self.durable:
            self.frames.popleft()
        self.cond.notify_all()
        return done

    def disk_bytes(self) -> int:
        """Under the lock: WAL bytes plus spares (a recycled active file's zero tail is
        not counted: it is bounded by the rotation target the file grows to anyway)."""
        return (
            sum(s.file_size for s in self.rotated)
            + self.active_span.file_size
            + sum(size for _, size in self.spares)
        )

    def drop_spares(self) -> None:
        """Under the lock: unlink every spare."""
        spares, self.spares = self.spares, []
        for p, _ in spares:
            self.fs.unlink(p, missing_ok=True)
