"""What ``tieredbuf verify`` costs: time and store requests over a buffer of N entries,
3 of whose data objects are damaged and 2 missing (it must report exactly those 5).

For each store (a local directory; a moto S3 server in a child process, over HTTP) and
object size: fill the buffer (objects PUT on 16 threads, appended 500 entries at a time),
damage 3 objects (truncated, replaced, extended) and delete 2, then time one
``verify`` (ops/verify.py, 8 threads) and count its requests.  Prints a table, writes
``bench/results/verify.json``.  Requests per GiB follow from the object size: one GET per
data object, plus a GET per tree node, one for the root and a LIST per 1,000 keys.

    python bench/verify.py                          # 10,000 entries of 1 KiB and of 64 KiB
    python bench/verify.py --entries 1000 --object-kib 1024 --stores moto
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import moto_server, print_table, write_json

import tieredbuf
from tests.damage import damage_object
from tests.test_verify import fill_sized
from tieredbuf.ops.verify import verify


def one(url: str, opts: dict[str, Any], entries: int, object_kib: int) -> dict[str, Any]:
    buf = tieredbuf.open(url, **opts)
    t0 = time.monotonic()
    fill_sized(buf, entries, object_kib << 10)
    filled = time.monotonic() - t0
    locs = [e.location for e in buf.entries()]
    step = len(locs) // 6
    damaged = {locs[step]: "truncated", locs[3 * step]: "replaced", locs[-1]: "extended"}
    for key, how in damaged.items():
        damage_object(buf.store, url, key, how)  # type: ignore[arg-type]
    missing = [locs[2 * step], locs[4 * step]]
    assert buf.store.delete_many(missing) == []
    fresh = tieredbuf.open(url, **opts)
    report = verify(fresh)
    found = {(f.problem, f.key) for f in report.findings}
    want = {*(("damaged", k) for k in damaged), *(("missing", k) for k in missing)}
    assert found == want, found ^ want
    gib = report.bytes / (1 << 30)
    reqs = sum(report.requests.values())
    return {
        "entries": entries,
        "object_bytes": object_kib << 10,
        "fill_seconds": filled,
        "seconds": report.seconds,
        "bytes": report.bytes,
        "requests": report.requests,
        "requests_total": reqs,
        "requests_per_gib": reqs / gib if gib else None,
        "findings": len(report.findings),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=10_000)
    ap.add_argument("--object-kib", default="1,64", help="data object sizes in KiB")
    ap.add_argument("--stores", default="local,moto")
    ap.add_argument("--json", default="verify")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tb-verify-")))
        for store in args.stores.split(","):
            for kib in (int(k) for k in args.object_kib.split(",")):
                if store == "moto":
                    ep = stack.enter_context(moto_server())
                    url, opts = f"s3://{ep.new_bucket()}/v", ep.options()
                else:
                    url, opts = f"file://{work}/v-{kib}", {}
                r = one(url, opts, args.entries, kib)
                r["store"] = store
                rows.append(r)
                print(f"  {store} {kib} KiB: {r['seconds']:.2f} s", flush=True)
    print_table(
        [
            "store",
            "entries",
            "object",
            "verify s",
            "objects/s",
            "MB/s",
            "requests",
            "req/GiB",
            "findings",
        ],
        [
            [
                r["store"],
                r["entries"],
                f"{r['object_bytes'] >> 10} KiB",
                f"{r['seconds']:.2f}",
                f"{r['entries'] / r['seconds']:,.0f}",
                f"{r['bytes'] / r['seconds'] / 1e6:,.1f}",
                r["requests_total"],
                f"{r['requests_per_gib']:,.0f}",
                r["findings"],
            ]
            for r in rows
        ],
    )
    for r in rows:
        print(f"{r['store']} {r['object_bytes'] >> 10} KiB: {r['requests']}")
    write_json(args.json, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
