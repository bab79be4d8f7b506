"""What becomes of a sealed segment after export or when it is corrupt: the WAL cursor
moves past the entries sealed segments hold, an exported segment is released (deleted
once the cursor has passed its entries) and a corrupt one is quarantined.
docs/format-local.md, "When the cursor moves", says why.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tieredbuf.errors import DiskError, StageError
from tieredbuf.stage.filesystem import disk_error
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.stage_state import SequenceFile, StageState

log = logging.getLogger(__name__)


class Releaser:
    """Moves the WAL cursor, releases exported segments and quarantines corrupt ones."""

    def __init__(self, state: StageState, sequence: SequenceFile) -> None:
        self.state = state
        self.sequence = sequence

    def advance_cursor(self) -> None:
        """Move the WAL cursor to the first entry not yet in a sealed segment (never
        past the open segments: Quiver's truncation-safety rule), then delete the
        released segments it passed."""
        st = self.state
        wal = st.wal
        if wal is None:
            return
        with st.lock:
            entries = st.entries
            while entries:
                done = next(iter(entries.values()))[2]
                if not done:
                    break
                entries.popitem(last=False)
            if entries:
                pos = next(iter(entries.values()))[0]
            elif st.replay_frontier is not None:
                pos = st.replay_frontier
            else:
                pos = wal.end
        try:
            wal.advance_cursor(pos)
        except DiskError as e:
            # the cursor stays where it was (safe: more is replayed after a crash, and
            # sidecars keep sealed entries from being replayed); the next seal retries
            log.warning("WAL cursor not advanced: %s", e)
            with st.lock:
                st.faults["cursor"] = e
            return
        with st.lock:
            st.faults.pop("cursor", None)
            st.cond.notify_all()
        self._delete_passed()

    def release(self, segment: SealedSegment) -> None:
        """The exporter has appended ``segment`` to the queue: delete it -- at once if
        the WAL cursor has passed its entries, else once it has.

        Until the cursor passes a segment's entries its sidecar is what keeps them from
        being replayed after a crash: replayed, they could be sealed together with later
        entries into a segment whose append number the manifest's watermark does not
        cover, i.e. exported twice (I2).  The cursor stops at the first entry not yet in
        a sealed segment -- e.g. one in the other stream's open segment -- and moves only
        after a seal's commit, so an exporter can get there first.  A segment kept that
        way is exported again after a crash, and the watermark recognises it."""
        st = self.state
        with st.lock:
            if not st.forget_sealed(segment):
                raise StageError(f"not a sealed segment of this stage: {segment.path.name}")
            wal = st.wal
            if wal is not None and segment.wal_end is not None and wal.cursor < segment.wal_end:
                st.released.append(segment)
                st.released_bytes += segment.size
                return
        self._delete_released(segment)

    def _delete_released(self, segment: SealedSegment) -> None:
        """Delete an exported segment; on a disk error keep it (it is in the queue: a
        re-export after a crash is recognised) and try again after the next seal."""
        st = self.state
        try:
            self.sequence.write(segment.last_sequence)
            st.segments.delete(segment)
        except OSError as e:
            err = disk_error(e, "deleting an exported segment", segment.path)
            log.warning("%s; kept for now", err)
            with st.cond:
                st.faults["release"] = err
                if all(s.ulid != segment.ulid for s in st.released):
                    st.released.insert(0, segment)
                    st.released_bytes += segment.size
            return
        with st.cond:
            st.faults.pop("release", None)
            st.cond.notify_all()

    def _delete_passed(self) -> None:
        """Delete the released segments whose entries the (durable) cursor has passed."""
        st = self.state
        wal = st.wal
        if wal is None:
            return
        with st.lock:
            if not st.released:
                return
            cursor = wal.cursor
            due = [s for s in st.released if s.wal_end is not None and s.wal_end <= cursor]
            if not due:
                return
            st.released = [s for s in st.released if s not in due]
            st.released_bytes -= sum(s.size for s in due)
        for seg in due:
            self._delete_released(seg)

    def quarantine(self, segment: SealedSegment, why: str) -> Path:
        """``segment`` failed its CRC check: set it aside (never exported) and forget it,
        as :meth:`release` does; returns where it went."""
        st = self.state
        with st.lock:
            if not st.forget_sealed(segment):
                raise StageError(f"not a sealed segment of this stage: {segment.path.name}")
        self.sequence.write(segment.last_sequence)
        dest = st.segments.quarantine(segment, why)
        st.stats.segments_quarantined += 1
        with st.cond:
            st.cond.notify_all()
        return dest
