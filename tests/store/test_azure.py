"""Azure Blob URLs (az://, abfs[s]://, https://ACCOUNT.blob.core.windows.net) on Azurite
over HTTP: URL forms, credentials, one-line errors, the conditional-write probe, and
what a forked child does (the contract suite itself runs in test_contract.py)."""

from __future__ import annotations

import multiprocessing
import queue
import socket
import uuid
from typing import Any

import pytest

import tieredbuf
from tests.endpoint import AzureEndpoint
from tieredbuf import Durability, errors
from tieredbuf.store import IfMatch, ObjStore, open_store
from tieredbuf.store.base import manifest_writes_per_s
from tieredbuf.store.probe import PROBES, probe_conditional_writes

pytestmark = pytest.mark.azure
CHILD_TIMEOUT_S = 60.0
AZURE_ENV = (
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_TOKEN",
    "AZURE_CLIENT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_TENANT_ID",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_USE_AZURE_CLI",
    "AZURE_STORAGE_ENDPOINT",
    "AZURE_ALLOW_HTTP",
    "TIEREDBUF_AZURE_MANAGED_IDENTITY",
    "AZURE_STORAGE_CONNECTION_STRING",
)


@pytest.fixture(autouse=True)
def _no_azure_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in AZURE_ENV:
        monkeypatch.delenv(var, raising=False)


def _url(ep: AzureEndpoint) -> str:
    return f"az://{ep.new_container()}/p-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize(
    "form",
    [
        "az://{c}/buf",
        "abfs://{c}/buf",
        "abfss://{c}@devstoreaccount1.dfs.core.windows.net/buf",
        "https://devstoreaccount1.blob.core.windows.net/{c}/buf",
    ],
)
def test_every_azure_url_form_reaches_the_container_under_its_prefix(
    form: str, azurite_endpoint: AzureEndpoint
) -> None:
    container = azurite_endpoint.new_container()
    opts: dict[str, Any] = dict(azurite_endpoint.options())
    if "core.windows.net" in form:
        del opts["account_name"]  # the URL names it
    s = open_store(form.format(c=container), **opts)
    s.put("k", b"v", mode="create")
    plain = open_store(f"az://{container}", **azurite_endpoint.options())
    assert [m.key for m in plain.list("")] == ["buf/k"]  # the probe cleaned up after itself


def test_azure_options_default_from_the_azure_environment(
    azurite_endpoint: AzureEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", azurite_endpoint.account_name)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", azurite_endpoint.account_key)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", azurite_endpoint.endpoint)
    s = open_store(_url(azurite_endpoint), max_retries=1)
    s.put("k", b"v", mode="create")
    assert s.get("k").data == b"v"


def test_azurites_connection_string_alone_opens_the_store(
    azurite_endpoint: AzureEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The form Azurite's README gives, the only Azure variable set."""
    ep = azurite_endpoint
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        f"DefaultEndpointsProtocol=http;AccountName={ep.account_name};"
        f"AccountKey={ep.account_key};BlobEndpoint={ep.endpoint};",
    )
    s = open_store(_url(ep), max_retries=1)
    s.put("k", b"v", mode="create")
    assert s.get("k").data == b"v"


def test_no_azure_credentials_fail_before_any_request() -> None:
    with pytest.raises(errors.MissingCredentialsError, match="AZURE_STORAGE_ACCOUNT_KEY"):
        open_store("az://ctr/p", account_name="acct")
    with pytest.raises(errors.MissingCredentialsError, match="client_id"):
        open_store("az://ctr/p", account_name="acct", client_secret="s", tenant_id="t")
    with pytest.raises(errors.ConfigError, match="no Azure storage account"):
        open_store("az://ctr/p", account_key="k")


def test_an_account_key_that_is_not_base64_is_a_one_line_config_error_saying_so() -> None:
    # checked before obstore builds the store (its own error says only "request: failed")
    with pytest.raises(errors.ConfigError) as ei:
        open_store("az://ctr/p", account_name="acct", account_key="not base64")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("cannot configure Azure store for 'az://ctr/p'")
    assert "is not base64" in msg and 'not base64"' not in msg  # the key itself never shown


