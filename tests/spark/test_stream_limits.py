"""Read limits of a micro-batch: ``maxOffsetsPerTrigger`` and ``maxBytesPerTrigger``
both bound it when both are set (as Delta's ``maxFilesPerTrigger`` and
``maxBytesPerTrigger`` do), whichever is reached first.  Driver side, no SparkSession.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable

import tieredbuf
from tests.spark.util import append_records
from tieredbuf.spark import options as opt
from tieredbuf.spark.source import records_struct
from tieredbuf.spark.stream import StreamReader


def _reader(url: str, **options: str) -> StreamReader:
    return StreamReader(opt.parse_read_options({"path": url, **options}), records_struct())


@pytest.mark.parametrize(
    ("max_offsets", "max_objects_bytes", "want"),
    [
        (4, 2, 2),  # the byte limit is reached first
        (2, 5, 2),  # the object limit is reached first
        (None, 3, 3),
        (3, None, 3),
    ],
)
def test_maxBytesPerTrigger_and_maxOffsetsPerTrigger_both_bound_a_micro_batch(
    tmp_path: Path, max_offsets: int | None, max_objects_bytes: int | None, want: int
) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    for s in range(8):
        append_records(buf, [[b"%d" % s * 1000]], ts_ms=1000)
    sizes = {buf.store.head(e.location).size for e in buf.entries()}
    (size,) = sizes  # every object is the same size
    options = {}
    if max_offsets is not None:
        options["maxOffsetsPerTrigger"] = str(max_offsets)
    if max_objects_bytes is not None:
        options["maxBytesPerTrigger"] = str(max_objects_bytes * size)
    r = _reader(url, **options)
    start = r.initialOffset()
    ends = []
    while (end := r.latestOffset(start, r.getDefaultReadLimit())) != start:
        ends.append(end["sequence"])
        start = end
    assert ends == [*range(want, 8, want), 8]
    # Trigger.Once / ReadAllAvailable: Spark asks for everything, in one micro-batch
    r = _reader(url, **options)
    start = r.initialOffset()
    assert r.latestOffset(start, ReadAllAvailable())["sequence"] == 8
