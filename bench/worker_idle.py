"""An idle worker's cost, and how soon it sees new work (P2: an idle reader <= 0.5
requests/s).

A moto S3 server (child process) behind ``tests/latency_proxy.py`` (20 ms GETs, 40 ms
PUTs).  One worker of the queue "jobs" drains a few entries, then loops
``claim(timeout=5)`` with nothing to claim for ``--idle`` (60) seconds: the proxy counts
its requests.  Then, ``--rounds`` (10) times, an entry is appended (directly to moto, not
through the proxy) at a random moment while the worker waits, and the time until
``claim()`` returns it is measured; and ``--rounds`` times another worker hands an entry
back (``defer(seq, delay=0)``) while this one waits.

``--baseline-tree DIR`` runs the same idle minute first on the code in DIR, where
``claim()`` has no timeout: its loop is ``claim()`` then a 20 ms sleep (the busy poll a
user wrote).  Results: a table and ``bench/results/worker_idle.json``.

    .venv/bin/python bench/worker_idle.py [--baseline-tree /tmp/tb-base]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, serial_moto, summarize, write_json

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, random, sys, threading, time
import tieredbuf
from datetime import timedelta
url, opts, direct = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
idle_s, rounds = float(sys.argv[4]), int(sys.argv[5])
buf = tieredbuf.open(url, **opts)       # through the proxy
feed = tieredbuf.open(url, **direct)    # straight to moto
w = buf.worker("jobs", claim_batch=1)
long_poll = "timeout" in w.claim.__code__.co_varnames
def claim(t):
    if long_poll:
        return w.claim(timeout=t)
    end = time.monotonic() + t
    while time.monotonic() < end:   # the old API: a busy poll
        b = w.claim()
        if b is not None:
            return b
        time.sleep(0.02)
    return None
while (b := w.claim()) is not None:
    w.ack(b.sequence)
w.flush()
print(json.dumps({"event": "idle_start", "tieredbuf": tieredbuf.__file__}), flush=True)
end = time.monotonic() + idle_s
while time.monotonic() < end:
    b = claim(min(5.0, end - time.monotonic()))
    assert b is None, b
print(json.dumps({"event": "idle_end"}), flush=True)
rng = random.Random(1)
seen = []
p = feed.producer(flush_interval=timedelta(0))
for i in range(rounds if long_poll else 0):
    wait = rng.uniform(0, 6)
    t = threading.Timer(wait, lambda: p.produce([b"new"]).wait(timeout=30))
    t.start()
    t0 = time.monotonic()
    b = claim(120)
    appended_at = t0 + wait
    seen.append(time.monotonic() - appended_at)
    w.ack(b.sequence)
    w.flush()
p.close()
handed = []
other = feed.worker("jobs", claim_batch=1)
for i in range(rounds if long_poll else 0):
    p2 = feed.producer(flush_interval=timedelta(0))
    p2.produce([b"back"]).wait(timeout=30); p2.close()
    got = other.claim(timeout=30)
    while got is None:
        got = other.claim(timeout=30)
    wait = rng.uniform(0, 6)
    t = threading.Timer(wait, lambda g=got: other.defer(g.sequence, delay=timedelta(0)))
    t0 = time.monotonic()
    t.start()
    b = claim(120)
    t.join()
    handed.append(time.monotonic() - (t0 + wait))
    w.ack(b.sequence)
    w.flush()
done = {"event": "done", "new_entry_s": seen, "handed_back_s": handed}
print(json.dumps(done), flush=True)
w.close(); other.close()
"""


def run(
    code: str, tree: str | None, ep: Any, proxy: Any, args: argparse.Namespace
) -> dict[str, Any]:
    url = f"s3://{ep.new_bucket()}/idle"
    direct = ep.options()
    feed_env = dict(os.environ)
    if tree:
        feed_env["PYTHONPATH"] = tree
    import tieredbuf

    with tieredbuf.open(url, **direct).producer(flush_interval=timedelta(0)) as first:
        first.produce([b"x"]).wait(timeout=30)
    opts = {**direct, "endpoint": proxy.endpoint}
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, json.dumps(opts), json.dumps(direct),
         str(args.idle), str(args.rounds)],
        stdout=subprocess.PIPE, text=True, env=feed_env, cwd=tempfile.gettempdir(),
    )  # fmt: skip
    assert p.stdout is not None
    out: dict[str, Any] = {"code": code}
    for line in p.stdout:
        ev = json.loads(line)
        total = sum(proxy.counts[m] for m in ("GET", "HEAD", "PUT", "POST", "DELETE"))
        if ev["event"] == "idle_start":
            t0, before = time.monotonic(), total
            out["tieredbuf"] = ev["tieredbuf"]
        elif ev["event"] == "idle_end":
            secs = time.monotonic() - t0
            out["idle_seconds"] = round(secs, 1)
            out["idle_requests"] = total - before
            out["idle_requests_per_s"] = round((total - before) / secs, 3)
        elif ev["event"] == "done":
            out["new_entry_s"] = summarize(ev["new_entry_s"])
            out["handed_back_s"] = summarize(ev["handed_back_s"])
    if p.wait(timeout=600) != 0:
        raise RuntimeError(f"{code}: child failed")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-tree", metavar="DIR")
    ap.add_argument("--idle", type=float, default=60.0)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    sys.path.insert(1, str(ROOT))
    from tests.latency_proxy import LatencyProxy

    delays = {"GET": 0.02, "HEAD": 0.02, "PUT": 0.04, "POST": 0.04, "DELETE": 0.04}
    codes = ([("baseline", args.baseline_tree)] if args.baseline_tree else []) + [("this", None)]
    results: dict[str, Any] = {"load_before": os.getloadavg(), "rows": []}
    random.seed(1)
    with serial_moto() as ep, LatencyProxy(ep.endpoint, delays) as proxy:
        for code, tree in codes:
            results["rows"].append(run(code, tree, ep, proxy, args))
    rows = []
    for r in results["rows"]:
        ne, hb = r.get("new_entry_s", {}), r.get("handed_back_s", {})
        rows.append([
            r["code"], r["idle_requests"], r["idle_requests_per_s"],
            f"{ne.get('p50', float('nan')):.2f} / {ne.get('max', float('nan')):.2f}",
            f"{hb.get('p50', float('nan')):.2f} / {hb.get('max', float('nan')):.2f}",
        ])  # fmt: skip
    print_table(
        ["code", f"requests in {args.idle:.0f} s idle", "per s",
         "new entry seen after s (p50 / max)", "handed back seen after s (p50 / max)"],
        rows,
    )  # fmt: skip
    print(f"-> {write_json('worker_idle', results)}")


if __name__ == "__main__":
    main()
