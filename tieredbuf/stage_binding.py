"""A producer stage belongs to one buffer.

Records LOCAL-acked into ``./stage`` for ``file://./A`` must never be exported into
``file://./B`` because ``./stage`` was reused for B.  So the first open of a stage
(a :class:`~tieredbuf.staged.StagedProducer` or ``tieredbuf drain``) writes
``<stage>/<producer_id>/buffer.json``: the buffer's identity (root section 6's buffer
id, when the root has one yet) and its URL (``file://`` made absolute).  Every later
open compares:

* both ids known: they must be equal (a buffer deleted and re-created at the same URL
  is another buffer);
* otherwise the URLs must be equal; an id learned later is recorded then.

A mismatch on a stage that still holds records raises
:class:`~tieredbuf.errors.StageBufferMismatchError` before anything is exported.  A
stage that holds nothing (no WAL entry replayed, no sealed segment) is re-bound to the
new buffer: there is nothing to misdirect.  The file is written under the stage lock,
atomically (temp file, fsync, rename).  This module sits beside the staged producer:
the stage itself never talks to the object store.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tieredbuf import keys
from tieredbuf.errors import StageBufferMismatchError

if TYPE_CHECKING:
    from tieredbuf.buffer import Buffer
    from tieredbuf.stage.stage import Stage

log = logging.getLogger(__name__)


def canonical_url(url: str) -> str:
    """``file://`` URLs with an absolute path (``file://./A`` depends on the cwd)."""
    if url.startswith("file://"):
        return "file://" + os.path.abspath(url[len("file://"):])
    return url


def read_binding(stage_path: Path) -> dict[str, Any] | None:
    """The recorded buffer of one producer stage (``{"buffer_id", "url"}``), or None."""
    try:
        raw = (stage_path / keys.STAGE_BUFFER_NAME).read_text("utf-8")
    except FileNotFoundError:
        return None
    try:
        got = json.loads(raw)
    except ValueError:
        got = None
    if not isinstance(got, dict) or not isinstance(got.get("url"), str):
        raise StageBufferMismatchError(
            f"{stage_path / keys.STAGE_BUFFER_NAME} is not a stage binding (bad JSON); "
            "refusing to guess which buffer this stage's records belong to",
            str(stage_path), {},
        )
    return got


def describe(binding: dict[str, Any] | None) -> str:
    if binding is None:
        return "no buffer recorded yet"
    bid = binding.get("buffer_id")
    return f"buffer {bid} at {binding['url']}" if bid else f"the buffer at {binding['url']}"


def _write(stage_path: Path, binding: dict[str, Any]) -> None:
    path = stage_path / keys.STAGE_BUFFER_NAME
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(binding, f)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(stage_path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _holds_records(stage: Stage) -> bool:
    return bool(stage.stats.replayed_entries or stage.sealed_segments() or stage.quarantined())


def bind(stage: Stage, buf: Buffer) -> dict[str, Any]:
    """Check (or record) that ``stage`` belongs to ``buf``; call under the stage lock,
    before exporting.  Returns the binding now recorded."""
    current: dict[str, Any] = {"buffer_id": buf.snapshot().buffer_id,
                               "url": canonical_url(buf.url)}
    recorded = read_binding(stage.path)
    if recorded is None:
        _write(stage.path, current)
        return current
    ids = recorded.get("buffer_id"), current["buffer_id"]
    same = ids[0] == ids[1] if None not in ids else recorded["url"] == current["url"]
    if not same:
        if _holds_records(stage):
            raise StageBufferMismatchError(
                f"stage {stage.path} holds records for {describe(recorded)}, not for "
                f"{describe(current)}: nothing exported; drain it into its own buffer "
                f"(tieredbuf drain {stage.path.parent} {recorded['url']}) or use another "
                "staging directory",
                str(stage.path), recorded,
            )
        log.info("stage %s held nothing: re-bound from %s to %s", stage.path,
                 describe(recorded), describe(current))
        _write(stage.path, current)
        return current
    if recorded != current and (ids[0] is None or recorded["url"] == current["url"]):
        _write(stage.path, {**recorded, **{k: v for k, v in current.items() if v}})
        return read_binding(stage.path) or current
    return recorded
