"""Root size and append latency of the M-way manifest tree vs a flat RFC v1-style manifest.

For each backlog (1 k, 100 k, 1 M queued entries; --quick: 1 k, 10 k, 100 k) and each
store (a local directory, a moto S3 server on 127.0.0.1:0) it builds the backlog through
a bulk path (entries encoded once, group objects PUT once, one root PUT: no 1 M CAS round
trips), then times real appends through ManifestQueue.append (one entry per CAS, as a
producer does) and the same appends to a flat manifest (GET whole, append, If-Match PUT).

Full mode times M appends per backlog (one whole cycle of the root's own entries, through
one cut), so every backlog is timed over the same root states.  Columns: wall p50 and
thread-CPU p50 per append (CPU is the steadier figure on a loaded machine); "root B p50",
the root's median size during the timed appends (at 1 M the root also carries ~N/M group
refs, 65 B each); "own", the append's wall time outside store calls (tieredbuf's own
work: decode, draft, encode), which must not grow with the backlog (I6); the time inside
the store (GET, hash, write, fsync, rename of the whole root) grows with the root's bytes,
which the tree bounds.
Prints a table and writes bench/results/tree.json.  Run: python bench/tree.py [--quick].
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ulid import ULID

from bench._common import moto_server, print_table, summarize, write_json
from tieredbuf import keys
from tieredbuf.config import RetryConfig, TreeConfig
from tieredbuf.format import manifest as fm
from tieredbuf.queue import tree
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.store import open_store
from tieredbuf.store.base import IfMatch, Store


def _entries(n: int, start: int = 0) -> list[fm.NewEntry]:
    base = 1_800_000_000_000
    return [
        fm.NewEntry(
            keys.data_key(ULID.from_timestamp((base + i) / 1000)),
            (fm.MetadataItem(0, base + i, b""),),
            1 << 20,
        )
        for i in range(start, start + n)
    ]


def bulk_tree(store: Store, q: ManifestQueue, n: int) -> None:
    """The tree for ``n`` entries, as ``n`` single appends would leave it, in one pass."""
    root = q.read().root.copy()
    tree.append_entries(root, _entries(n), 0)
    tree.rebalance(root, q.tree.m, q.nodes.put)  # cuts every full chunk of M at once
    store.put(keys.MANIFEST_KEY, root.encode(), mode="overwrite")


def bulk_flat(store: Store, n: int, key: str) -> None:
    region = b"".join(fm.encode_entry(i, e.location, e.metadata) for i, e in enumerate(_entries(n)))
    footer = fm.encode_footer(fm.Footer(n, n, 0, fm.V1))
    store.put(key, region + footer, mode="overwrite")


def flat_append(store: Store, key: str, entry: fm.NewEntry) -> int:
    got = store.get(key)
    data, _ = fm.append(fm.open_manifest(got.data), [entry], {})
    store.put(key, data, mode=IfMatch(got.etag))
    return len(data)


class TimedStore:
    """Forwards to a store and adds the wall time spent inside its calls to ``ns``."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.ns = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return attr(*a, **k)
            finally:
                self.ns += time.perf_counter_ns() - t

        return timed


