"""open_store(): URL schemes, options, and clear ConfigErrors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import S3Endpoint
from tieredbuf import errors, store
from tieredbuf.store import LocalDirStore, ObjStore, open_store


def test_contract_types_are_exported() -> None:
    for name in ("Store", "IfMatch", "PutMode", "ObjectMeta", "GetResult", "open_store"):
        assert hasattr(store, name)
    assert isinstance(open_store("memory://"), store.Store)


def test_memory_is_fresh_and_named_memory_is_shared() -> None:
    a, b = open_store("memory://"), open_store("memory://")
    a.put("k", b"a")
    with pytest.raises(errors.ObjectNotFoundError):
        b.get("k")
    n1, n2 = open_store("memory://test-shared"), open_store("memory://test-shared")
    n1.put("k", b"shared")
    assert n2.get("k").data == b"shared"
    assert n2.url == "memory://test-shared"


def test_file_urls_and_plain_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = open_store((tmp_path / "abs").as_uri())
    assert isinstance(s, LocalDirStore) and s.root == str(tmp_path / "abs")
    s.put("x/y", b"1")
    assert (tmp_path / "abs" / "x" / "y").read_bytes() == b"1"
    assert open_store(str(tmp_path / "abs")).get("x/y").data == b"1"
    monkeypatch.chdir(tmp_path)
    rel = open_store("file://./rel/dir")
    rel.put("k", b"2")
    assert (tmp_path / "rel" / "dir" / "k").read_bytes() == b"2"
    assert open_store("rel/dir").get("k").data == b"2"
    assert open_store("file://localhost" + str(tmp_path / "abs")).get("x/y").data == b"1"


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("ftp://host/x", {}, "unsupported store URL scheme"),
        ("https://example.com/c/p", {}, "unsupported store URL scheme"),
        ("az:///prefix", {}, "names no container"),
        ("az://Bad_Name/p", {"account_name": "acct"}, "not a container name"),
        ("az://ctr/p", {"account_name": "Bad-Account"}, "not an Azure storage account name"),
        ("az://ctr/a/../b", {"account_name": "acct"}, "invalid prefix"),
        ("az://ctr/p", {"account_name": "acct", "region": "x"}, "unknown option"),
        ("abfss://ctr@acct.example.com/p", {}, "names host"),
        ("https://acct.blob.core.windows.net/", {}, "names no container"),
        (
            "https://acct.blob.core.windows.net/ctr/p",
            {"account_name": "other"},
            "names account 'acct' but account_name is 'other'",
        ),
        (
            "az://ctr/p",
            {"account_name": "acct", "account_key": "k", "endpoint": "ftp://x"},
            "http:// or https://",
        ),
        ("s3:///prefix", {}, "names no bucket"),
        ("s3://bucket/a/../b", {}, "invalid prefix"),
        ("s3://bucket/p?x=1", {}, "query"),
        ("s3://bucket/p", {"endpint": "http://x"}, "unknown option.*endpint"),
        ("s3://bucket/p", {"allow_http": "maybe"}, "allow_http"),
        ("s3://bucket/p", {"endpoint": "127.0.0.1:9000"}, "http:// or https://"),
        ("s3://bucket/p", {"endpoint": "http://[::1"}, "not a valid URL"),  # obstore panics
        ("s3://bucket/p", {"endpoint": "http://host:99999"}, "not a valid URL"),
        ("s3://bucket/p", {"endpoint": "http://"}, "names no host"),
        ("s3://bucket/p", {"endpoint": "http://user:pw@host"}, "credentials"),
        ("s3://bucket/p", {"timeout": -1}, "timeout"),
        ("s3://bucket/p", {"max_retries": -1}, "max_retries"),
        ("s3://bucket/p", {"chunk_size": 1024}, "chunk_size"),
        ("file://host/dir", {}, "names host"),
        ("file:rel", {}, "malformed"),
        # a slash short: the fix is the URL as meant, in its own scheme
        ("s3:/bucket/x", {}, r"malformed store URL 's3:/bucket/x': did you mean s3://bucket/x\?"),
        ("s3:bucket/x", {}, r"did you mean s3://bucket/x\?"),
        ("az:/ctr/x", {}, r"did you mean az://ctr/x\?"),
        ("file:/tmp/x", {}, r"did you mean file:///tmp/x\?"),
        ("memory:x", {}, r"did you mean memory://x\?"),
        ("file://", {}, "absolute path"),
        ("memory://name/sub", {}, "only a name"),
        ("memory://", {"endpoint": "x"}, "unknown option"),
        ("/tmp/x", {"region": "x"}, "unknown option"),
        ("", {}, "non-empty"),
    ],
)
def test_bad_urls_and_options_are_config_errors(
    url: str, options: dict[str, object], match: str
) -> None:
    with pytest.raises(errors.ConfigError, match=match):
        open_store(url, **options)


def test_s3_options_default_from_the_aws_environment(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_endpoint.new_bucket()
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.endpoint)
    monkeypatch.setenv("AWS_REGION", s3_endpoint.region)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint.secret_access_key)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    s = open_store(f"s3://{bucket}/from/env", max_retries=1)
    assert isinstance(s, ObjStore)
    s.put("k", b"v", mode="create")
    assert s.get("k").data == b"v"
    client = s3_endpoint.boto3_client()  # type: ignore[no-untyped-call]
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == ["from/env/k"]  # the URL path is the prefix; the probe cleaned up


@pytest.mark.parametrize(
    ("endpoint", "options", "budget"),
    [
        ("https://0123abcd.r2.cloudflarestorage.com", {}, 1.0),  # R2: one write/s per key
        ("https://0123abcd.eu.r2.cloudflarestorage.com", {}, 1.0),
        ("https://r2.example.com", {"r2": True}, 1.0),  # R2 behind another name
        ("https://0123abcd.r2.cloudflarestorage.com", {"r2": "false"}, 5.0),
        ("https://s3.eu-west-1.amazonaws.com", {}, 5.0),
        ("http://127.0.0.1:9000", {}, 5.0),
    ],
)
def test_the_manifest_write_budget_follows_the_store(
    endpoint: str, options: dict[str, object], budget: float
) -> None:
    from tieredbuf.store.base import manifest_writes_per_s

    s = open_store(
        "s3://bucket/p", endpoint=endpoint, access_key_id="a", secret_access_key="b", **options
    )  # no request is sent
    assert manifest_writes_per_s(s) == budget
