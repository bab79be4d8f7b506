"""S3 settings from a ``~/.aws`` profile, read as the aws CLI and boto3 read them: keys,
region, ``endpoint_url`` and a ``services`` section's ``s3 = endpoint_url``.  Precedence
(AWS's "service-specific endpoints" guide): an explicit option or flag, then
``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the services section, the profile's own
``endpoint_url``; ``ignore_configured_endpoint_urls`` turns the configured ones off.

Every test points HOME and AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE at its own
directory and clears AWS_* first: nothing of the machine's own settings leaks in.  The
round trips talk to the moto server over HTTP with no endpoint given anywhere but the
profile.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tieredbuf
from tests.endpoint import S3Endpoint
from tests.test_cli_first_hour import env_for, tb
from tieredbuf.store.settings import store_options_from_env

pytestmark = pytest.mark.s3

CLOSED = "http://127.0.0.1:9"
"""An endpoint that must never be chosen (the discard port: nothing listens)."""


def _write(home: Path, config: str, *, ep: S3Endpoint | None = None) -> dict[str, str]:
    aws = home / ".aws"
    aws.mkdir(parents=True, exist_ok=True)
    (aws / "config").write_text(config)
    creds = ""
    if ep is not None:
        creds = (
            f"[dev]\naws_access_key_id = {ep.access_key_id}\n"
            f"aws_secret_access_key = {ep.secret_access_key}\n"
        )
    (aws / "credentials").write_text(creds)
    return {
        "HOME": str(home),
        "AWS_CONFIG_FILE": str(aws / "config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(aws / "credentials"),
    }


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    return monkeypatch


def _profile(ep: S3Endpoint, endpoint: str, extra: str = "") -> str:
    return f"[profile dev]\nregion = {ep.region}\nendpoint_url = {endpoint}\n{extra}"


@pytest.mark.slow
def test_the_cli_uses_the_profiles_endpoint_url(tmp_path: Path, s3_endpoint: S3Endpoint) -> None:
    ep = s3_endpoint
    bucket = ep.new_bucket()
    home = tmp_path / "home"
    files = _write(home, _profile(ep, ep.endpoint), ep=ep)
    env = env_for(home, AWS_PROFILE="dev", **files)
    url = f"s3://{bucket}/p"
    r = tb(["produce", url], tmp_path, env=env, stdin="a\nb\n")
    assert r.returncode == 0, r.stderr
    r = tb(["inspect", url, "--json"], tmp_path, env=env)
    assert r.returncode == 0 and '"depth": 1' in r.stdout, r.stderr
    # and it is that endpoint's bucket that holds the buffer
    keys = [o["Key"] for o in ep.boto3_client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert "p/queue/manifest" in keys


def test_tieredbuf_open_uses_the_profiles_endpoint_url(
    tmp_path: Path, s3_endpoint: S3Endpoint, clean_env: pytest.MonkeyPatch
) -> None:
    ep = s3_endpoint
    bucket = ep.new_bucket()
    for k, v in _write(tmp_path, _profile(ep, ep.endpoint), ep=ep).items():
        clean_env.setenv(k, v)
    clean_env.setenv("AWS_PROFILE", "dev")
    buf = tieredbuf.open(f"s3://{bucket}/p")
    assert buf.create()
    with buf.producer() as p:
        p.produce([b"x"])
    assert buf.snapshot().root.next_seq == 1


def test_keys_from_the_environment_and_the_endpoint_from_the_profile(
    tmp_path: Path, s3_endpoint: S3Endpoint
) -> None:
    ep = s3_endpoint
    bucket = ep.new_bucket()
    home = tmp_path / "home"
    files = _write(home, _profile(ep, ep.endpoint))
    env = env_for(
        home,
        AWS_PROFILE="dev",
        AWS_ACCESS_KEY_ID=ep.access_key_id,
        AWS_SECRET_ACCESS_KEY=ep.secret_access_key,
        **files,
    )
    r = tb(["produce", f"s3://{bucket}/p"], tmp_path, env=env, stdin="a\n")
    assert r.returncode == 0, r.stderr


def _resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str, **env: str) -> object:
    for k, v in _write(tmp_path, config).items():
        monkeypatch.setenv(k, v)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    opts = store_options_from_env({"access_key_id": "k", "secret_access_key": "s"})
    return opts.get("endpoint")


SERVICES = "services = local\n\n[services local]\ns3 =\n  endpoint_url = http://127.0.0.1:7001\n"


@pytest.mark.parametrize(
    ("config", "env", "want"),
    [
        ("[default]\nendpoint_url = http://127.0.0.1:7000\n", {}, "http://127.0.0.1:7000"),
        (
            f"[profile dev]\nendpoint_url = {CLOSED}\n{SERVICES}",
            {"AWS_PROFILE": "dev"},
            "http://127.0.0.1:7001",
        ),
        (f"[default]\nendpoint_url = {CLOSED}\n{SERVICES}", {}, "http://127.0.0.1:7001"),
        (
            f"[profile dev]\nendpoint_url = {CLOSED}\n",
            {"AWS_PROFILE": "dev", "AWS_ENDPOINT_URL": "http://127.0.0.1:7002"},
            "http://127.0.0.1:7002",
        ),
        (
            f"[profile dev]\nendpoint_url = {CLOSED}\n",
            {
                "AWS_PROFILE": "dev",
                "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:7003",
                "AWS_ENDPOINT_URL": CLOSED,
            },
            "http://127.0.0.1:7003",
        ),
        (
            f"[profile dev]\nendpoint_url = {CLOSED}\nignore_configured_endpoint_urls = true\n",
            {"AWS_PROFILE": "dev"},
            None,
        ),
        (
            f"[profile dev]\nendpoint_url = {CLOSED}\n",
            {"AWS_PROFILE": "dev", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"},
            None,
        ),
        ("[profile other]\nendpoint_url = http://127.0.0.1:7004\n", {}, None),
    ],
    ids=[
        "default-profile",
        "services-beat-the-profile",
        "services-of-the-default-profile",
        "env-beats-the-profile",
        "service-env-beats-global-env",
        "ignored-by-the-profile",
        "ignored-by-the-env",
        "another-profile-is-not-read",
    ],
)
def test_endpoint_precedence_is_the_aws_clis(
    tmp_path: Path,
    clean_env: pytest.MonkeyPatch,
    config: str,
    env: dict[str, str],
    want: str | None,
) -> None:
    assert _resolved(tmp_path, clean_env, config, **env) == want


def test_an_explicit_endpoint_beats_every_configured_one(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    for k, v in _write(tmp_path, f"[default]\nendpoint_url = {CLOSED}\n").items():
        clean_env.setenv(k, v)
    clean_env.setenv("AWS_ENDPOINT_URL", CLOSED)
    opts = store_options_from_env(
        {"endpoint": "http://127.0.0.1:7005", "access_key_id": "k", "secret_access_key": "s"}
    )
    assert opts["endpoint"] == "http://127.0.0.1:7005"
