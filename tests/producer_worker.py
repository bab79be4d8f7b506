"""A producer process for the multi-process tests: ``python producer_worker.py URL OPTS NAME N``.

Produces N records ``NAME:i`` in calls of 5, waiting for each call to be REMOTE so
every call is its own manifest append (maximum contention between processes), then
prints one JSON line with the queue's conflict/retry counters.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import tieredbuf


def main() -> None:
    url, opts, name, n = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    buf = tieredbuf.open(url, **opts)
    p = buf.producer(flush_interval=timedelta(milliseconds=5))
    for i in range(0, n, 5):
        recs = [f"{name}:{j}".encode() for j in range(i, min(i + 5, n))]
        p.produce(recs, metadata=name.encode()).wait(timeout=60)
    p.close()
    print(json.dumps({"name": name, **buf.queue.stats.snapshot()}), flush=True)


if __name__ == "__main__":
    main()
