"""A staged producer that is killed after its LOCAL acks (for late-record tests).

``python late_worker.py URL STAGE_DIR TAG N`` produces records ``TAG:i`` one call at a
time (metadata ``TAG``), prints ``ACK TAG:i`` once each is LOCAL (fdatasynced in the
WAL), then ``DONE``, and waits to be killed.  Its segments never seal on their own
(an hour's timer, a 1 GiB target), so nothing reaches the store before the kill: the
records reach the queue only when someone drains the stage -- after other producers
appended newer records, with their original (older) ingestion times.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import tieredbuf


def main() -> None:
    url, stage_dir, tag, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    buf = tieredbuf.open(url)
    p = buf.producer(
        staging_dir=stage_dir, max_open_duration=timedelta(hours=1), target_size=1 << 30
    )
    for i in range(n):
        p.produce([f"{tag}:{i}".encode()], metadata=tag.encode()).wait(
            tieredbuf.Durability.LOCAL, timeout=60
        )
        sys.stdout.write(f"ACK {tag}:{i}\n")
        sys.stdout.flush()
    sys.stdout.write("DONE\n")
    sys.stdout.flush()
    sys.stdin.read()  # until killed


if __name__ == "__main__":
    main()
