"""WalWriter's cursor and purge: persisting the cursor, deleting (or recycling) the
rotated files wholly behind it, and reclaiming space under pressure.  Purged files are
renamed ``quiver.wal.free.<K>`` and zeroed to be reused by the next rotation
(docs/format-local.md, "Recycling purged files"); WalWriter holds the state."""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tieredbuf.config import WalConfig
from tieredbuf.stage.filesystem import FileSystem, disk_error
from tieredbuf.stage.wal_recovery import FREE_PREFIX, WalSpan, write_cursor

log = logging.getLogger("tieredbuf.stage.wal")


class WalPurgeMixin:
    """WalWriter's cursor and purge (the module doc)."""

    if TYPE_CHECKING:
        max_spares: int
        from tieredbuf.errors import DiskError

        dir: Path
        config: WalConfig
        _fs: FileSystem
        _lock: threading.Lock
        _cursor_lock: threading.Lock
        _cursor: int
        _written: int
        _closing: bool
        _broken: DiskError | None
        _rotated: list[WalSpan]
        _active_span: WalSpan
        _spares: list[tuple[Path, int]]
        _spare_jobs: int
        _next_free: int
        _resolve_later: list[tuple[Future[Any], object]]

        def _disk_bytes(self) -> int: ...
        def _drop_spares_locked(self) -> None: ...
        def _rotate(self) -> list[tuple[Future[Any], object]]: ...

        @staticmethod
        def _resolve(done: list[tuple[Future[Any], object]]) -> None: ...

    def advance_cursor(self, position: int) -> None:
        """Persist ``position`` as the earliest WAL data still needed, then delete
        rotated files that lie wholly before it.  Never moves backwards."""
        try:
            self._advance_cursor(position)
        except OSError as e:
            raise disk_error(e, "WAL cursor update or purge", self.dir) from e

    def _advance_cursor(self, position: int) -> None:
        with self._cursor_lock:
            with self._lock:
                position = min(position, self._written)
                if position <= self._cursor:
                    return
            self._write_cursor(position)
            with self._lock:
                self._cursor = position
                gone = self._purge_locked(unlink=False)
                keep = max(0, self.max_spares - len(self._spares) - self._spare_jobs)
                keep = 0 if self._closing else min(keep, len(gone))
                self._spare_jobs += keep
            try:
                for p in gone[keep:]:
                    self._fs.unlink(p, missing_ok=True)
                renamed = [r for p in gone[:keep] if (r := self._rename_spare(p)) is not None]
                if gone:
                    # the renames (and unlinks) are durable before any zeroing: a crash
                    # must never leave a zeroed file under a WAL file's name
                    self._fs.fsync_dir(self.dir)
                for spare, size in renamed:
                    self._zero_spare(spare, size)
            finally:
                with self._lock:
                    self._spare_jobs -= keep

    def _rename_spare(self, path: Path) -> tuple[Path, int] | None:
        """Outside the lock: rename a purged file ``quiver.wal.free.<K>``."""
        with self._lock:
            k = self._next_free
            self._next_free += 1
        spare = self.dir / f"{FREE_PREFIX}{k}"
        try:
            size = self._fs.file_size(path)
            self._fs.rename(path, spare)
        except FileNotFoundError:
            return None
        return spare, size

    def _zero_spare(self, spare: Path, size: int) -> None:
        """Outside the lock: zero a renamed spare durably and offer it to the next
        rotation (or unlink it where zeroing is unsupported)."""
        try:
            self._fs.zero_file(spare, size)
        except OSError as e:
            log.debug("WAL: cannot zero %s (%s); unlinking it", spare, e)
            with contextlib.suppress(OSError):  # recovery deletes spares anyway
                self._fs.unlink(spare, missing_ok=True)
            return
        with self._lock:
            if self._closing:
                self._fs.unlink(spare, missing_ok=True)
            else:
                self._spares.append((spare, size))

    def reclaim(self) -> int:
        """Under disk pressure: if the cursor has passed part of the active file, rotate
        it so the covered part can be deleted, then purge.  Returns bytes freed."""
        done: list[tuple[Future[Any], object]] = []
        try:
            with self._lock:
                try:
                    if self._broken is not None:
                        return 0
                    before = self._disk_bytes()
                    active = self._active_span
                    self._purge_locked()
                    self._drop_spares_locked()
                    if (
                        self._cursor > active.start
                        and len(self._rotated) + 2 <= self.config.max_rotated_files
                    ):
                        self._resolve_later += self._rotate()
                        self._purge_locked()
                    return before - self._disk_bytes()
                except OSError as e:
                    raise disk_error(e, "WAL purge", self.dir) from e
                finally:
                    done, self._resolve_later = self._resolve_later, []
        finally:
            self._resolve(done)

    def _write_cursor(self, position: int) -> None:
        write_cursor(self._fs, self.dir, position)

    def _purge_locked(self, unlink: bool = True) -> list[Path]:
        keep: list[WalSpan] = []
        gone: list[WalSpan] = []
        for s in self._rotated:
            (gone if s.end <= self._cursor else keep).append(s)
        self._rotated = keep
        paths = [s.path for s in gone]
        if unlink:
            for p in paths:
                self._fs.unlink(p, missing_ok=True)
        return paths
