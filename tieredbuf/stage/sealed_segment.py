"""What a sealed segment is: :class:`SealedSegment` (the exporter's and recovery's view
of one file), its kinds and file names, and its sidecar's JSON (docs/format-local.md).

A sealed segment is ``<ULID>.<stream>`` in ``<stage>/segments/`` with its sidecar
``<ULID>.<stream>.json`` (stage/segments.py writes, lists and deletes them).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tieredbuf.format.manifest import MetadataItem

BATCH = "batch"
"""Opaque records, RFC 0001 data batch."""
QSEG = "qseg"
"""Arrow bundles, Quiver segment format."""
SIDECAR_SUFFIX = ".json"
SIDECAR_VERSION = 1
CORRUPT_SUFFIX = ".corrupt"
"""A quarantined segment: ``<ULID>.<stream>.corrupt`` (and ``.corrupt.json``)."""


@dataclass(frozen=True, slots=True)
class SealedSegment:
    """A sealed, durable, immutable segment file awaiting export."""

    path: Path
    stream: str  # "qseg" | "batch"
    ulid: str
    size: int
    sequences: tuple[tuple[int, int], ...]
    """Per-core sequences covered, as inclusive [lo, hi] runs."""
    wal_start: int | None
    wal_end: int | None
    """WAL positions [start, end) spanned by the covered entries (None: segment_only)."""
    items: tuple[MetadataItem, ...]
    """RFC metadata items (``batch`` only)."""
    entry_count: int
    """Bundles (``qseg``) or produce() calls (``batch``)."""
    record_count: int
    """Records (``batch``) or bundles (``qseg``)."""
    sealed_at_ms: int
    crc32: int | None = None
    """CRC32 of the whole file (``batch``; a ``qseg`` has one in its trailer).  None in a
    sidecar written before tieredbuf recorded it: such a segment is not checked."""

    @property
    def first_sequence(self) -> int:
        return self.sequences[0][0]

    @property
    def last_sequence(self) -> int:
        return self.sequences[-1][1]

    @property
    def sidecar_path(self) -> Path:
        return self.path.with_name(self.path.name + SIDECAR_SUFFIX)


def seq_runs(seqs: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Sorted inclusive runs of ``seqs``."""
    out: list[list[int]] = []
    for s in sorted(seqs):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        elif not out or s > out[-1][1]:
            out.append([s, s])
    return tuple((a, b) for a, b in out)


def sidecar_json(seg: SealedSegment) -> dict[str, Any]:
    """The sidecar of ``seg``, as JSON-ready data."""
    return {
        "version": SIDECAR_VERSION,
        "kind": seg.stream,
        "ulid": seg.ulid,
        "size": seg.size,
        "sequences": [list(r) for r in seg.sequences],
        "wal_start": seg.wal_start,
        "wal_end": seg.wal_end,
        "items": [
            [i.start_index, i.ingestion_time_ms, base64.b64encode(i.payload).decode()]
            for i in seg.items
        ],
        "entry_count": seg.entry_count,
        "record_count": seg.record_count,
        "sealed_at_ms": seg.sealed_at_ms,
        **({"crc32": seg.crc32} if seg.crc32 is not None else {}),
    }


def from_sidecar(path: Path, d: dict[str, Any], size: int | None) -> SealedSegment:
    """The segment at ``path`` that sidecar data ``d`` describes; ``size``: the segment
    file's (checked against the sidecar), None: not checked.  ValueError, KeyError or
    TypeError for a sidecar that does not parse."""
    if d["version"] != SIDECAR_VERSION:
        raise ValueError(f"unknown sidecar version {d['version']}")
    if size is not None and size != d["size"]:
        raise ValueError(f"size {size} != recorded {d['size']}")
    return SealedSegment(
        path,
        d["kind"],
        d["ulid"],
        int(d["size"]),
        tuple((int(a), int(b)) for a, b in d["sequences"]),
        d["wal_start"],
        d["wal_end"],
        tuple(MetadataItem(int(s), int(t), base64.b64decode(m)) for s, t, m in d["items"]),
        int(d["entry_count"]),
        int(d["record_count"]),
        int(d["sealed_at_ms"]),
        int(d["crc32"]) if d.get("crc32") is not None else None,
    )
