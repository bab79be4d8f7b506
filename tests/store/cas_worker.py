"""Child-process body for the multi-process CAS tests (imported under spawn)."""

from __future__ import annotations

from typing import Any

from tieredbuf.errors import ConflictError
from tieredbuf.store import IfMatch, open_store


def increment(
    url: str, options: dict[str, Any], key: str, times: int, barrier: Any, out: Any
) -> None:
    """Read-increment-CAS ``times`` times, retrying on conflict; report conflicts seen."""
    store = open_store(url, **options)
    barrier.wait(60)
    conflicts = 0
    for _ in range(times):
        while True:
            r = store.get(key)
            try:
                store.put(key, str(int(r.data) + 1).encode(), mode=IfMatch(r.etag))
                break
            except ConflictError:
                conflicts += 1
    store.close()
    out.put(conflicts)
