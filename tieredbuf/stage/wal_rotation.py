"""WAL rotation: retiring the active file and starting a fresh one (stage/wal.py's
module doc says how it is split between the lock and the next sync round).

Rotation holds the lock only for two renames' worth of work: the old file is renamed
``quiver.wal.N`` and appends continue into a new file created as ``quiver.wal.new``
(header written, not yet synced), or into a recycled spare renamed so.  The rest --
:meth:`WalRotation.commit` -- is done outside the lock by the next sync round
(stage/wal_sync.py), or inline when another rotation is needed before one ran.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage.filesystem import disk_error
from tieredbuf.stage.wal_recovery import ACTIVE_NAME, NEW_NAME, WalSpan
from tieredbuf.stage.wal_repair import WalRepair
from tieredbuf.stage.wal_state import Done, OpenFile, Rotation, WalState

log = logging.getLogger(__name__)


class WalRotation:
    """Begins rotations under the lock and commits them (the module doc)."""

    def __init__(self, state: WalState, repair: WalRepair) -> None:
        self.state = state
        self.repair = repair
        self.recycled = 0
        """Rotations that reused a spare (metrics)."""

    def rotate(self) -> Done:
        """Under the lock: retire the active file and start a fresh one; the syncs are
        left to the next sync round (see Rotation).  A rotation still pending is
        committed first (inline: this is the rare path of a file filled within one
        flush interval, or a reclaim at a cap).  Acks it decides go to
        ``state.resolve_later`` (the caller resolves them after releasing the lock)."""
        st = self.state
        st.resolve_later += self.settle()
        old = st.active
        rid = st.next_rotation
        st.next_rotation += 1
        span = st.active_span
        target = st.dir / f"{ACTIVE_NAME}.{rid}"
        fs = st.fs
        try:
            fs.rename(span.path, target)
        except OSError as e:  # nothing changed
            st.next_rotation -= 1
            st.last_error = disk_error(e, "WAL rotation", span.path)
            raise st.last_error from e
        span.path, span.rotation_id = target, rid
        tmp = st.dir / NEW_NAME
        header = wal_fmt.encode_header(st.cfg_hash, st.written)
        recycled = False
        if st.spares:
            # a zeroed spare: header at 0, entries overwrite zeros (see module doc)
            spare, _ = st.spares.pop()
            try:
                fs.rename(spare, tmp)
                recycled = True
            except OSError as e:
                log.warning("WAL spare %s unusable (%s); creating a new file", spare, e)
        flags = os.O_WRONLY | os.O_CREAT | (0 if recycled else os.O_TRUNC)
        try:
            fd = fs.open(tmp, flags, 0o644)
            try:
                fs.write_all(fd, [header])
            except OSError:
                fs.close(fd)
                raise
        except OSError as e:  # the old file is renamed, no new one: repair makes one
            self.repair.fail_pending_and_raise(disk_error(e, "WAL rotation", tmp))
            return []  # repaired at once: the repair made the new active file
        st.rotated.append(span)
        self.recycled += recycled
        st.active_span = WalSpan(tmp, None, st.written, st.written, len(header))
        st.active = OpenFile(fd, recycled=recycled)
        st.rotation = Rotation(old, span.file_size, st.active, st.active_span, tmp)
        return []

    def settle(self) -> Done:
        """Under the lock: make sure no rotation is pending (wait for a sync round that
        is committing one; commit an unclaimed one here)."""
        st = self.state
        while st.rotating:
            st.cond.wait()
        st.check_open()
        if st.broken is not None:
            raise st.broken
        rot, st.rotation = st.rotation, None
        if rot is None:
            return []
        try:
            self.commit(rot)
        except OSError as e:
            st.rotation = rot
            self.repair.fail_pending_and_raise(disk_error(e, "WAL rotation", st.dir))
            return []  # repaired at once
        rot.span.path = st.dir / ACTIVE_NAME
        st.durable = st.written
        return st.pop_durable()

    def commit(self, rot: Rotation, old_durable: Callable[[], None] | None = None) -> None:
        """The I/O of a rotation: old file durable and closed, new file durable and
        renamed into place, directory fsynced.  Called by one thread per rotation.
        ``old_durable`` runs once the old file's fdatasync returned: its entries are
        durable then, whatever happens to the renames (a crash leaves the old file
        under its old or its rotated name, and recovery reads either)."""
        fs = self.state.fs
        directory = self.state.dir
        with rot.old.sync_lock:
            if not rot.old.closed:
                if rot.old.recycled:  # only the newest file may end in zeros
                    fs.ftruncate(rot.old.fd, rot.old_size)
                fs.fdatasync(rot.old.fd)
                fs.close(rot.old.fd)
                rot.old.closed = True
        if old_durable is not None:
            old_durable()
        fs.fdatasync(rot.new.fd)
        # the old file's rename to quiver.wal.N must be durable before the new file
        # takes its name: were only the second rename to survive a power cut, the old
        # file -- acknowledged entries -- would have no name left
        fs.fsync_dir(directory)
        fs.rename(rot.tmp, directory / ACTIVE_NAME)
        fs.fsync_dir(directory)
