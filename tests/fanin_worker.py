"""A writer process for the fan-in tests: ``python fanin_worker.py URL OPTS NAME N [flags]``.

Produces N records ``NAME:i``, one call at a time, each waited for REMOTE, and prints
``ACK NAME:i SEQ`` as each lands (then ``DONE``).  Flags:

* ``--rate R``: the commit budget (manifest writes per second) it asks for;
* ``--skew-ms S``: its clock runs S ms off (lease judgements, commit times);
* ``--crash-before-delete``: as a committer, stop dead right after a commit landed and
  before it deletes the announcements it carried (prints ``CRASHPOINT``; the parent
  kills it with SIGKILL there);
* ``--hold``: after the N records, keep the process (and its hub) alive until killed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import tieredbuf
from tieredbuf import keys
from tieredbuf.store import open_store


class CrashBeforeDelete:
    """Forwards to ``inner``; a delete of announcements parks the caller forever."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def delete_many(self, keys_: Sequence[str]) -> Any:
        if any(k.startswith(keys.PENDING_PREFIX) for k in keys_):
            sys.stdout.write("CRASHPOINT\n")
            sys.stdout.flush()
            threading.Event().wait()  # the parent's SIGKILL ends it here
        return self._inner.delete_many(keys_)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("opts")
    ap.add_argument("name")
    ap.add_argument("n", type=int)
    ap.add_argument("--rate", type=float, default=None)
    ap.add_argument("--skew-ms", type=int, default=0)
    ap.add_argument("--crash-before-delete", action="store_true")
    ap.add_argument("--hold", action="store_true")
    a = ap.parse_args()
    store = open_store(a.url, **json.loads(a.opts))
    if a.crash_before_delete:
        store = CrashBeforeDelete(store)  # type: ignore[assignment]
    buf = tieredbuf.Buffer(store)
    if a.skew_ms:
        buf.queue.clock_ms = lambda: time.time_ns() // 1_000_000 + a.skew_ms
    extra = {} if a.rate is None else {"manifest_writes_per_s": a.rate}
    p = buf.producer(flush_interval=timedelta(milliseconds=5), **extra)
    for i in range(a.n):
        rec = f"{a.name}:{i}"
        out = p.produce([rec.encode()]).wait(tieredbuf.Durability.REMOTE, timeout=120)
        sys.stdout.write(f"ACK {rec} {out.sequence}\n")
        sys.stdout.flush()
    if a.hold:
        sys.stdout.write("HOLDING\n")
        sys.stdout.flush()
        threading.Event().wait()
    p.close()
    sys.stdout.write("DONE\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
