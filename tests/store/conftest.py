"""Store fixtures: the ``store`` fixture that runs the contract suite against every
backend (memory, local directory, moto, SeaweedFS, Azurite, fake-gcs-server; the servers
are in tests/servers.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.endpoint import AzureEndpoint, GCSEndpoint, S3Endpoint
from tieredbuf.store import ObjStore, Store, open_store
from tieredbuf.store.botostore import BotoS3Store
from tieredbuf.store.counting import MeteredStore
from tieredbuf.store.localdir import LocalDirStore

BACKENDS = [
    "memory",
    "localdir",
    # etags hashed on every read, as on a filesystem without user xattrs
    "localdir-noxattr",
    # what every Buffer uses: the request-counting wrapper (tieredbuf/store/counting.py)
    "localdir-metered",
    pytest.param("moto-metered", marks=pytest.mark.s3),
    pytest.param("moto", marks=pytest.mark.s3),
    pytest.param("seaweedfs", marks=pytest.mark.s3),
    # the botocore client a process forked after obstore started uses (tieredbuf/runtime/forks.py)
    pytest.param("moto-botocore", marks=pytest.mark.s3),
    pytest.param("seaweedfs-botocore", marks=pytest.mark.s3),
    pytest.param("azurite", marks=pytest.mark.azure),
    pytest.param("azurite-metered", marks=pytest.mark.azure),
    pytest.param("fake-gcs", marks=pytest.mark.gcs),
    pytest.param("fake-gcs-metered", marks=pytest.mark.gcs),
]


@pytest.fixture(scope="session")
def seaweedfs_bucket(seaweedfs_endpoint: S3Endpoint) -> str:
    """One bucket for the session; tests isolate themselves by prefix."""
    return seaweedfs_endpoint.new_bucket()


@pytest.fixture(scope="session")
def gcs_bucket(gcs_endpoint: GCSEndpoint) -> str:
    """One bucket for the session; tests isolate themselves by prefix."""
    return gcs_endpoint.new_bucket()


@pytest.fixture(scope="session")
def azurite_container(azurite_endpoint: AzureEndpoint) -> str:
    """One container for the session; tests isolate themselves by prefix."""
    return azurite_endpoint.new_container()


def make_store(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[Store, str, dict[str, Any]]:
    """(store, url, options) for one backend; every call yields a fresh, empty namespace."""
    if backend == "memory":
        url = "memory://"
        return open_store(url), url, {}
    if backend == "localdir":
        url = (tmp_path / "store").as_uri()
        return open_store(url), url, {}
    if backend == "localdir-noxattr":
        url = (tmp_path / "store").as_uri()
        return LocalDirStore(tmp_path / "store", url=url, etag_xattr=False), url, {}
    if backend.endswith("-metered"):
        s, url, opts = make_store(backend.rsplit("-", 1)[0], request, tmp_path)
        return MeteredStore(s), url, opts
    if backend in ("moto-botocore", "seaweedfs-botocore"):
        s, url, opts = make_store(backend.split("-")[0], request, tmp_path)
        assert isinstance(s, ObjStore) and s.s3 is not None
        return BotoS3Store(s.s3, url), url, opts
    if backend == "azurite":
        az: AzureEndpoint = request.getfixturevalue("azurite_endpoint")
        container = request.getfixturevalue("azurite_container")
        url = f"az://{container}/t-{uuid.uuid4().hex[:12]}"
        return open_store(url, **az.options()), url, az.options()
    if backend == "fake-gcs":
        gcs: GCSEndpoint = request.getfixturevalue("gcs_endpoint")
        bucket = request.getfixturevalue("gcs_bucket")
        url = f"gs://{bucket}/t-{uuid.uuid4().hex[:12]}"
        return open_store(url, **gcs.options()), url, gcs.options()
    if backend == "moto":
        ep: S3Endpoint = request.getfixturevalue("s3_endpoint")
        url = f"s3://{ep.new_bucket()}/buf"
    elif backend == "seaweedfs":
        ep = request.getfixturevalue("seaweedfs_endpoint")
        bucket = request.getfixturevalue("seaweedfs_bucket")
        url = f"s3://{bucket}/t-{uuid.uuid4().hex[:12]}"
    else:
        raise AssertionError(backend)
    opts: dict[str, Any] = dict(ep.options())
    opts.update(max_retries=2, retry_timeout=10)
    return open_store(url, **opts), url, opts


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s, _, _ = make_store(backend, request, tmp_path)
    yield s
    s.close()
