"""Streaming planning and fencing, driver side, without a SparkSession.

A trigger reads the root once and loads only the tree nodes on its micro-batch's
path: its request count does not grow with the backlog (exact counts, I6's reader
side).  Each batch task gets only its own partition.  A fenced query cannot dequeue
(I4).  ``maxOffsetsPerTrigger`` is a limit on objects, given to Spark as one.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from pyspark.sql.streaming.datasource import ReadMaxFiles

import tieredbuf
from tests.faults import CountingStore
from tests.spark.util import append_records, bulk_fill
from tieredbuf.errors import FencedError
from tieredbuf.queue import tree
from tieredbuf.spark import executor as ex
from tieredbuf.spark import options as opt
from tieredbuf.spark.reader import BatchReader
from tieredbuf.spark.source import records_struct
from tieredbuf.spark.stream import StreamReader
from tieredbuf.store import open_store


def _reader(url: str, **options: str) -> StreamReader:
    return StreamReader(opt.parse_read_options({"path": url, **options}), records_struct())


def _counted(url: str) -> CountingStore:
    """The store every reader in this process uses for ``url``, counting requests."""
    store = CountingStore(open_store(url))
    ex._buffers[(url, ())] = tieredbuf.Buffer(store)
    return store


def _path_nodes(buf: tieredbuf.Buffer, seq: int) -> int:
    """Tree nodes between the root and entry ``seq`` (0: it is in the root)."""
    root = buf.snapshot().root
    if seq >= root.entries_first:
        return 0
    refs, depth = root.refs, 0
    while True:
        node = buf.snapshot().nodes.load(refs[tree.ref_index(refs, seq)])
        depth += 1
        if node.level == 0:
            return depth
        refs = list(node.refs)


@pytest.mark.parametrize("n", [40, 1_000])
def test_a_trigger_costs_the_root_and_its_batchs_path_whatever_the_backlog(
    tmp_path: Path, n: int
) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    bulk_fill(buf, n, m=4)
    start = (n // 2) // 4 * 4  # a consumer half-way through; 3 objects of one group
    depth = _path_nodes(buf, start)
    assert depth == {40: 2, 1_000: 3}[n]
    store = _counted(url)
    r = _reader(url, maxOffsetsPerTrigger="3", startingOffsets=str(start))
    offset = r.initialOffset()
    assert store.counts["get"] == 1 and store.counts["head"] == 0
    store.reset()
    end = r.latestOffset(offset, r.getDefaultReadLimit())
    parts = r.partitions(offset, end)
    assert [ref.sequence for p in parts for ref in p.refs] == [start, start + 1, start + 2]
    # one root read, then the nodes on the batch's path (no dict of every entry, no HEAD)
    assert store.counts["get"] == 1 + depth and store.counts["head"] == 0
    assert store.counts["get_range"] == store.counts["get_suffix"] == 0
    store.reset()
    nxt = r.latestOffset(end, r.getDefaultReadLimit())
    r.partitions(end, nxt)  # the next group: its node only, the others are cached
    assert store.counts["get"] == 2


def test_each_batch_task_gets_only_its_own_partition(tmp_path: Path) -> None:
    sizes = []
    for n in (20, 20_000):
        url = f"file://{tmp_path}/b{n:05d}"
        bulk_fill(tieredbuf.open(url), n, m=1024)
        ro = opt.parse_read_options({"path": url, "maxPartitionBytes": "0"})
        reader = BatchReader(ro, records_struct())
        assert len(reader.partitions()) == n
        sizes.append(len(pickle.dumps(reader)))  # what Spark ships with every task
    assert abs(sizes[0] - sizes[1]) < 8 and sizes[1] < 4096  # not 20 000 partitions


def test_maxOffsetsPerTrigger_is_given_to_spark_as_a_file_limit(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    for _ in range(5):
        append_records(tieredbuf.open(url), [[b"a", b"b"]], ts_ms=1000)
    r = _reader(url, maxOffsetsPerTrigger="2")
    assert r.getDefaultReadLimit() == ReadMaxFiles(2)
    start = r.initialOffset()
    assert r.latestOffset(start, ReadMaxFiles(2))["sequence"] == 2


def test_I4_a_fenced_query_cannot_dequeue(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    for s in range(4):
        append_records(buf, [[b"%d" % s]], ts_ms=1000)
    a = _reader(url, consumer="etl")
    a_start = a.initialOffset()
    a_end = a.latestOffset(a_start, a.getDefaultReadLimit())
    a.partitions(a_start, a_end)
    b = _reader(url, consumer="etl")  # a second run of the query: fences the first
    b_start = b.initialOffset()
    before = buf.snapshot().etag
    with pytest.raises(FencedError):
        a.commit(a_end)
    with pytest.raises(FencedError):
        a.latestOffset(a_end, a.getDefaultReadLimit())
    assert buf.snapshot().etag == before and buf.snapshot().head == 0
    b_end = b.latestOffset(b_start, b.getDefaultReadLimit())
    b.commit(b_end)
    assert buf.snapshot().head == 4


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_an_idle_stream_costs_at_most_half_a_request_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spark asks for the latest offset every 10 ms while nothing arrives: the answer
    comes from the 22-byte footer, and between footer reads from a backoff (0.1 s
    doubling to 2 s) without any request.  Time is simulated: no test sleeps 60 s."""
    from tieredbuf.spark import stream

    clock = _Clock()
    monkeypatch.setattr(stream.time, "monotonic", clock)
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    append_records(buf, [[b"a"]], ts_ms=1000)
    store = _counted(url)
    r = _reader(url)
    limit = r.getDefaultReadLimit()
    start = r.initialOffset()
    end = r.latestOffset(start, limit)
    assert end["sequence"] == 1
    store.reset()
    assert r.latestOffset(end, limit) == end  # nothing new: the root says so, once
    assert store.counts["get"] == 1
    store.reset()
    for _ in range(6000):  # 60 s of polls every 10 ms
        clock.t += 0.01
        assert r.latestOffset(end, limit) == end
    c = store.counts
    assert c["get"] == 0 and c["get_suffix"] <= 60 * 0.5 + 5  # 0.1+0.2+0.4+0.8+1.6, then 2 s
    assert c["get_suffix"] >= 60 * 0.5 - 1
    # new data: seen at the next footer read (within 2 s), then read in full
    append_records(tieredbuf.open(url), [[b"b"]], ts_ms=2000)
    store.reset()
    seen = None
    for _ in range(300):
        clock.t += 0.01
        got = r.latestOffset(end, limit)
        if got != end:
            seen = got
            break
    assert seen is not None and seen["sequence"] == 2
    assert store.counts["get_suffix"] <= 1 and store.counts["get"] == 1
    store.reset()
    r.partitions(end, seen)
    nxt = r.latestOffset(seen, limit)  # busy again: one root read, no footer first
    assert nxt == seen and store.counts["get_suffix"] == 0


