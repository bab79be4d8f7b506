"""Appends: one entry into the WAL (``wal`` durability) and an open segment, under
the stage's caps (I8) -- open-segment memory and stage disk -- and what an append at a
cap asks for (seals; with ``drop_oldest``, the oldest sealed segment's deletion).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from concurrent.futures import Future

from tieredbuf.errors import BackpressureError, DiskFullError, WalFullError
from tieredbuf.stage.accumulators import Accumulator
from tieredbuf.stage.append_item import BundleOrRecords, StageAck
from tieredbuf.stage.filesystem import disk_error
from tieredbuf.stage.stage_state import SequenceFile, StageState

log = logging.getLogger(__name__)

DISK_RESERVE = 1 << 20
"""Free bytes the stage leaves on its file system, at least (a 32nd of it, if more):
file system metadata and block rounding, a WAL file begun as another is rotated out."""
DISK_SAMPLE_S = 0.1
"""How long one sample of the file system's free space stands (a statvfs per append
would cost a system call on the hot path)."""


class Appender:
    """Stages appends (the module doc)."""

    def __init__(self, state: StageState, sequence: SequenceFile) -> None:
        self.state = state
        self.sequence = sequence
        self._room: int | None = None
        """What the stage's files may take on its file system: theirs plus the free
        space, less :data:`DISK_RESERVE` (None: unknown)."""
        self._room_at = -DISK_SAMPLE_S

    def append(self, item: BundleOrRecords, n: int, timeout: float | None) -> Future[StageAck]:
        """Stage ``item`` (``n`` bytes against the caps), waiting at most ``timeout``
        (default: backpressure_timeout) at a cap.  The future completes at the LOCAL
        ack: after the WAL fdatasync (``wal``) or the segment seal (``segment_only``)."""
        st = self.state
        wait_s = st.config.backpressure_timeout.total_seconds() if timeout is None else timeout
        deadline = time.monotonic() + wait_s
        fut: Future[StageAck] = Future()
        # the Lock itself, not the Condition over it: Condition.__enter__/__exit__ are
        # Python frames (~8% of the GIL-held samples with four producer threads)
        with st.lock:
            while True:
                full: DiskFullError | None = None
                try:
                    st.check_usable()
                except DiskFullError as e:  # a seal met a full disk: wait as at a cap
                    full = e
                reason = "disk" if full is not None else self.over_cap(n)
                wal_append = None
                if reason is None:
                    seq, ts = st.next_seq, time.time_ns()
                    if st.wal is not None:
                        try:
                            # the WAL resolves ``fut`` itself once the entry is durable
                            wal_append = st.wal.append(
                                item.encode(seq, ts),
                                wait=False,
                                future=fut,
                                result=functools.partial(StageAck, seq),
                            )
                        except WalFullError:
                            reason = "wal"
                        except DiskFullError as e:  # cut off; nothing acked: wait, again
                            full, reason = e, "disk"
                if reason is None:
                    if st.faults:
                        st.faults.pop("room", None)
                    break
                room: DiskFullError | None = None
                if full is None and reason == "disk" and self._fs_binds():
                    # the file system, not size_cap, is full: readiness says so meanwhile
                    room = st.faults["room"] = DiskFullError(
                        f"the stage's file system is full ({self.state.path}): appends "
                        "wait for the exporter to free space",
                        errno.ENOSPC,
                        str(self.state.path),
                    )
                self.relieve(reason)
                if full is None and self.over_cap(n) is None and reason != "wal":
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if full is not None or room is not None:
                        raise full or room  # type: ignore[misc]
                    raise BackpressureError(
                        f"stage at its {self._cap_name(reason)} for {wait_s:.3g}s"
                    )
                st.stats.backpressure_waits += 1
                st.cond.wait(remaining)
            st.next_seq = seq + 1
            if item.bundle is not None:
                st.stats.bundles_in += 1
            else:
                st.stats.records_in += len(item.records)
            st.stats.bytes_in += n
            acc: Accumulator
            if item.bundle is not None:
                acc = st.bundles_acc()
                acc.add(item.bundle, ts, seq)
            else:
                acc = st.records_acc()
                acc.add(item.records, item.metadata, ts, item.size, item.block)
            start = end = None
            if wal_append is not None:
                start, end = wal_append.start, wal_append.end
                st.entries[seq] = [start, end, 0]
            acc.note(seq, start, end)
            ack = StageAck(seq, start, end)
            if wal_append is None:
                acc.futures.append((fut, ack))
            if acc.nbytes >= st.config.segment.target_size:
                st.seal_requested.add(acc.stream)
                st.cond.notify_all()
        if wal_append is not None:
            assert st.wal is not None
            st.wal.wait_durable(wal_append.end)  # flush_interval == 0: sync before return
        return fut

    # --- the caps (I8): open-segment memory and stage disk -----------------------------

    def over_cap(self, n: int) -> str | None:
        """Under the lock: which cap ``n`` more bytes would cross, or None."""
        st = self.state
        open_bytes = st.open_bytes() + st.sealing_bytes
        if open_bytes and open_bytes + n > st.config.segment.max_open_bytes:
            return "open-segment memory"
        # open and sealing segments are disk bytes about to be written, written ones
        # are on disk uncommitted (I8: the cap holds for the files on disk at every
        # moment, not just between seals)
        # (the file system's free space is a cap too: a full disk waits for the exporter
        # to free space, as at size_cap, rather than failing the append with ENOSPC)
        ahead = open_bytes + st.written_bytes + n
        segs = st.sealed_bytes + st.released_bytes + st.segments.spare_bytes()
        cap = self._disk_cap()
        wal = st.wal
        if wal is not None and segs + wal.config.max_size + 4096 + ahead <= cap:
            return None  # the WAL keeps itself under max_size (+ a header): no need to ask
        if cap < st.config.size_cap:  # the file system binds: leave room for the WAL's
            ahead += open_bytes + n  # rewrite of its live tail (reclaim) beside the seal
        if st.disk_bytes() + ahead > cap:
            return "disk"
        return None

    def _disk_cap(self) -> int:
        """Under the lock: ``size_cap``, or less where the file system has less room."""
        st = self.state
        now = time.monotonic()
        if now - self._room_at >= DISK_SAMPLE_S:
            self._room_at = now
            try:
                vfs = os.statvfs(st.path)
            except (OSError, TypeError, ValueError):  # not a real directory (a test's fs)
                self._room = None
            else:
                # the stage's own files, less those on their way out (released, being
                # deleted: counting them as the stage's and as free would count them twice)
                free = vfs.f_bavail * vfs.f_frsize
                mine = st.disk_bytes() - st.released_bytes
                reserve = max(DISK_RESERVE, vfs.f_blocks * vfs.f_frsize // 32)
                self._room = mine + free - reserve
        cap = st.config.size_cap
        return cap if self._room is None else min(cap, self._room)

    def _fs_binds(self) -> bool:
        """The file system's room, not size_cap, is the disk cap now."""
        return self._room is not None and self._room < self.state.config.size_cap

    def _cap_name(self, reason: str) -> str:
        return f"{reason} cap"

    def relieve(self, reason: str) -> None:
        """Under the lock, at a cap: ask for seals; with drop_oldest, drop sealed data."""
        st = self.state
        want = {k for k, a in (("batch", st.records), ("qseg", st.bundles)) if a}
        if not want <= st.seal_requested:
            # notify only for a new request: producers waiting at the cap each call this,
            # and an unconditional notify_all woke the others into a ping-pong (33 k
            # wake-ups in a 1 s run at 64 KiB) that starved the sealer of the GIL
            st.seal_requested |= want
            st.cond.notify_all()
        if reason != "disk":
            return
        try:
            self._relieve_disk()
        except DiskFullError as e:  # a WAL rewrite met the full disk: wait for exports
            log.info("stage %s: no room to reclaim WAL space yet: %s", st.path, e)
        except OSError as e:
            err = disk_error(e, "freeing stage disk space", st.path)
            if not isinstance(err, DiskFullError):
                raise err from e
            log.info("stage %s: no room to reclaim WAL space yet: %s", st.path, err)

    def _relieve_disk(self) -> None:
        st = self.state
        if st.segments.drop_spares() > 0:
            return
        if st.wal is not None and st.wal.reclaim() > 0:
            return
        if st.config.size_cap_policy == "drop_oldest" and st.sealed:
            seg = next(iter(st.sealed.values()))
            self.sequence.write(seg.last_sequence)
            st.forget_sealed(seg)
            st.segments.delete(seg)
            st.stats.dropped_segments += 1
            if seg.stream == "batch":
                st.stats.dropped_records += seg.record_count
            else:
                st.stats.dropped_bundles += seg.record_count
            log.warning(
                "drop_oldest: deleted unexported segment %s (%d entries)",
                seg.path.name,
                seg.entry_count,
            )
