"""Shared fixtures: one moto S3 server per test run (real HTTP on loopback).

Set ``TIEREDBUF_TEST_S3_ENDPOINT`` (plus AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_REGION) to run the S3 tests against another endpoint (MinIO, LocalStack) instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class S3Endpoint:
    endpoint: str
    region: str
    access_key_id: str
    secret_access_key: str

    def options(self) -> dict[str, str | bool]:
        """Keyword options for tieredbuf.open() / store.open_store()."""
        return {
            "endpoint": self.endpoint,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "allow_http": self.endpoint.startswith("http://"),
        }

    def boto3_client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )

    def new_bucket(self) -> str:
        name = f"tb-{uuid.uuid4().hex[:16]}"
        self.boto3_client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """A real S3 endpoint over HTTP: moto's ThreadedMotoServer on a free loopback port."""
    external = os.environ.get("TIEREDBUF_TEST_S3_ENDPOINT")
    if external:
        yield S3Endpoint(
            endpoint=external,
            region=os.environ.get("AWS_REGION", "us-east-1"),
            access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
            secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        )
        return
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Endpoint(
            endpoint=f"http://{host}:{port}",
            region="us-east-1",
            access_key_id="testing",
            secret_access_key="testing",
        )
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: S3Endpoint) -> str:
    """A fresh, empty bucket on the session's S3 endpoint."""
    return s3_endpoint.new_bucket()


@pytest.fixture
def s3_url(s3_bucket: str) -> str:
    """A buffer URL inside a fresh bucket."""
    return f"s3://{s3_bucket}/buf"


# --- buffers on every backend -------------------------------------------------


@pytest.fixture(params=["memory", "local", pytest.param("s3", marks=pytest.mark.s3)])
def any_url(request: pytest.FixtureRequest, tmp_path) -> tuple[str, dict]:  # type: ignore[no-untyped-def]
    """(url, options) of a fresh, empty buffer on each backend: memory, local dir, moto."""
    if request.param == "memory":
        return f"memory://t-{uuid.uuid4().hex}", {}
    if request.param == "local":
        return f"file://{tmp_path}/buf", {}
    ep: S3Endpoint = request.getfixturevalue("s3_endpoint")
    return f"s3://{ep.new_bucket()}/buf", {**ep.options(), "max_retries": 2}
