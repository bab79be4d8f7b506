"""The local tier: per-core WAL, open segments, sealed segment files, recovery.

| module | what it holds |
|---|---|
| `stage.py` | `Stage`, the facade: builds the parts below around one `StageState` |
| `stage_state.py` | `StageState`, shared by the stage's parts; `StageStats`, `SequenceFile` |
| `appender.py` | `Appender`: an append into the WAL and an open segment, the caps (I8) |
| `sealing.py` | `Sealer`: take, write and commit seals in sequence order; a failed seal |
| `upkeep.py` | `Upkeep`: the sealer threads (timer, size, caps) and re-seals after a disk fault |
| `release.py` | `Releaser`: the WAL cursor, release after export, quarantine |
| `stage_recovery.py` | `Replayer`: opening a stage, replaying the WAL into segments |
| `append_item.py` | what an append carries and gets back (`StageAck`); lock, producer id |
| `accumulators.py` | open segments: `RecordsAccumulator`, `BundleAccumulator` |
| `sealed_segment.py` | `SealedSegment`, segment kinds and names, the sidecar's JSON |
| `segment_check.py` | is a sealed segment's file intact (size, CRC) |
| `segments.py` | `SegmentDir`: write, load, recycle, delete, quarantine sealed files |
| `wal.py` | `WalWriter`, the WAL facade: appends; builds the parts below around one `WalState` |
| `wal_state.py` | `WalState` (what the WAL's parts share), `OpenFile`, `Rotation` |
| `wal_sync.py` | `WalSync`: group commit (sync rounds, the flusher thread) |
| `wal_rotation.py` | `WalRotation`: begin a rotation under the lock, commit it outside |
| `wal_purge.py` | `WalPurge`: the cursor sidecar, purge and recycling of passed files, reclaim |
| `wal_repair.py` | `WalRepair`: after a failed write or fdatasync, rewrite instead of re-sync |
| `wal_recovery.py` | opening a WAL directory: file names, recovery scan, replay |
| `filesystem.py` | `FileSystem`: every OS call the stage makes (the seam tests replace); `IoGate` |
| `malloc.py` | keep freed heap memory for the next segment (glibc) |
"""

from tieredbuf.stage.append_item import StageAck
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.stage import Stage
from tieredbuf.stage.stage_state import StageStats

__all__ = ["SealedSegment", "Stage", "StageAck", "StageStats"]
