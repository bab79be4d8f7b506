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
