"""Opening a WAL directory: file names, the recovery scan, replay (stage/wal.py appends).

Recovery reads every WAL file, truncates a torn tail (the newest file's, also when
only zeros follow it: a recycled file), refuses a mid-file CRC error unless
``corrupt_policy='truncate'``, checks that the files are contiguous, clamps the
cursor sidecar to the files, deletes spares, and creates the active file if a crash
left none.  See docs/format-local.md.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tieredbuf.config import WalConfig
from tieredbuf.errors import CorruptError
from tieredbuf.format import cursor as cursor_fmt
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage.filesystem import FileSystem

log = logging.getLogger(__name__)

ACTIVE_NAME = "quiver.wal"
NEW_NAME = "quiver.wal.new"
"""The next active file while a rotation is being committed (see wal_state.Rotation)."""
CURSOR_NAME = "quiver.wal.cursor"
FREE_PREFIX = "quiver.wal.free."
_ROTATED_RE = re.compile(r"^quiver\.wal\.(\d+)$")
_FREE_RE = re.compile(r"^quiver\.wal\.free\.(\d+)$")


@dataclass(slots=True)
class WalSpan:
    """One WAL file: logical positions [start, end)."""

    path: Path
    rotation_id: int | None
    start: int
    end: int
    header_size: int

    @property
    def file_size(self) -> int:
        return self.header_size + self.end - self.start


@dataclass(frozen=True, slots=True)
class WalRecovery:
    """What opening the WAL found and repaired."""

    cursor_status: str
    """ok | missing | corrupt | past_end (clamped down) | before_start (clamped up)"""
    torn_bytes: int
    """Bytes of a torn tail truncated away (a crash mid-append)."""
    corrupt_bytes: int
    """Bytes dropped after a mid-file CRC error (only with corrupt_policy='truncate')."""
    max_sequence: int | None
    """Highest per-core sequence in any WAL file (before or after the cursor)."""


@dataclass(slots=True)
class Recovered:
    """What :func:`recover` leaves for the writer."""

    recovery: WalRecovery
    spans: list[WalSpan]
    """Every WAL file, oldest first; the last is the active one."""
    cursor: int
    scans: deque[tuple[Path, wal_fmt.ScanResult, int]]
    """The newest files' scans (path, result, bytes read), kept for replay."""


