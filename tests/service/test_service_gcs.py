"""``tieredbuf serve gs://...`` on fake-gcs-server: REMOTE acks name an object that is in
the bucket, and every record is consumable after a clean stop (invariant I1), with two
workers sharing the one 1 append/s budget."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.endpoint import GCSEndpoint
from tests.service.server import Server
from tests.service.util import FAST, consume_all, ndjson
from tieredbuf.service.bodies import NDJSON
from tieredbuf.store import open_store

Serve = Callable[..., Server]


@pytest.mark.gcs
@pytest.mark.slow
def test_I1_service_on_gcs_remote_acks_name_the_object_and_everything_is_consumable(
    serve: Serve, gcs_endpoint: GCSEndpoint
) -> None:
    bucket = gcs_endpoint.new_bucket()
    url = f"gs://{bucket}/svc"
    # the emulator as a GCP user reaches one: STORAGE_EMULATOR_HOST, no credentials
    srv = serve(url, *FAST, workers=2, env={"STORAGE_EMULATOR_HOST": gcs_endpoint.endpoint})
    objects = []
    for n in range(3):
        r = srv.post(ndjson([{"n": n, "i": i} for i in range(10)]), NDJSON, "remote")
        assert r.status == 200, r.body
        objects.append(r.json()["object"])
    store = open_store(url, **gcs_endpoint.options())
    for key in objects:
        assert store.head(key).size > 0
    assert srv.terminate() == 0
    records, _, _ = consume_all(url, **gcs_endpoint.options())
    assert sorted(records) == sorted(
        f'{{"n":{n},"i":{i}}}'.encode() for n in range(3) for i in range(10)
    )