def test_idlePollMaxMs_caps_the_idle_backoff_new_data_is_seen_within_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lower cap trades idle requests (1 / cap a second) for how late the first
    record after an idle spell is seen.  Time is simulated."""
    from tieredbuf.spark import stream

    clock = _Clock()
    monkeypatch.setattr(stream.time, "monotonic", clock)
    url = f"file://{tmp_path}/buf"
    append_records(tieredbuf.open(url), [[b"a"]], ts_ms=1000)
    store = _counted(url)
    r = _reader(url, idlePollMaxMs="250")
    limit = r.getDefaultReadLimit()
    end = r.latestOffset(r.initialOffset(), limit)
    assert r.latestOffset(end, limit) == end  # idle from here
    store.reset()
    for _ in range(6000):  # 60 s of polls every 10 ms
        clock.t += 0.01
        assert r.latestOffset(end, limit) == end
    # one footer read per 0.25 s (plus the 10 ms poll tick each pause ends on)
    assert 60 / 0.26 - 3 <= store.counts["get_suffix"] <= 60 / 0.25 + 1
    assert store.counts["get"] == 0
    append_records(tieredbuf.open(url), [[b"b"]], ts_ms=2000)
    waited = 0.0
    while r.latestOffset(end, limit) == end:
        clock.t += 0.01
        waited += 0.01
        assert waited <= 0.25 + 1e-9, "not seen within idlePollMaxMs"


def test_I4_an_idle_default_consumer_query_learns_it_was_fenced_from_the_footer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tieredbuf.spark import stream

    clock = _Clock()
    monkeypatch.setattr(stream.time, "monotonic", clock)
    url = f"file://{tmp_path}/buf"
    append_records(tieredbuf.open(url), [[b"a"]], ts_ms=1000)
    a = _reader(url, consumer="default")
    start = a.initialOffset()
    end = a.latestOffset(start, a.getDefaultReadLimit())
    assert a.latestOffset(end, a.getDefaultReadLimit()) == end  # idle from here
    _reader(url, consumer="default").initialOffset()  # another run fences this one
    clock.t += 10
    with pytest.raises(FencedError):
        a.latestOffset(end, a.getDefaultReadLimit())


def test_I4_an_idle_named_subscriber_query_is_fenced_before_it_plans_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A named subscriber's epoch is in its progress object, not in the footer: an idle
    query spends no request on it, and learns at its first busy trigger -- before it
    plans a micro-batch -- or at its commit, which cannot land."""
    from tieredbuf.spark import stream

    clock = _Clock()
    monkeypatch.setattr(stream.time, "monotonic", clock)
    url = f"file://{tmp_path}/buf"
    append_records(tieredbuf.open(url), [[b"a"]], ts_ms=1000)
    a = _reader(url, consumer="etl")
    start = a.initialOffset()
    end = a.latestOffset(start, a.getDefaultReadLimit())
    assert a.latestOffset(end, a.getDefaultReadLimit()) == end  # idle from here
    _reader(url, consumer="etl").initialOffset()  # another run fences this one
    clock.t += 10
    assert a.latestOffset(end, a.getDefaultReadLimit()) == end  # idle: nothing to do
    with pytest.raises(FencedError):
        a.commit(end)
    append_records(tieredbuf.open(url), [[b"b"]], ts_ms=1000)
    clock.t += 10
    with pytest.raises(FencedError, match=r"'etl'.*progress object"):
        a.latestOffset(end, a.getDefaultReadLimit())


