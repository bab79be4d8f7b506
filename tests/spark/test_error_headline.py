"""A Spark option typo is the first line of the error a user sees, not the last line
of a Python traceback buried in Spark's message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tieredbuf

pytestmark = pytest.mark.spark


@pytest.mark.slow
def test_an_option_typo_is_the_first_line_of_the_error(spark: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    with tieredbuf.open(url).producer() as p:
        p.produce([b"x"])
    with pytest.raises(Exception) as ei:
        spark.read.format("tieredbuf").option("endpont", "x").load(url).count()
    first = str(ei.value).strip().splitlines()[0]
    assert "unknown tieredbuf read option 'endpont' (did you mean endpoint?)" in first, first
    with pytest.raises(Exception) as ei:
        spark.readStream.format("tieredbuf").option("startingOffset", "0").load(url)
    first = str(ei.value).strip().splitlines()[0]
    assert "(did you mean startingOffsets?)" in first, first


@pytest.mark.slow
def test_a_window_over_dequeued_records_is_one_message_and_a_later_window_reads(
    spark: Any, tmp_path: Path
) -> None:
    """A buffer whose head moved (a consumer acked and dequeued): a time window that
    reaches back over the dequeued records fails (they are gone: failOnDataLoss) with the
    message alone (what is gone, how to read on), no frames of tieredbuf's planner; with
    failOnDataLoss=false it reads what the buffer keeps."""
    import time

    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    before_ms = int(time.time() * 1000) - 1
    with buf.producer() as p:
        p.produce([b"consumed"])
    c = buf.consumer()
    c.initialize()
    while (b := c.next_batch()) is not None:
        c.ack(b.sequence)
    c.flush()
    assert buf.snapshot().low == 1  # the head moved
    since_ms = int(time.time() * 1000) + 1
    while int(time.time() * 1000) <= since_ms:
        time.sleep(0.001)  # the next record's ingestion time is after since_ms
    with buf.producer() as p:
        p.produce([b"kept"])

    def window(start_ms: int, **more: str) -> list[bytes]:
        df = (
            spark.read.format("tieredbuf")
            .options(**more)
            .option("startingTimestamp", str(start_ms))
            .option("endingTimestamp", str(int(time.time() * 1000) + 1))
            .load(url)
        )
        return [bytes(r.value) for r in df.collect()]

    with pytest.raises(Exception) as ei:
        window(before_ms)
    text = str(ei.value)
    first = text.strip().splitlines()[0]
    assert "DataLossError" in first and "failOnDataLoss=false" in first, first
    assert "startingTimestamp" in first and "first entry" in first, first
    assert "plan.py" not in text and "reader.py" not in text, text  # no planner frames
    # the root keeps no time of what it unlinked, so a window starting between the
    # dequeued record and the kept one cannot be proven whole: the same error ...
    with pytest.raises(Exception, match="DataLossError"):
        window(since_ms)
    # ... and failOnDataLoss=false reads what the buffer keeps
    assert window(since_ms, failOnDataLoss="false") == [b"kept"]
    assert window(before_ms, failOnDataLoss="false") == [b"kept"]
