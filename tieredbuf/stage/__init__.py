"""The local tier: per-core WAL, open segments, sealed segment files, recovery."""

from tieredbuf.stage.segments import SealedSegment, StageAck
from tieredbuf.stage.stage import Stage, StageStats

__all__ = ["SealedSegment", "Stage", "StageAck", "StageStats"]
