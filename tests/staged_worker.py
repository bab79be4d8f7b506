"""A staged producer process for the crash tests.

``python staged_worker.py URL STAGE_DIR RUN [N]`` produces records ``RUN:i`` one call
at a time and prints ``ACK RUN:i`` once each is LOCAL (fdatasynced).  It runs until
it has produced N records (forever when N is absent), then closes (seal, export).
The parent kills it with SIGKILL at random moments.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from itertools import count

import tieredbuf


def main() -> None:
    url, stage_dir, run = sys.argv[1], sys.argv[2], sys.argv[3]
    limit = int(sys.argv[4]) if len(sys.argv) > 4 else None
    buf = tieredbuf.open(url)
    p = buf.producer(
        staging_dir=stage_dir,
        flush_interval=timedelta(milliseconds=2),
        max_open_duration=timedelta(milliseconds=30),
    )
    for i in count():
        if limit is not None and i >= limit:
            break
        rec = f"{run}:{i}"
        p.produce([rec.encode()]).wait(tieredbuf.Durability.LOCAL, timeout=60)
        sys.stdout.write(f"ACK {rec}\n")
        sys.stdout.flush()
    p.close()
    sys.stdout.write("CLOSED\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
