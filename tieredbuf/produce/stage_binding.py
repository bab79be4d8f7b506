"""A producer stage belongs to one buffer.

Records LOCAL-acked into ``./stage`` for ``file://./A`` must never be exported into
``file://./B`` because ``./stage`` was reused for B.  So the first open of a stage
(a :class:`~tieredbuf.produce.staged.StagedProducer` or ``tieredbuf drain``) writes
``<stage>/<producer_id>/buffer.json``: the buffer's identity (root section 6's buffer
id, once the buffer has a root) and its URL (``file://`` made absolute).  A stage
that held records when it was opened must be exported into the same buffer: the same
URL (or, by id, the same buffer under another spelling) and, once the store can be
asked, the same buffer id (a buffer deleted and re-created at the same URL is another
buffer).  A mismatch raises :class:`~tieredbuf.errors.StageBufferMismatchError` before
anything is exported.  A stage that held nothing when it was opened (no WAL entry
replayed, no sealed segment) is re-bound to the new buffer: there is nothing to
misdirect.  The file is written under the stage lock,
atomically (temp file, fsync, rename).  This module sits beside the staged producer:
the stage itself never talks to the object store.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tieredbuf import keys
from tieredbuf.errors import ProducerIdReusedError, StageBufferMismatchError
from tieredbuf.stage import filesystem

if TYPE_CHECKING:
    from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot
    from tieredbuf.stage.filesystem import FileSystem
    from tieredbuf.stage.stage import Stage

log = logging.getLogger(__name__)


def canonical_url(url: str) -> str:
    """``file://`` URLs with an absolute path (``file://./A`` depends on the cwd)."""
    if url.startswith("file://"):
        return "file://" + os.path.abspath(url[len("file://") :])
    return url


def read_binding(stage_path: Path, fs: FileSystem | None = None) -> dict[str, Any] | None:
    """The recorded buffer of one producer stage (``{"buffer_id", "url"}``), or None."""
    raw = (fs or filesystem.current()).read_if_exists(stage_path / keys.STAGE_BUFFER_NAME)
    if raw is None:
        return None
    try:
        got = json.loads(raw)
    except ValueError:
        got = None
    if not isinstance(got, dict) or not isinstance(got.get("url"), str):
        raise StageBufferMismatchError(
            f"{stage_path / keys.STAGE_BUFFER_NAME} is not a stage binding (bad JSON); "
            "refusing to guess which buffer this stage's records belong to",
            str(stage_path),
            {},
        )
    return got


def describe(binding: dict[str, Any] | None) -> str:
    if binding is None:
        return "no buffer recorded yet"
    bid = binding.get("buffer_id")
    return f"buffer {bid} at {binding['url']}" if bid else f"the buffer at {binding['url']}"


def _write(stage: Stage, binding: dict[str, Any]) -> None:
    """Atomically and durably (temp file, fsync, rename, directory fsync)."""
    stage.fs.write_atomic(
        stage.path / keys.STAGE_BUFFER_NAME, [json.dumps(binding).encode() + b"\n"]
    )


def _holds_records(stage: Stage) -> bool:
    return bool(stage.stats.replayed_entries or stage.sealed_segments() or stage.quarantined())


