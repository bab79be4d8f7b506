"""The child side of tests/test_fork.py (importable, so spawn and forkserver can run it)."""

from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import tieredbuf
from tieredbuf import Durability
from tieredbuf.errors import ForkedError

INHERITED: dict[str, Any] = {}
"""Set by the parent before forking: objects a forked child inherits."""


def child(url: str, opts: dict[str, Any], stage: str, tag: str, results: Any) -> None:
    """Write (stateless and staged, to REMOTE) and read back; report on ``results``."""
    try:
        out: dict[str, Any] = {"tag": tag}
        buf = INHERITED.get("buf") or tieredbuf.open(url, **opts)
        for name in ("producer", "consumer"):
            old = INHERITED.get(name)
            if old is None:
                continue
            try:
                if name == "producer":
                    old.produce([b"from an inherited producer"])
                else:
                    old.next_batch()
                out[f"inherited_{name}"] = "worked"
            except ForkedError as e:
                out[f"inherited_{name}"] = str(e)
        with buf.producer() as p:
            h = p.produce([f"{tag} stateless".encode()])
            out["stateless_seq"] = h.wait(Durability.REMOTE, timeout=60).sequence
        fast = timedelta(milliseconds=20)
        with buf.producer(staging_dir=Path(stage), max_open_duration=fast) as sp:
            h = sp.produce([f"{tag} staged".encode()])
            out["staged_seq"] = h.wait(Durability.REMOTE, timeout=60).sequence
        c = buf.consumer()
        c.initialize()
        records = []
        while (b := c.next_batch()) is not None:
            records.extend(b.entries)
        c.close()
        out["records"] = records
        results.put(out)
    except BaseException:
        results.put({"tag": tag, "error": traceback.format_exc()})
