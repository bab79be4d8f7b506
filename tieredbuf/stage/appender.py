"""Appends: one entry into the WAL (``wal`` durability) and an open segment, under
the stage's caps (I8) -- open-segment memory and stage disk -- and what an append at a
cap asks for (seals; with ``drop_oldest``, the oldest sealed segment's deletion).
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future

from tieredbuf.errors import BackpressureError, WalFullError
from tieredbuf.stage.accumulators import Accumulator
from tieredbuf.stage.append_item import BundleOrRecords, StageAck
from tieredbuf.stage.filesystem import disk_error
from tieredbuf.stage.stage_state import SequenceFile, StageState

log = logging.getLogger(__name__)


class Appender:
    """Stages appends (the module doc)."""

    def __init__(self, state: StageState, sequence: SequenceFile) -> None:
        self.state = state
        self.sequence = sequence

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
                st.check_usable()
                reason = self.over_cap(n)
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
                if reason is None:
                    break
                self.relieve(reason)
                if self.over_cap(n) is None and reason != "wal":
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BackpressureError(f"stage at its {reason} cap for {wait_s:.3g}s")
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
        ahead = open_bytes + st.written_bytes + n
        segs = st.sealed_bytes + st.released_bytes + st.segments.spare_bytes()
        wal = st.wal
        if wal is not None and segs + wal.config.max_size + 4096 + ahead <= st.config.size_cap:
            return None  # the WAL keeps itself under max_size (+ a header): no need to ask
        if st.disk_bytes() + ahead > st.config.size_cap:
            return "disk"
        return None

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
        except OSError as e:
            raise disk_error(e, "freeing stage disk space", st.path) from e

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
