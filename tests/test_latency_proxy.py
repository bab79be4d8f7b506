"""The round-trip proxy the benchmarks put in front of moto (tests/latency_proxy.py)."""

from __future__ import annotations

import tieredbuf
from tests.endpoint import S3Endpoint
from tests.latency_proxy import LatencyProxy


def test_the_proxy_passes_reads_writes_and_a_heads_size_through(s3_endpoint: S3Endpoint) -> None:
    """A HEAD answers with no body: its Content-Length is the object's, not zero."""
    url = f"s3://{s3_endpoint.new_bucket()}/p"
    with LatencyProxy(s3_endpoint.endpoint, {}) as proxy:
        buf = tieredbuf.open(url, **{**s3_endpoint.options(), "endpoint": proxy.endpoint})
        buf.store.put("data/k", b"x" * 1234)
        assert buf.store.get("data/k").data == b"x" * 1234
        assert buf.store.get_range("data/k", 1000, 1234) == b"x" * 234
        assert buf.store.head("data/k").size == 1234
    assert proxy.counts["PUT"] == 1 and proxy.counts["HEAD"] == 1 and proxy.counts["GET"] >= 2
