"""The local tier: per-core WAL, open segments, sealed segment files, recovery."""

from tieredbuf.stage.segments import MetadataItem, SealedSegment, StageAck
from tieredbuf.stage.stage import Stage, StageStats

__all__ = ["MetadataItem", "SealedSegment", "Stage", "StageAck", "StageStats"]