def test_a_wrong_account_key_is_a_one_line_credentials_error_that_hides_the_key(
    azurite_endpoint: AzureEndpoint,
) -> None:
    container = azurite_endpoint.new_container()
    wrong = "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXktd3Jvbmcta2V5LTEyMzQ1Njc4OTA="
    opts = {**azurite_endpoint.options(), "account_key": wrong}
    s = open_store(f"az://{container}/p", **opts)
    with pytest.raises(errors.CredentialsError) as ei:
        s.get("k")
    msg = str(ei.value)
    assert "\n" not in msg and "AZURE_STORAGE_ACCOUNT_KEY" in msg, msg
    assert wrong not in msg and wrong not in repr(ei.value.__cause__)


def test_a_missing_container_is_bucket_not_found_naming_it(
    azurite_endpoint: AzureEndpoint,
) -> None:
    s = open_store("az://tb-no-such-container/p", **azurite_endpoint.options())
    with pytest.raises(errors.BucketNotFoundError, match="container 'tb-no-such-container'"):
        s.head("k")
    with pytest.raises(errors.BucketNotFoundError):
        s.put("k", b"v", mode="overwrite")


def test_an_unreachable_endpoint_is_store_unreachable_in_one_line() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = open_store(
        "az://ctr/p",
        endpoint=f"http://127.0.0.1:{port}/devstoreaccount1",
        account_name="devstoreaccount1",
        account_key="a2V5",
        max_retries=0,
    )
    with pytest.raises(errors.StoreUnreachableError) as ei:
        s.get("k")
    assert "\n" not in str(ei.value) and "was not sent" in str(ei.value)


def test_probe_passes_on_azurite_and_runs_once_per_endpoint_and_container(
    azurite_endpoint: AzureEndpoint,
) -> None:
    url = _url(azurite_endpoint)
    s = open_store(url, **azurite_endpoint.options())
    assert isinstance(s, ObjStore) and s.remote is not None
    probe_conditional_writes(ObjStore(s.obstore, url), url)  # straight to the server
    target = (azurite_endpoint.endpoint, s.remote.bucket)
    PROBES.forget()
    s.put("plain", b"x")  # an unconditional write does not probe
    assert not PROBES.passed(target)
    etag = s.put("c", b"x", mode="create")
    assert PROBES.passed(target)
    s.put("c", b"y", mode=IfMatch(etag))
    assert list(s.list("_probe/")) == []


def test_azure_keeps_the_default_manifest_write_budget(azurite_endpoint: AzureEndpoint) -> None:
    s = open_store(_url(azurite_endpoint), **azurite_endpoint.options())
    assert manifest_writes_per_s(s) == 5.0
    buf = tieredbuf.open(_url(azurite_endpoint), **azurite_endpoint.options())
    assert manifest_writes_per_s(buf.store) == 5.0  # through the request-counting wrapper


def _child(url: str, opts: dict[str, Any], results: Any) -> None:
    """Open the buffer in the child and write one record to REMOTE; report what happened."""
    try:
        with tieredbuf.open(url, **opts).producer() as p:
            p.produce([b"from the child"]).wait(Durability.REMOTE, timeout=30)
        results.put({"ok": True})
    except Exception as e:
        results.put({"error": type(e).__name__, "message": str(e)})


def _run_child(method: str, url: str, opts: dict[str, Any]) -> dict[str, Any]:
    ctx = multiprocessing.get_context(method)
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(url, opts, results))
    proc.start()
    try:
        out: dict[str, Any] = results.get(timeout=CHILD_TIMEOUT_S)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"the {method} child hung ({CHILD_TIMEOUT_S} s)") from None
    finally:
        proc.join(CHILD_TIMEOUT_S)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_child_after_the_parent_used_azure_writes_with_spawn_and_is_refused_after_fork(
    method: str, azurite_endpoint: AzureEndpoint
) -> None:
    url = _url(azurite_endpoint)
    opts = dict(azurite_endpoint.options())
    buf = tieredbuf.open(url, **opts)
    with buf.producer() as p:  # obstore's runtime now runs in this process
        p.produce([b"from the parent"]).wait(Durability.REMOTE, timeout=30)
    out = _run_child(method, url, opts)
    if method == "fork":
        # no second Azure client: refused at once, naming the fix (not a hang)
        assert out.get("error") == "ForkedError", out
        assert "'spawn' or 'forkserver'" in out["message"], out
    else:
        assert out == {"ok": True}
    c = buf.consumer()
    c.initialize()
    got = []
    while (b := c.next_batch()) is not None:
        got += b.entries
        c.ack(b.sequence)
    c.close()
    expected = [b"from the parent"] + ([b"from the child"] if method == "spawn" else [])
    assert got == expected
