"""``tieredbuf entries`` (list the queue) and ``tieredbuf retention`` (show or set it).

Both read a buffer that must exist (a mistyped URL exits 2).  ``entries`` is a plain
reader: no fencing, no writes.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

import tieredbuf
from tieredbuf.cli._common import open_existing, parse_duration, parse_size, store_args
from tieredbuf.errors import ConfigError
from tieredbuf.format.manifest import ManifestEntry


def _time(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def entry_dict(e: ManifestEntry) -> dict[str, Any]:
    return {
        "sequence": e.sequence,
        "location": e.location,
        "ingestion_time_ms": min((m.ingestion_time_ms for m in e.metadata), default=None),
        "metadata": [
            {
                "start_index": m.start_index,
                "ingestion_time_ms": m.ingestion_time_ms,
                "payload": m.payload.decode("utf-8", "backslashreplace"),
            }
            for m in e.metadata
        ],
    }


def cmd_entries(args: argparse.Namespace, out: TextIO) -> int:
    import sys

    buf: tieredbuf.Buffer = open_existing(args)
    reader = buf.reader(start_sequence=args.start, on_lost="clamp")
    got = reader.poll(args.limit) if args.limit else list(reader)
    if reader.lost:
        print(
            f"tieredbuf: note: sequences {args.start}..{args.start + reader.lost - 1} are "
            "no longer in the queue (dequeued, or unlinked by retention); listing from "
            f"{args.start + reader.lost}",
            file=sys.stderr,
        )
    if not args.json:
        out.write(f"{'sequence':>10}  {'ingested (UTC)':<29}  {'calls':>5}  location\n")
    for e in got:
        d = entry_dict(e)
        if args.json:
            out.write(json.dumps(d) + "\n")
        else:
            out.write(
                f"{e.sequence:>10}  {_time(d['ingestion_time_ms']):<29}  "
                f"{len(e.metadata):>5}  {e.location}\n"
            )
    return 0


def _show(policy: Any) -> str:
    if policy is None or (policy.max_age_ms is None and policy.max_bytes is None):
        return "none (acked entries are unlinked as they are dequeued)"
    parts = []
    if policy.max_age_ms is not None:
        parts.append(f"max-age {timedelta(milliseconds=policy.max_age_ms)}")
    if policy.max_bytes is not None:
        parts.append(f"max-bytes {policy.max_bytes}")
    return ", ".join(parts)


def cmd_retention(args: argparse.Namespace, out: TextIO) -> int:
    buf: tieredbuf.Buffer = open_existing(args)
    if args.none and (args.max_age is not None or args.max_bytes is not None):
        raise ConfigError("--none clears the policy: give it alone")
    policy: Any
    if args.none:
        policy = buf.set_retention()
    elif args.max_age is not None or args.max_bytes is not None:
        cur = buf.retention
        age = (
            args.max_age
            if args.max_age is not None
            else (
                None
                if cur is None or cur.max_age_ms is None
                else timedelta(milliseconds=cur.max_age_ms)
            )
        )
        size = (
            args.max_bytes
            if args.max_bytes is not None
            else (None if cur is None else cur.max_bytes)
        )
        policy = buf.set_retention(max_age=age, max_bytes=size)
    else:
        policy = buf.retention
    out.write(_show(policy) + "\n")
    return 0


def add_parsers(sub: Any) -> None:
    en = sub.add_parser(
        "entries",
        help="list the queue's entries (read-only)",
        description="List the queue's entries in order: sequence, "
        "ingestion time, produce() calls in it, data object.  "
        "A plain reader: no fencing, no writes.",
    )
    en.add_argument("url")
    en.add_argument(
        "--from",
        dest="start",
        type=int,
        default=0,
        metavar="SEQ",
        help="first sequence to list (default 0: from the first one the buffer still holds)",
    )
    en.add_argument("--limit", type=int, default=100, metavar="N", help="at most N entries; 0: all")
    en.add_argument("--json", action="store_true", help="one JSON object per entry")
    store_args(en)
    en.set_defaults(fn=cmd_entries)

    re_ = sub.add_parser(
        "retention",
        help="show or set the buffer's retention policy",
        description="Show the buffer's retention policy (kept in its "
        "root), or set it: how long acked history stays "
        "readable (by age and by linked bytes).  Setting one "
        "limit keeps the other.",
    )
    re_.add_argument("url")
    re_.add_argument(
        "--max-age",
        type=parse_duration,
        metavar="DURATION",
        help="keep acked entries this long, e.g. 7d, 12h (default: unchanged)",
    )
    re_.add_argument(
        "--max-bytes",
        type=parse_size,
        metavar="SIZE",
        help="keep at most this many linked bytes, e.g. 10GiB (default: unchanged)",
    )
    re_.add_argument("--none", action="store_true", help="clear the policy")
    store_args(re_)
    re_.set_defaults(fn=cmd_retention)
