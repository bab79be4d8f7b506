"""WalWriter's cursor and purge: persisting the cursor, deleting (or recycling) the
rotated files wholly behind it, and reclaiming space under pressure.  Purged files are
renamed ``quiver.wal.free.<K>`` and zeroed to be reused by the next rotation
(docs/format-local.md, "Recycling purged files").  Works on the writer's state
(stage/wal_state.py)."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

from tieredbuf.stage.filesystem import disk_error
from tieredbuf.stage.wal_recovery import FREE_PREFIX, WalSpan, write_cursor
from tieredbuf.stage.wal_rotation import WalRotation
from tieredbuf.stage.wal_state import Done, WalState, resolve

log = logging.getLogger(__name__)


class WalPurge:
    """The WAL's cursor and purge (the module doc)."""

    max_spares = 1
    """Purged files kept (zeroed) for reuse by the next rotation; 0 unlinks them."""

    def __init__(self, state: WalState, rotation: WalRotation) -> None:
        self.state = state
        self.rotation = rotation
        self.cursor_lock = threading.Lock()
        """Serialises cursor updates (the sidecar write is outside the state lock)."""
        self.spare_jobs = 0
        """Purged files being turned into spares outside the lock (under the lock)."""
        self.next_free = 0

    def advance_cursor(self, position: int) -> None:
        """Persist ``position`` as the earliest WAL data still needed, then delete
        rotated files that lie wholly before it.  Never moves backwards."""
        try:
            self._advance_cursor(position)
        except OSError as e:
            raise disk_error(e, "WAL cursor update or purge", self.state.dir) from e

    def _advance_cursor(self, position: int) -> None:
        st = self.state
        with self.cursor_lock:
            with st.lock:
                position = min(position, st.written)
                if position <= st.cursor:
                    return
            write_cursor(st.fs, st.dir, position)
            with st.lock:
                st.cursor = position
                gone = self.purge_locked(unlink=False)
                keep = max(0, self.max_spares - len(st.spares) - self.spare_jobs)
                keep = 0 if st.closing else min(keep, len(gone))
                self.spare_jobs += keep
            try:
                for p in gone[keep:]:
                    st.fs.unlink(p, missing_ok=True)
                renamed = [r for p in gone[:keep] if (r := self._rename_spare(p)) is not None]
                if gone:
                    # the renames (and unlinks) are durable before any zeroing: a crash
                    # must never leave a zeroed file under a WAL file's name
                    st.fs.fsync_dir(st.dir)
                for spare, size in renamed:
                    self._zero_spare(spare, size)
            finally:
                with st.lock:
                    self.spare_jobs -= keep

    def _rename_spare(self, path: Path) -> tuple[Path, int] | None:
        """Outside the lock: rename a purged file ``quiver.wal.free.<K>``."""
        st = self.state
        with st.lock:
            k = self.next_free
            self.next_free += 1
        spare = st.dir / f"{FREE_PREFIX}{k}"
        try:
            size = st.fs.file_size(path)
            st.fs.rename(path, spare)
        except FileNotFoundError:
            return None
        return spare, size

    def _zero_spare(self, spare: Path, size: int) -> None:
        """Outside the lock: zero a renamed spare durably and offer it to the next
        rotation (or unlink it where zeroing is unsupported)."""
        st = self.state
        try:
            st.fs.zero_file(spare, size)
        except OSError as e:
            log.debug("WAL: cannot zero %s (%s); unlinking it", spare, e)
            with contextlib.suppress(OSError):  # recovery deletes spares anyway
                st.fs.unlink(spare, missing_ok=True)
            return
        with st.lock:
            if st.closing:
                st.fs.unlink(spare, missing_ok=True)
            else:
                st.spares.append((spare, size))

    def reclaim(self) -> int:
        """Under disk pressure: if the cursor has passed part of the active file, rotate
        it so the covered part can be deleted, then purge.  Returns bytes freed."""
        st = self.state
        done: Done = []
        try:
            with st.lock:
                try:
                    if st.broken is not None:
                        return 0
                    before = st.disk_bytes()
                    active = st.active_span
                    self.purge_locked()
                    st.drop_spares()
                    if (
                        st.cursor > active.start
                        and len(st.rotated) + 2 <= st.config.max_rotated_files
                    ):
                        st.resolve_later += self.rotation.rotate()
                        self.purge_locked()
                    return before - st.disk_bytes()
                except OSError as e:
                    raise disk_error(e, "WAL purge", st.dir) from e
                finally:
                    done, st.resolve_later = st.resolve_later, []
        finally:
            resolve(done)

    def purge_locked(self, unlink: bool = True) -> list[Path]:
        """Under the lock: forget the rotated files wholly behind the cursor (and unlink
        them, with ``unlink``); returns their paths."""
        st = self.state
        keep: list[WalSpan] = []
        gone: list[WalSpan] = []
        for s in st.rotated:
            (gone if s.end <= st.cursor else keep).append(s)
        st.rotated = keep
        paths = [s.path for s in gone]
        if unlink:
            for p in paths:
                st.fs.unlink(p, missing_ok=True)
        return paths