def test_I9_two_subscriber_queries_each_read_everything_and_hold_the_head(
    tmp_path: Path,
) -> None:
    """Two queries with different ``consumer`` names are two subscribers: neither fences
    the other nor the buffer's default consumer, each reads every entry, the head moves
    only once both are past, and a new checkpoint resumes at its subscriber's position."""
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    for s in range(4):
        append_records(buf, [[b"%d" % s]], ts_ms=1000)
    plain = buf.consumer()
    plain.initialize()
    first = plain.next_batch()
    assert first is not None and first.sequence == 0
    a, b = _reader(url, consumer="etl"), _reader(url, consumer="archive")
    ends = []
    for r in (a, b):
        start = r.initialOffset()
        assert start["sequence"] == 0
        end = r.latestOffset(start, r.getDefaultReadLimit())
        assert end["sequence"] == 4
        assert len(r.partitions(start, end)) > 0
        ends.append(end)
    a.commit(ends[0])
    assert buf.snapshot().head == 0  # "archive" and the default consumer still need them
    b.commit(ends[1])
    a.stop()
    b.stop()
    assert buf.snapshot().head == 0  # the default consumer is at 0
    got = plain.next_batch()  # never fenced by either query
    assert got is not None and got.sequence == 1
    assert buf.remove_subscriber("default")
    assert buf.snapshot().head == 4  # both named subscribers are past everything
    again = _reader(url, consumer="etl")  # a new checkpoint: resumes at its position
    assert again.initialOffset()["sequence"] == 4
    assert {s.name for s in buf.subscribers()} == {"etl", "archive"}
