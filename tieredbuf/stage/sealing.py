"""Sealing: an open segment becomes a sealed segment file.

A seal is taken under the stage lock (the accumulator detached, with a commit ticket
and a ULID, both in sequence order), written durably outside it -- concurrently with
other seals -- and committed in ticket order, so segments commit in sequence order
(the exporter relies on it); then the WAL cursor moves (stage/release.py).  What a
seal that fails does depends on why: a disk error under ``wal`` durability makes the
sealer threads re-seal from the WAL (stage/upkeep.py), under ``segment_only`` it fails
that seal's appends; any other error stops the stage.  docs/format-local.md, "Disk
faults", says why.
"""

from __future__ import annotations

import contextlib
import functools
import time

from tieredbuf.errors import DiskError, StageError
from tieredbuf.stage.accumulators import Accumulator
from tieredbuf.stage.filesystem import disk_error
from tieredbuf.stage.release import Releaser
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.segments import CommitNotDurable, PreparedSegment
from tieredbuf.stage.stage_state import SealJob, StageState


class Sealer:
    """Takes, writes and commits seals, and decides what a failed one does."""

    def __init__(self, state: StageState, releaser: Releaser) -> None:
        self.state = state
        self.releaser = releaser

    def seal(self, stream: str) -> SealedSegment | None:
        """Seal one accumulator: write the file durably, then move the cursor."""
        with self.state.lock:
            job = self.take(stream)
        return None if job is None else self.run(job)

    def seal_all(self) -> list[SealedSegment]:
        """Seal every open segment, and wait for the seals already under way."""
        out = [s for k in ("batch", "qseg") if (s := self.seal(k)) is not None]
        self.wait_committed()
        return out

    def take(self, stream: str) -> SealJob | None:
        """Under the lock: detach ``stream``'s accumulator for sealing, with its commit
        ticket and segment ULID (both in sequence order)."""
        st = self.state
        acc: Accumulator | None
        if stream == "batch":
            acc, st.records = st.records, None
        else:
            acc, st.bundles = st.bundles, None
        st.seal_requested.discard(stream)
        if acc is None or len(acc) == 0:
            return None
        nbytes = acc.nbytes
        st.sealing_bytes += nbytes
        ticket = st.seal_tickets
        st.seal_tickets += 1
        return SealJob(acc, ticket, st.segments.next_ulid(), nbytes, gen=st.seal_gen)

    def _written(self, job: SealJob) -> None:
        """The segment's bytes are in its temp file (page cache): drop the accumulator's
        buffers and count them as disk bytes, not memory -- appends waiting at
        max_open_bytes go on while the file is written back and fdatasynced."""
        job.acc.drop_buffers()
        st = self.state
        with st.lock:
            job.written = True
            st.sealing_bytes -= job.nbytes
            st.written_bytes += job.nbytes
            st.cond.notify_all()

    def run(self, job: SealJob) -> SealedSegment:
        """Write the segment durably (concurrently with other seals), then -- in ticket
        order, so segments commit in sequence order (the exporter relies on it) --
        commit it, account for it and move the cursor."""
        st = self.state
        acc = job.acc
        prep: PreparedSegment | None = None
        err: BaseException | None = None
        try:
            prep = st.segments.prepare(acc, job.ulid, written=functools.partial(self._written, job))
        except BaseException as e:
            err = e
        with st.cond:
            while st.committed_tickets != job.ticket:
                st.cond.wait()
        try:
            if err is None and st.failed is not None:
                err = StageError(f"an earlier seal failed: {st.failed}")
            if err is None and job.gen != st.seal_gen:
                err = StageError(
                    "an earlier seal failed on a disk error; this one is sealed again from the WAL"
                )
            if err is not None:
                raise err
            assert prep is not None
            # no sequence sidecar write here: this segment's sidecar and the WAL still
            # hold its sequences; release() and drop_oldest persist it before deleting
            seg = st.segments.commit(prep)
        except BaseException as e:
            raise self._failed(job, e, prep) from None
        with st.lock:
            st.unaccount(job)
            st.faults.pop("seal", None)
            st.stats.segments_sealed += 1
            st.add_sealed(seg)
            for seq in acc.seqs:
                slot = st.entries.get(seq)
                if slot is not None:
                    slot[2] = 1
            st.cond.notify_all()
        try:
            self.releaser.advance_cursor()
        finally:
            with st.lock:
                st.committed_tickets += 1
                st.cond.notify_all()
        for f, ack in acc.futures:
            f.set_result(ack)
        return seg

    def wait_committed(self) -> None:
        """Wait for every seal taken so far to commit (or fail)."""
        st = self.state
        with st.cond:
            target = st.seal_tickets
            while st.committed_tickets < target:
                st.cond.wait()

    def _failed(
        self, job: SealJob, e: BaseException, prep: PreparedSegment | None
    ) -> BaseException:
        """A seal failed: account for it, fail its appends (segment_only) and decide
        what the stage does (see the module doc); returns the error to raise."""
        st = self.state
        acc = job.acc
        uncertain = e.segment if isinstance(e, CommitNotDurable) else None
        if isinstance(e, OSError):
            e = disk_error(e, "sealing a segment", st.segments.path)
        if uncertain is not None and st.wal is None:  # undo, best effort
            with contextlib.suppress(OSError):
                st.segments.fs.unlink(uncertain.sidecar_path, missing_ok=True)
                st.segments.fs.unlink(uncertain.path, missing_ok=True)
            uncertain = None
        with st.lock:
            if uncertain is not None:  # in place, names maybe not durable: reseal
                st.uncertain.append(uncertain)
            if not isinstance(e, DiskError):
                if st.failed is None and job.gen == st.seal_gen:
                    st.failed = e
            elif st.wal is not None:
                # its entries are durable in the WAL: refuse appends until a sealer
                # has sealed everything after the cursor again (Upkeep.reseal)
                st.seal_fault = e
                st.seal_gen += 1
                st.reseal_delay = min(2.0, max(0.05, 2 * st.reseal_delay))
                st.reseal_at = time.monotonic() + st.reseal_delay
            else:
                st.faults["seal"] = e  # segment_only: those appends fail (below)
            st.unaccount(job)
            st.committed_tickets += 1
            st.cond.notify_all()
        if prep is not None:  # best effort; recovery deletes .tmp files anyway
            with contextlib.suppress(OSError):
                st.segments.discard(prep)
        for f, _ in acc.futures:
            f.set_exception(e if isinstance(e, DiskError) else StageError(f"sealing failed: {e}"))
        return e
