"""Opening a stage: its sealed segments, the next sequence, and the WAL entries no
sealed segment holds, replayed into open segments and sealed.

A crash after a segment is committed but before the WAL cursor moves is resolved by
sequence: WAL entries whose sequence a sealed segment's sidecar covers are not
replayed (no duplicates); every other entry is (no loss).  The same replay re-seals
everything after the cursor after a seal failed on a disk error (stage/upkeep.py).
"""

from __future__ import annotations

import logging

from tieredbuf import keys
from tieredbuf.errors import CorruptError
from tieredbuf.format import cursor as cursor_fmt
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage.accumulators import Accumulator
from tieredbuf.stage.release import Releaser
from tieredbuf.stage.sealing import Sealer
from tieredbuf.stage.stage_state import SequenceFile, StageState
from tieredbuf.stage.wal import WalWriter

log = logging.getLogger(__name__)

LAYOUT_CONTRACT = (
    b"tieredbuf.stage/1;slots=0..63;payload_type_id=slot;"
    b"schema_fingerprint=sha256(arrow ipc schema);entry 2=records"
)
"""What a WAL's segment_cfg_hash digests: how this build interprets bundle payloads."""


class Replayer:
    """Recovery at open (:meth:`recover`) and the WAL replay it shares with re-seals."""

    def __init__(
        self, state: StageState, sealer: Sealer, releaser: Releaser, sequence: SequenceFile
    ) -> None:
        self.state = state
        self.sealer = sealer
        self.releaser = releaser
        self.sequence = sequence

    def recover(self) -> None:
        """Load the sealed segments (quarantining corrupt ones), choose the next
        sequence, open the WAL and replay it.  On failure ``state.wal`` may be set: the
        caller closes it."""
        st = self.state
        fs = st.fs
        before = len(st.segments.quarantined())
        for seg in st.segments.load():
            st.add_sealed(seg)
        bad = st.segments.quarantined()
        st.stats.segments_quarantined += len(bad) - before
        covered = [r for s in st.sealed.values() for r in s.sequences]
        # a quarantined segment's sequences are never reused (they may be in the queue)
        next_seq = max((hi + 1 for s in bad for _, hi in s.sequences), default=0)
        next_seq = max(next_seq, max((hi + 1 for _, hi in covered), default=0))
        seq_path = self.sequence.path
        raw = fs.read_if_exists(seq_path)
        if raw is not None:
            try:
                next_seq = max(next_seq, cursor_fmt.decode_sequence(raw, str(seq_path)))
            except CorruptError as e:
                log.warning("ignoring sequence sidecar: %s", e)
        wal_dir = st.path / keys.WAL_DIR_NAME
        use_wal = st.config.durability == "wal"
        if use_wal or (fs.exists(wal_dir) and fs.listdir(wal_dir)):
            wal = WalWriter(
                wal_dir,
                wal_fmt.segment_cfg_hash(LAYOUT_CONTRACT),
                st.config.wal,
                st.gate,
                fs,
            )
            if wal.recovery.max_sequence is not None:
                next_seq = max(next_seq, wal.recovery.max_sequence + 1)
            st.wal = wal
            st.next_seq = next_seq
            self.replay(wal, covered)
            if not use_wal:  # segment_only now, but a WAL was left from a wal-mode run
                wal.close()
                st.wal = None
        st.next_seq = next_seq
        self.sequence.write()

    def replay(self, wal: WalWriter, covered: list[tuple[int, int]]) -> None:
        """Replay every WAL entry after the cursor whose sequence ``covered`` (the
        sealed segments' runs) does not hold into open segments, sealing them as they
        fill and at the end; then move the cursor."""
        st = self.state

        def is_covered(seq: int) -> bool:
            return any(lo <= seq <= hi for lo, hi in covered)

        for entry, start, end in wal.replay():
            live = isinstance(entry, wal_fmt.RecordsEntry | wal_fmt.BundleEntry) and not is_covered(
                entry.sequence
            )
            bundle = (
                entry.to_bundle(str(wal.dir))
                if (live and isinstance(entry, wal_fmt.BundleEntry))
                else None
            )
            with st.lock:
                st.entries[entry.sequence] = [start, end, int(not live)]
                # Entries past ``end`` are not read yet: a seal during replay must not
                # move the cursor beyond them (it would purge unread WAL files).
                st.replay_frontier = end
                if not live:
                    continue
                acc: Accumulator
                if bundle is not None:
                    acc = st.bundles_acc()
                    acc.add(bundle, entry.ingestion_ts_nanos, entry.sequence)
                else:
                    assert isinstance(entry, wal_fmt.RecordsEntry)
                    acc = st.records_acc()
                    acc.add(entry.records, entry.metadata, entry.ingestion_ts_nanos)
                acc.note(entry.sequence, start, end)
                st.stats.replayed_entries += 1
                full = acc.nbytes >= st.config.segment.target_size
            if full:
                self.sealer.seal(acc.stream)
        self.sealer.seal_all()
        with st.lock:
            st.replay_frontier = None
        self.releaser.advance_cursor()