def recover(fs: FileSystem, directory: Path, cfg_hash: bytes, config: WalConfig) -> Recovered:
    """Scan and repair ``directory``'s WAL files (see the module doc)."""
    tmp = directory / (CURSOR_NAME + ".tmp")
    if fs.exists(tmp):  # crash between sidecar tmp and rename: the live one stands
        fs.unlink(tmp)
    cursor, status = read_cursor(fs, directory)
    # spares are not WAL files: their zeroing may not have finished before a crash
    names = fs.listdir(directory)
    for name in names:
        if _FREE_RE.match(name):
            fs.unlink(directory / name)
    rotated = sorted(
        (int(m.group(1)), directory / name) for name in names if (m := _ROTATED_RE.match(name))
    )
    paths: list[tuple[int | None, Path]] = [(rid, p) for rid, p in rotated]
    active = directory / ACTIVE_NAME
    if ACTIVE_NAME in names:
        paths.append((None, active))
    spans: list[WalSpan] = []
    torn = corrupt = 0
    max_seq: int | None = None
    # the newest scans, up to 2 x rotation_target bytes (a full file overshoots the
    # target by up to one entry), are kept for replay() so the files it reads first
    # are not decoded twice; bounded (I8)
    scans: deque[tuple[Path, wal_fmt.ScanResult, int]] = deque()
    kept = 0
    for i, (rid, path) in enumerate(paths):
        data = fs.read_bytes(path)
        res = wal_fmt.scan(data, str(path), cfg_hash)
        scans.append((path, res, len(data)))
        kept += len(data)
        while kept > 2 * config.rotation_target and scans:
            kept -= scans.popleft()[2]
        if res.status != "clean":
            assert res.error is not None
            last = i == len(paths) - 1
            status_i = res.status
            if (
                status_i == "corrupt"
                and last
                and (torn_before_zeros(data, res.good_end) or never_written(data, res.good_end))
            ):
                status_i = "torn"  # a recycled file's zeros, or a write a power cut lost
            if status_i == "corrupt" or not last:
                if config.corrupt_policy == "fail":
                    raise res.error
                corrupt += len(data) - res.good_end
                log.error(
                    "WAL %s: dropping %d bytes after %s", path, len(data) - res.good_end, res.error
                )
            else:
                torn += len(data) - res.good_end
            truncate(fs, path, res.good_end)
        for e in res.entries:
            if e.entry_type != wal_fmt.ENTRY_CHECKPOINT:
                max_seq = e.sequence if max_seq is None else max(max_seq, e.sequence)
        h = res.header
        spans.append(
            WalSpan(
                path,
                rid,
                h.wal_position_start,
                h.wal_position_start + res.good_end - h.header_size,
                h.header_size,
            )
        )
    spans, purged = _finish_purge(fs, directory, spans, cursor)
    for prev, span in itertools.pairwise(spans):
        if prev.end != span.start:
            raise CorruptError(
                wal_fmt.WHAT,
                str(span.path),
                30,
                f"wal_position_start {span.start} does not continue the previous file's "
                f"end {prev.end} (a WAL file is missing)",
            )
    if purged and cursor is not None and spans and cursor < spans[0].start:
        raise CorruptError(
            wal_fmt.WHAT,
            str(spans[0].path),
            30,
            f"the cursor {cursor} precedes the oldest WAL file left ({spans[0].start}) "
            "(a WAL file is missing)",
        )
    end = spans[-1].end if spans else 0
    if cursor is not None and cursor > end:
        status, cursor = "past_end", end
    if spans and cursor is not None and cursor < spans[0].start:
        log.warning("WAL cursor %d precedes the oldest file (%d)", cursor, spans[0].start)
        status, cursor = "before_start", spans[0].start
    if cursor is None:
        cursor = spans[0].start if spans else 0
    if not spans or spans[-1].rotation_id is not None:
        # first open, or a crash between rotating and creating the new active file
        spans.append(create_active(fs, directory, cfg_hash, max(end, cursor)))
    else:
        fd = fs.open(spans[-1].path, os.O_RDONLY)
        try:
            fs.fdatasync(fd)
        finally:
            fs.close(fd)
    if status != "ok":
        write_cursor(fs, directory, cursor)
    return Recovered(WalRecovery(status, torn, corrupt, max_seq), spans, cursor, scans)


def _finish_purge(
    fs: FileSystem, directory: Path, spans: list[WalSpan], cursor: int | None
) -> tuple[list[WalSpan], bool]:
    """Delete rotated files wholly behind the cursor: a purge (renames to spares and
    unlinks, one directory fsync for all) interrupted by a power cut can leave any
    subset of them, so they may not be contiguous any more; they hold nothing needed."""
    if cursor is None:
        return spans, False
    stale = [s for s in spans if s.rotation_id is not None and s.end <= cursor]
    if not stale:
        return spans, False
    for s in stale:
        fs.unlink(s.path, missing_ok=True)
    fs.fsync_dir(directory)
    return [s for s in spans if s not in stale], True


def read_cursor(fs: FileSystem, directory: Path) -> tuple[int | None, str]:
    path = directory / CURSOR_NAME
    raw = fs.read_if_exists(path)
    if raw is None:
        return None, "missing"
    try:
        return cursor_fmt.decode_cursor(raw, str(path)), "ok"
    except CorruptError as e:
        log.warning("ignoring WAL cursor: %s (replaying from the oldest file)", e)
        return None, "corrupt"


def truncate(fs: FileSystem, path: Path, size: int) -> None:
    fd = fs.open(path, os.O_WRONLY)
    try:
        fs.ftruncate(fd, size)
        fs.fdatasync(fd)
    finally:
        fs.close(fd)