def measure(store: Store, n: int, reps: int, flat_reps: int) -> dict[str, Any]:
    timed = TimedStore(store)
    q = ManifestQueue(timed, retry=RetryConfig(), tree_config=TreeConfig())  # type: ignore[arg-type]
    t0 = time.perf_counter()
    bulk_tree(store, q, n)
    build_s = time.perf_counter() - t0
    built_size = len(store.get(keys.MANIFEST_KEY).data)
    lat, cpu, own, sizes = [], [], [], []
    extra = _entries(reps, start=n)
    for i, e in enumerate(extra):
        timed.ns = 0
        c, t = time.thread_time(), time.perf_counter()
        q.append([e], "bench", i + 1)
        ms = (time.perf_counter() - t) * 1000
        cpu.append((time.thread_time() - c) * 1000)
        lat.append(ms)
        own.append(ms - timed.ns / 1e6)
        sizes.append(len(store.get(keys.MANIFEST_KEY).data))
    root_size = max(built_size, *sizes)
    flat_key = "queue/flat-manifest"
    bulk_flat(store, n, flat_key)
    flat_lat, flat_size = [], 0
    for e in _entries(flat_reps, start=n):
        t = time.perf_counter()
        flat_size = flat_append(store, flat_key, e)
        flat_lat.append((time.perf_counter() - t) * 1000)
    store.delete_many([flat_key])
    return {
        "queued": n,
        "build_s": round(build_s, 2),
        "root_bytes": root_size,
        "root_bytes_built": built_size,
        "append_ms": summarize(lat),
        "append_cpu_ms": summarize(cpu),
        "root_bytes_p50": sorted(sizes)[len(sizes) // 2],
        "own_ms": summarize(own),
        "groups": sum(1 for _ in store.list(keys.GROUPS_PREFIX)),
        "flat_bytes": flat_size,
        "flat_append_ms": summarize(flat_lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1k / 10k / 100k, fewer repetitions")
    args = ap.parse_args()
    sizes = [1_000, 10_000, 100_000] if args.quick else [1_000, 100_000, 1_000_000]
    # full mode: one full cycle of root fill (M appends: the root's own entries go from
    # wherever the build left them through one cut), so every backlog is timed over the
    # same root states and differs only in its refs
    reps = 30 if args.quick else TreeConfig().m
    results: dict[str, Any] = {"m": TreeConfig().m, "sizes": sizes, "stores": {}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp, moto_server() as ep:
        backends = {
            "localdir": lambda n: open_store(f"file://{tmp}/b{n}"),
            "moto": lambda n: open_store(f"s3://{ep.new_bucket()}/b", **ep.options()),
        }
        for name, make in backends.items():
            per = []
            for n in sizes:
                flat_reps = 3 if n >= 1_000_000 else (10 if n >= 100_000 else reps)
                r = measure(make(n), n, reps, flat_reps)
                per.append(r)
                rows.append(
                    [
                        name,
                        n,
                        r["root_bytes"],
                        r["root_bytes_p50"],
                        f"{r['append_ms']['p50']:.2f}",
                        f"{r['append_cpu_ms']['p50']:.2f}",
                        f"{r['own_ms']['p50']:.3f}",
                        r["flat_bytes"],
                        f"{r['flat_append_ms']['p50']:.2f}",
                        r["groups"],
                        r["build_s"],
                    ]
                )
            lo, hi = per[0], per[-1]
            results["stores"][name] = {
                "runs": per,
                "ratio_append_p50": hi["append_ms"]["p50"] / lo["append_ms"]["p50"],
                "ratio_append_cpu_p50": hi["append_cpu_ms"]["p50"] / lo["append_cpu_ms"]["p50"],
                "ratio_own_p50": hi["own_ms"]["p50"] / lo["own_ms"]["p50"],
                "ratio_root_bytes": hi["root_bytes"] / lo["root_bytes"],
                "flat_ratio_append_p50": hi["flat_append_ms"]["p50"] / lo["flat_append_ms"]["p50"],
                "flat_ratio_bytes": hi["flat_bytes"] / lo["flat_bytes"],
            }
    print_table(
        [
            "store",
            "queued",
            "root B max",
            "root B p50",
            "append p50 ms",
            "cpu p50 ms",
            "own p50 ms",
            "flat B",
            "flat p50 ms",
            "groups",
            "build s",
        ],
        rows,
    )
    for name, s in results["stores"].items():
        print(
            f"{name}: tree append p50 ratio {sizes[-1]}/{sizes[0]} = "
            f"{s['ratio_append_p50']:.2f}, cpu {s['ratio_append_cpu_p50']:.2f}, "
            f"own (outside store calls) {s['ratio_own_p50']:.2f} "
            f"(root bytes x{s['ratio_root_bytes']:.2f}); "
            f"flat: x{s['flat_ratio_append_p50']:.1f} (bytes x{s['flat_ratio_bytes']:.0f})"
        )
    path = write_json("tree" if not args.quick else "tree-quick", results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
