"""``serve`` and the store: a store that cannot work (a missing bucket, rejected
credentials) stops ``serve`` at start with one line, and a running worker's /readyz says
503 -- /healthz 500 -- while its store fails permanently, found by a check of its own
(one HEAD, at most every ``--store-check-interval`` while /readyz is asked) as well as by
its exports; both are 200 again once the store works.  A load balancer then sends no
traffic to a node that can never export."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.endpoint import S3Endpoint
from tests.service.server import Server
from tests.test_cli_first_hour import no_traceback

pytestmark = pytest.mark.s3

Serve = Callable[..., Server]


def _env(ep: S3Endpoint) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": ep.access_key_id,
        "AWS_SECRET_ACCESS_KEY": ep.secret_access_key,
        "AWS_REGION": ep.region,
    }


def _until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)  # polling an HTTP endpoint against a deadline


def test_serve_against_a_missing_bucket_exits_3_at_start_with_one_line(
    tmp_path: Path, s3_endpoint: S3Endpoint
) -> None:
    ep = s3_endpoint
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tieredbuf.cli",
            "serve",
            "s3://no-such-bucket-tb/p",
            "--staging",
            str(tmp_path / "stage"),
            "--port",
            "0",
            "--workers",
            "1",
            "--endpoint",
            ep.endpoint,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            **_env(ep),
            "HOME": str(tmp_path),
        },
    )
    no_traceback(r)
    assert r.returncode == 3, r.stderr
    assert "listening on" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-bucket-tb" in lines[0], r.stderr


@pytest.mark.slow
def test_readyz_is_503_while_the_bucket_is_gone_and_200_once_it_is_back(
    s3_endpoint: S3Endpoint, serve: Serve
) -> None:
    ep = s3_endpoint
    bucket = ep.new_bucket()
    srv = serve(
        f"s3://{bucket}/p",
        "--endpoint",
        ep.endpoint,
        "--store-check-interval",
        "100ms",
        env=_env(ep),
    )
    assert srv.request("GET", "/readyz").status == 200
    s3 = ep.boto3_client()
    for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
        s3.delete_object(Bucket=bucket, Key=o["Key"])
    s3.delete_bucket(Bucket=bucket)
    # nothing is written: the worker's own check finds it
    _until(lambda: srv.request("GET", "/readyz").status == 503)
    r = srv.request("GET", "/readyz")
    assert "BucketNotFoundError" in r.json()["error"], r.body
    assert srv.request("GET", "/healthz").status == 500
    s3.create_bucket(Bucket=bucket)
    _until(lambda: srv.request("GET", "/readyz").status == 200)
    assert srv.request("GET", "/healthz").status == 200
