"""Service URLs (tieredbuf/client/endpoints.py): one or several instances, https, a
path prefix; anything else is one clear line."""

from __future__ import annotations

import pytest

import tieredbuf
from tieredbuf.buffer import is_service_url
from tieredbuf.client.endpoints import Endpoint, parse_endpoints
from tieredbuf.errors import ConfigError


def test_one_url_several_hosts_and_a_list_are_the_same_endpoints() -> None:
    want = (Endpoint("http", "a", 8080), Endpoint("http", "b", 9090))
    assert parse_endpoints("http://a:8080,b:9090") == want
    assert parse_endpoints(["http://a:8080", "http://b:9090"]) == want
    assert parse_endpoints("http://a:8080, http://b:9090") == want
    assert parse_endpoints("http://a:8080,https://c") == (
        Endpoint("http", "a", 8080),
        Endpoint("https", "c", 443),
    )


def test_https_default_ports_ipv6_and_a_path_prefix() -> None:
    assert parse_endpoints("https://ingest.example.com") == (
        Endpoint("https", "ingest.example.com", 443),
    )
    (ep,) = parse_endpoints("http://[::1]:8080/tieredbuf/")
    assert ep == Endpoint("http", "::1", 8080, "/tieredbuf")
    assert ep.produce_path == "/tieredbuf/v1/produce"
    assert ep.url == "http://[::1]:8080/tieredbuf"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("s3://bucket/p", "unsupported service URL"),
        ("127.0.0.1:8080", "unsupported service URL"),
        ("http://", "no host"),
        ("http://a:port", "bad port"),
        ("http://a:99999", "bad port"),
        ("http://user:secret@a:1", "credentials"),
        ("http://a:1/?x=1", "query"),
        ("http://a:1,a:1", "listed twice"),
        ("http://a:1/p,b:2", "a path goes after the last host"),
        ("http://a:1,ftp://b", "unsupported service URL"),
        ([], "no service URL"),
    ],
)
def test_bad_service_urls_are_one_line_errors(url: str | list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says) as e:
        parse_endpoints(url)
    assert "\n" not in str(e.value) and "secret" not in str(e.value)


def test_open_points_an_http_url_to_the_service_producer() -> None:
    assert is_service_url("http://a:1,b:2") and is_service_url("HTTPS://a")
    assert not is_service_url("https://acct.blob.core.windows.net/container")
    assert not is_service_url("file:///tmp/x")
    with pytest.raises(ConfigError, match=r"tieredbuf\.service_producer"):
        tieredbuf.open("http://127.0.0.1:8080")


def test_unknown_options_and_bad_values_are_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="unknown service producer option"):
        tieredbuf.service_producer("http://127.0.0.1:1", flush_intervall=1)
    with pytest.raises(ConfigError, match="durability"):
        tieredbuf.service_producer("http://127.0.0.1:1", durability="disk")
    with pytest.raises(ConfigError, match="not both"):
        tieredbuf.service_producer("http://127.0.0.1:1", token="a" * 20, token_file="f")
    with pytest.raises(ConfigError, match="no service URL is https"):
        tieredbuf.service_producer("http://127.0.0.1:1", ca_file="ca.pem")
    with pytest.raises(ConfigError, match="token characters"):
        tieredbuf.service_producer("http://127.0.0.1:1", token="two words\r\nX-Evil: 1")
