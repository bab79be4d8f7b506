"""The local tier: per-core WAL, open segments, sealed segment files, recovery."""

from tieredbuf.stage.append_item import StageAck
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.stage import Stage, StageStats

__all__ = ["SealedSegment", "Stage", "StageAck", "StageStats"]
