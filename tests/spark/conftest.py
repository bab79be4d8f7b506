"""One local[2] SparkSession per test run, with the tieredbuf source registered.

Python workers do not inherit the driver's sys.path: PYSPARK_PYTHON points at this
interpreter (tieredbuf is installed editable in it) and PYTHONPATH at the checkout.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    from pyspark.sql import SparkSession

    import tieredbuf.spark

    session = (
        SparkSession.builder.master("local[2]")
        .appName("tieredbuf-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.streaming.pollingDelay", "20ms")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    tieredbuf.spark.register(session)
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def buffer_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """(url, store options) of a fresh buffer: a local directory, moto, Azurite or
    fake-gcs-server over HTTP."""
    backend = getattr(request, "param", "local")
    if backend == "local":
        return f"file://{tmp_path}/buf", {}
    if backend == "azure":
        az = request.getfixturevalue("azurite_endpoint")
        return f"az://{az.new_container()}/buf", dict(az.options())
    if backend == "gcs":
        gcs = request.getfixturevalue("gcs_endpoint")
        return f"gs://{gcs.new_bucket()}/buf", dict(gcs.options())
    ep = request.getfixturevalue("s3_endpoint")
    return f"s3://{ep.new_bucket()}/buf", {**ep.options(), "max_retries": 2}


def spark_options(store: dict[str, Any]) -> dict[str, str]:
    """Store options as Spark reader/writer options (strings)."""
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in store.items()}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