class StageBinding:
    """The check, in two steps so that opening a stage never needs the object store
    (a staged producer must start, and ack LOCAL, while the store is down):

    * :meth:`open_check` (at open, under the stage lock): compares URLs only.  A stage
      holding records for another URL is refused unless the store says both URLs are
      the same buffer (same id); an empty stage is re-bound to the new URL.
    * :meth:`before_export` (the exporter calls it before each export until it
      passes; the store is reachable then): compares buffer ids, and records the id
      once the buffer has one.
    """

    def __init__(self, stage: Stage, queue: ManifestQueue) -> None:
        self.stage, self.queue = stage, queue
        self.url = canonical_url(queue.store.url)
        self.opened_at = stage.next_sequence
        """The stage's next sequence when it was opened: nothing above it was exported
        before this process's first export, which the check precedes."""
        self._id_checked = False
        self._strict = False
        """The stage held records bound to a buffer before this open: ids must match."""
        self._absent = False  # the last read found no root
        self._verified = False
        self._lock = threading.Lock()

    def _mismatch(self, recorded: dict[str, Any], current: dict[str, Any]) -> Exception:
        return StageBufferMismatchError(
            f"stage {self.stage.path} holds records for {describe(recorded)}, not for "
            f"{describe(current)}: nothing exported; drain it into its own buffer "
            f"(tieredbuf drain {self.stage.path.parent} {recorded['url']}), use another "
            f"staging directory, or delete {self.stage.path / keys.STAGE_BUFFER_NAME} to "
            "send its records to the new buffer",
            str(self.stage.path),
            recorded,
        )

    def open_check(self) -> None:
        recorded = read_binding(self.stage.path, self.stage.fs)
        holds = _holds_records(self.stage)
        if recorded is None:
            _write(self.stage, {"buffer_id": None, "url": self.url})
            return
        self._strict = holds
        if recorded["url"] == self.url:
            return
        if not holds:
            log.info(
                "stage %s held nothing: re-bound from %s to the buffer at %s",
                self.stage.path,
                describe(recorded),
                self.url,
            )
            _write(self.stage, {"buffer_id": None, "url": self.url})
            return
        cur = self.queue.read().buffer_id  # another spelling of the same buffer?
        if recorded.get("buffer_id") is None or cur != recorded["buffer_id"]:
            raise self._mismatch(recorded, {"buffer_id": cur, "url": self.url})

    def before_export(self) -> None:
        """Raise StageBufferMismatchError if the buffer is not the stage's own, and
        ProducerIdReusedError if its producer id has appended what this stage never
        staged (:func:`check_producer_id`); store errors propagate (the exporter
        retries)."""
        if self._verified or (self._absent and not self.queue.knows_root):
            return  # verified, or no root when last read and none known since
        with self._lock:
            if self._verified:  # another stream's export verified it meanwhile
                return
            # the root as this process last read or wrote it, once it has an id (ids
            # never change; exports before the buffer's first commit each read it)
            snap = self.queue.latest_snapshot() if self.queue.knows_root else None
            if snap is None or snap.buffer_id is None:
                snap = self.queue.read()
            cur = snap.buffer_id
            if not self._id_checked:  # before this process exported anything
                check_producer_id(self.stage, snap, self.opened_at)
                self._id_checked = True
            recorded = read_binding(self.stage.path, self.stage.fs) or {
                "buffer_id": None,
                "url": self.url,
            }
            if self._strict and recorded.get("buffer_id") not in (None, cur):
                raise self._mismatch(recorded, {"buffer_id": cur, "url": self.url})
            if cur is None:  # no root yet: this export creates it; the id is recorded once
                self._absent = True  # this process knows the root (its hub reads it)
                return  # (and no watermark existed before our first export)
            if recorded.get("buffer_id") != cur:
                _write(self.stage, {**recorded, "buffer_id": cur})
            self._verified = True


def check_producer_id(stage: Stage, snap: Snapshot, ceiling: int) -> None:
    """Each stream of a stage appends as ``<producer id>.<stream>`` with its segments' last
    per-core sequence + 1 as the append number, and the stage never gives a sequence out
    twice.  Before this process exports anything, a watermark past ``ceiling`` (the
    stage's next sequence when it was opened) was written by another stage with the same
    producer id (a wiped stage opened with an explicit id): taking this stage's appends
    for ones that landed already would drop them and ack them (I10).  Raises
    ProducerIdReusedError instead; the records stay staged."""
    for stream in keys.STREAMS:
        pid = keys.stream_producer_id(stage.producer_id, stream)
        wm = snap.view.watermarks.get(pid)
        if wm is not None and wm.producer_seq > ceiling:
            raise ProducerIdReusedError(
                pid,
                wm.producer_seq,
                ceiling,
                f"producer id {stage.producer_id!r} has appended through number "
                f"{wm.producer_seq} to this buffer, past anything stage {stage.path} has "
                f"staged (its next sequence is {ceiling}): another stage used this id. "
                "Nothing is exported; the records stay staged. Open the stage under a new "
                f"producer id (rename {stage.path} to {stage.path.parent}/<new id>) and "
                "drain it",
            )


def bind(stage: Stage, queue: ManifestQueue) -> StageBinding:
    """Check (or record) that ``stage`` belongs to the buffer of ``queue``; call under the
    stage lock, before exporting, and pass ``binding.before_export`` to the exporter."""
    binding = StageBinding(stage, queue)
    binding.open_check()
    return binding