def create_active(fs: FileSystem, directory: Path, cfg_hash: bytes, start: int) -> WalSpan:
    """Create ``quiver.wal`` (header only) durably, via ``quiver.wal.new``."""
    path = directory / ACTIVE_NAME
    header = wal_fmt.encode_header(cfg_hash, start)
    tmp = path.with_name(NEW_NAME)
    fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fs.write_all(fd, [header])
        fs.fdatasync(fd)
    finally:
        fs.close(fd)
    fs.rename(tmp, path)
    fs.fsync_dir(directory)
    return WalSpan(path, None, start, start, len(header))


def write_cursor(fs: FileSystem, directory: Path, position: int) -> None:
    fs.write_atomic(directory / CURSOR_NAME, [cursor_fmt.encode_cursor(position)])


def replay_spans(
    fs: FileSystem,
    spans: list[WalSpan],
    scans: dict[Path, wal_fmt.ScanResult],
    pos: int,
    cfg_hash: bytes,
) -> Iterator[tuple[wal_fmt.WalEntry, int, int]]:
    """(entry, start, end) for every entry at or after ``pos``, one file at a time;
    ``scans``: recovery's scans by path, used (and popped) for the files they cover."""
    for span in spans:
        if span.end <= pos:
            continue
        res = scans.pop(span.path, None)
        if res is not None and res.good_end == span.file_size:
            # recovery's scan of this very file (truncated to good_end)
            header, entries = res.header, res.entries
        else:
            try:
                data = fs.read_bytes(span.path)[: span.file_size]
            except FileNotFoundError:
                if span.path.name != NEW_NAME:
                    raise
                # a sync round committed the rotation meanwhile: the same file, renamed
                data = fs.read_bytes(span.path.with_name(ACTIVE_NAME))[: span.file_size]
            header, entries = wal_fmt.decode_wal(data, str(span.path), cfg_hash)
        for e, (s, t) in zip(entries, wal_fmt.iter_positions(header, entries), strict=True):
            if s >= pos:
                yield e, s, t


def torn_before_zeros(data: bytes, off: int) -> bool:
    """The last file's damaged frame at ``off`` counts as torn when only zeros follow
    it: a recycled file is zeroed past its written region, so a crash mid-append leaves
    a torn frame followed by zeros rather than by EOF (the frame ends at or past the
    last non-zero byte; an all-zero remainder is already torn for ``scan``)."""
    nz = len(data.rstrip(b"\0"))
    if nz <= off or nz - off < 4:
        return True
    n = int.from_bytes(data[off : off + 4], "little")
    return off + 4 + n + 4 >= nz


SECTOR = 512
"""The smallest unit a disk writes atomically (a power cut tears writes only here)."""


def never_written(data: bytes, off: int) -> bool:
    """The newest file's damaged frame at ``off`` was (partly) never written, so it and
    everything after it lies past the file's last completed fdatasync: nothing there was
    acknowledged.  A power cut keeps any subset of the writes made since that fdatasync
    (the page cache writes pages back, and the disk persists sectors, in any order), so
    an unsynced tail can hold a lost write -- zeros -- followed by a write that was kept.

    Its signature: a zero ``entry_len`` (the WAL never writes one), or a frame that is
    zero from a sector boundary to its end (a write torn at a sector: its end, the CRC,
    is missing; a written CRC is non-zero but for 2^-32).  Bit rot in acknowledged data
    shows neither, so it stays ``corrupt`` (I7).  Not covered: a frame with a lost
    sector in its middle and its end kept; the stage then refuses to open, naming file
    and offset (``corrupt_policy='truncate'`` lets an operator accept the cut there).
    """
    if off + 4 > len(data):
        return True
    n = int.from_bytes(data[off : off + 4], "little")
    if n == 0:
        return True
    end = min(off + 4 + n + 4, len(data))
    last_nz = off + len(data[off:end].rstrip(b"\0"))
    boundary = -(-last_nz // SECTOR) * SECTOR
    return boundary < end
