"""``tieredbuf verify URL [--from SEQ] [--json]``: read every live object and check it.

A plain reader (no fencing, no writes): see :mod:`tieredbuf.ops.verify` for what it
reads and checks.  Exit 0 when everything is as the buffer needs it, 3 on any finding
(missing, damaged or unreferenced); a progress line on a terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from tieredbuf.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    Progress,
    open_existing,
    plural,
    store_args,
)
from tieredbuf.ops import verify as verify_mod

_MiB = 1 << 20


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    buf = open_existing(args)
    with Progress("verify: data objects", stream=sys.stderr) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.done)

        report = verify_mod.verify(
            buf, start=args.start, threads=args.threads, on_progress=progress
        )
    if args.json:
        out.write(json.dumps(report.as_dict()) + "\n")
    else:
        for f in report.findings:
            at = "" if f.sequence is None else f" (sequence {f.sequence})"
            detail = f": {f.detail}" if f.detail else ""
            out.write(f"{f.problem:<12}  {f.kind:<10}  {f.key}{at}{detail}\n")
        n = len(report.findings)
        reqs = sum(report.requests.values())
        out.write(
            f"verified {report.entries} data {plural(report.entries, 'object')} "
            f"({report.bytes / _MiB:,.1f} MiB, sequences {report.first}..{report.next - 1}), "
            f"{report.groups} tree {plural(report.groups, 'node')}, {report.subscribers} "
            f"{plural(report.subscribers, 'progress object')}, {report.listed} keys listed "
            f"in {report.seconds:.1f} s, {reqs} {plural(reqs, 'request')}: "
            + (
                "no findings"
                if not n
                else f"{len(report.of('missing'))} missing, {len(report.of('damaged'))} "
                f"damaged, {len(report.of('unreferenced'))} unreferenced"
            )
            + "\n"
        )
    return EXIT_FAILED if report.findings else EXIT_OK


def add_parser(sub: Any) -> None:
    v = sub.add_parser(
        "verify",
        help="read every live object and check it (exit 3 on any finding)",
        description="Read every data object the buffer's manifest links (from its first "
        "readable sequence, or --from), every tree node and subscriber progress object, "
        "and check each: the size the manifest recorded, the checksum its format "
        "carries, a full decode.  List data/ and queue/groups/ for objects nothing links "
        "that are older than the GC grace period.  Reports missing, damaged and "
        "unreferenced objects; writes nothing.  Exit 3 on any finding.  Cost: one GET "
        "per object read (docs/operations.md).",
    )
    v.add_argument("url")
    v.add_argument(
        "--from",
        dest="start",
        type=int,
        default=None,
        metavar="SEQ",
        help="check data objects from this sequence on (default: the first readable one); "
        "tree nodes and the listings are checked whole",
    )
    v.add_argument("--json", action="store_true", help="the report as one JSON object")
    v.add_argument(
        "--threads",
        type=int,
        default=verify_mod.THREADS,
        metavar="N",
        help=f"data objects read in parallel (default {verify_mod.THREADS})",
    )
    store_args(v)
    v.set_defaults(fn=cmd_verify)
