"""A producer process for the IAM policy tests (tests/test_iam.py).

``python -m tests.iam_roles URL OPTS NAME [--stage DIR] [--count N] [--until PATH]``
opens the buffer with the options ``OPTS`` (JSON: the IAM user's keys) and produces
records ``NAME:i`` one call at a time, each waited for REMOTE, printing
``ACK NAME:i SEQ`` as each lands.  It stops after N records, or, with ``--until``,
once PATH exists (and it has produced at least N), then closes and prints ``DONE``.
Any error ends it with a traceback and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import tieredbuf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("opts")
    ap.add_argument("name")
    ap.add_argument("--stage")
    ap.add_argument("--count", type=int, default=10)
    ap.add_argument("--until")
    a = ap.parse_args()
    buf = tieredbuf.open(a.url, **json.loads(a.opts))
    flush = timedelta(milliseconds=5)
    p = (
        buf.producer(a.stage, flush_interval=flush, max_open_duration=timedelta(milliseconds=20))
        if a.stage
        else buf.producer(flush_interval=flush)
    )
    i = 0
    while i < a.count or (a.until is not None and not os.path.exists(a.until)):
        outcome = p.produce([f"{a.name}:{i}".encode()]).wait(tieredbuf.Durability.REMOTE, 60)
        sys.stdout.write(f"ACK {a.name}:{i} {outcome.sequence}\n")
        sys.stdout.flush()
        i += 1
    p.close()
    sys.stdout.write("DONE\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
