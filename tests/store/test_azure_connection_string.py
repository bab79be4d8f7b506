"""``AZURE_STORAGE_CONNECTION_STRING``: the forms Azure's portal, its SDKs and Azurite's
README give, read into ``az://`` options (no server: resolve_azure checks options before
any request).  A round trip through Azurite with only the variable set is in
tests/store/test_azure.py."""

from __future__ import annotations

import pytest

from tieredbuf import errors
from tieredbuf.store.azure import resolve_azure
from tieredbuf.store.settings import AZURITE_KEY, azure_connection_string

KEY = "a2V5" * 22  # base64, 88 characters like a real account key


@pytest.fixture(autouse=True)
def _no_azure_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for var in [v for v in os.environ if v.startswith(("AZURE_", "TIEREDBUF_AZURE"))]:
        monkeypatch.delenv(var)


def test_the_portals_form_names_account_and_key_and_azures_own_endpoint() -> None:
    cs = (
        f"DefaultEndpointsProtocol=https;AccountName=acct1;AccountKey={KEY};"
        "EndpointSuffix=core.windows.net"
    )
    assert azure_connection_string(cs) == {"account_name": "acct1", "account_key": KEY}


def test_a_sovereign_cloud_suffix_or_http_gives_the_blob_endpoint() -> None:
    cs = (
        f"DefaultEndpointsProtocol=https;AccountName=acct1;AccountKey={KEY};"
        "EndpointSuffix=core.chinacloudapi.cn"
    )
    assert azure_connection_string(cs)["endpoint"] == "https://acct1.blob.core.chinacloudapi.cn"
    cs = f"DefaultEndpointsProtocol=http;AccountName=acct1;AccountKey={KEY}"
    assert azure_connection_string(cs)["endpoint"] == "http://acct1.blob.core.windows.net"


def test_azurites_form_and_use_development_storage() -> None:
    cs = (
        f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
        "BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;"
        "QueueEndpoint=http://127.0.0.1:10001/devstoreaccount1;"
    )
    want = {
        "account_name": "devstoreaccount1",
        "account_key": AZURITE_KEY,
        "endpoint": "http://127.0.0.1:10000/devstoreaccount1",
    }
    assert azure_connection_string(cs) == want
    assert azure_connection_string("UseDevelopmentStorage=true") == want


def test_a_sas_connection_string_takes_the_account_from_the_blob_endpoint() -> None:
    cs = "BlobEndpoint=https://acct1.blob.core.windows.net;SharedAccessSignature=sv=2022&sig=x%3D"
    got = azure_connection_string(cs)
    assert got["account_name"] == "acct1" and got["sas_token"] == "sv=2022&sig=x%3D"
    t = resolve_azure("az://ctr/p", {"connection_string": cs})
    assert t.account == "acct1" and t.given["sas_token"] == "sv=2022&sig=x%3D"


def test_setting_names_are_case_insensitive_and_values_keep_their_equals_signs() -> None:
    cs = f"accountname=acct1; ACCOUNTKEY={KEY}==;"
    assert azure_connection_string(cs) == {"account_name": "acct1", "account_key": KEY + "=="}


def test_a_malformed_part_is_a_config_error_that_shows_no_value() -> None:
    with pytest.raises(errors.ConfigError, match="part 2") as ei:
        azure_connection_string(f"AccountName=acct1;{KEY}")
    assert KEY not in str(ei.value)


def test_the_environment_variable_is_read_and_the_other_variables_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        f"AccountName=acct1;AccountKey={KEY};BlobEndpoint=http://127.0.0.1:9/acct1",
    )
    t = resolve_azure("az://ctr/p", {})
    assert (t.account, t.endpoint, t.given["account_key"]) == (
        "acct1",
        "http://127.0.0.1:9/acct1",
        KEY,
    )
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", "http://127.0.0.1:8/acct1")
    assert resolve_azure("az://ctr/p", {}).endpoint == "http://127.0.0.1:8/acct1"


def test_a_connection_string_for_another_account_is_refused_before_any_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName=acct1;AccountKey={KEY}")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct2")
    with pytest.raises(errors.ConfigError, match="for account 'acct1'") as ei:
        resolve_azure("az://ctr/p", {})
    assert KEY not in str(ei.value)


def test_no_credentials_names_the_connection_string_among_the_ways() -> None:
    with pytest.raises(errors.MissingCredentialsError, match="AZURE_STORAGE_CONNECTION_STRING"):
        resolve_azure("az://ctr/p", {"account_name": "acct1"})
