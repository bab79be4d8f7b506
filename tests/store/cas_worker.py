"""Child-process body for the multi-process CAS tests (imported under spawn)."""

from __future__ import annotations

import json
import traceback
from typing import Any

from tieredbuf.errors import ConflictError, OutcomeUnknownError
from tieredbuf.store import IfMatch, open_store


def increment(
    url: str, options: dict[str, Any], key: str, wid: str, times: int, barrier: Any, out: Any
) -> None:
    """Read-increment-CAS ``times`` times on a JSON counter ``{"n": .., "last": {wid: seq}}``.

    A conflict or an unknown outcome is resolved by re-reading: if ``last[wid]`` already
    shows this increment, the write landed although its response said otherwise (I2:
    obstore retried a PUT that had succeeded, e.g. after an HTTP 500 from moto); only
    otherwise is the increment retried.  Reports (wid, conflicts, landed_despite_error)
    or (wid, "error", traceback).
    """
    try:
        store = open_store(url, **options)
        barrier.wait(60)
        conflicts = landed_anyway = 0
        for seq in range(1, times + 1):
            while True:
                r = store.get(key)
                state = json.loads(r.data)
                if state["last"].get(wid) == seq:
                    landed_anyway += 1
                    break
                state["n"] += 1
                state["last"][wid] = seq
                try:
                    store.put(key, json.dumps(state).encode(), mode=IfMatch(r.etag))
                    break
                except (ConflictError, OutcomeUnknownError):
                    conflicts += 1
        store.close()
        out.put((wid, conflicts, landed_anyway))
    except BaseException:
        out.put((wid, "error", traceback.format_exc()))
        raise
