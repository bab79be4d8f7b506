"""gs:// (tieredbuf/store/gcs.py, gcs_open.py): URL forms, credentials, one-line errors per
misconfiguration, the error mapping, the probe, request counting, the per-key write
budget and fork safety, on fake-gcs-server over HTTP (the contract suite runs in
test_contract.py).  Credentials are checked end to end with a service-account key whose
token endpoint is a local HTTP server: the client signs a JWT, trades it for a token
there and sends it to the emulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import tieredbuf
from tests import fork_worker
from tests.endpoint import GCSEndpoint
from tests.tcp_proxy import TcpProxy
from tieredbuf import Durability, errors
from tieredbuf.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CredentialsError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PreconditionFailedError,
    StoreUnreachableError,
    ThrottledError,
    TransientStoreError,
)
from tieredbuf.store import IfMatch, open_store
from tieredbuf.store.base import manifest_writes_per_s
from tieredbuf.store.counting import MeteredStore
from tieredbuf.store.errmap import Facts
from tieredbuf.store.gcs import GCSSettings, GCSStore, gcs_error, gcs_facts, retry_delay
from tieredbuf.store.probe import PROBES

pytestmark = pytest.mark.gcs
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_ambient_google_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials from this machine: no key file, no gcloud login, no metadata server
    (google-auth would otherwise ping it for seconds)."""
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")


def _url(ep: GCSEndpoint) -> str:
    return f"gs://{ep.new_bucket()}/p-{uuid.uuid4().hex[:8]}"


# --- URLs, options, credentials ----------------------------------------------


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("gs:///prefix", {"anonymous": True}, "names no bucket"),
        ("gs://Bad_Bucket/p", {"anonymous": True}, "is not a bucket name"),
        ("gs://-bucket/p", {"anonymous": True}, "is not a bucket name"),
        ("gs://ab/p", {"anonymous": True}, "is not a bucket name"),
        ("gs://bucket/a//b", {"anonymous": True}, "invalid prefix"),
        ("gs://bucket/p", {"region": "x"}, "unknown option.*region.*known: anonymous"),
        ("gs://bucket/p", {"endpoint": "127.0.0.1:4443"}, "http:// or https://"),
        ("gs://bucket/p", {"endpoint": "http://u:pw@h"}, "must not carry credentials"),
        ("gs://bucket/p", {"anonymous": "maybe"}, "anonymous must be a bool"),
        ("gs://bucket/p", {"max_retries": -1}, "max_retries"),  # before credentials
        ("gs://bucket/p", {"timeout": 0}, "timeout must be positive"),
        ("gs://bucket/p", {"probe": "sometimes"}, "probe must be a bool"),
        ("gs://bucket/p", {"anonymous": True, "credentials_file": "/x.json"}, "choose one"),
    ],
)
def test_bad_gs_urls_and_options_are_one_line_config_errors(
    url: str, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(errors.ConfigError, match=match) as ei:
        open_store(url, **options)
    assert "\n" not in str(ei.value)


def test_no_credentials_is_one_line_naming_every_source_before_any_request() -> None:
    with pytest.raises(errors.MissingCredentialsError) as ei:
        open_store("gs://bucket/p")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("no Google Cloud credentials for gs://bucket/p")
    for source in ("GOOGLE_APPLICATION_CREDENTIALS", "application-default login"):
        assert source in msg
    assert "STORAGE_EMULATOR_HOST" in msg


def test_a_credentials_file_that_is_missing_or_not_credentials_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "nope.json"))
    with pytest.raises(
        errors.MissingCredentialsError,
        match=r"GOOGLE_APPLICATION_CREDENTIALS=.*nope\.json is not a file",
    ) as ei:
        open_store("gs://bucket/p")
    assert "\n" not in str(ei.value)
    junk = tmp_path / "junk.json"
    junk.write_text('{"type": "nonsense"}')
    with pytest.raises(errors.MissingCredentialsError, match="not a credentials file") as ei:
        open_store("gs://bucket/p", credentials_file=str(junk))
    assert "\n" not in str(ei.value) and "credentials_file=" in str(ei.value)


def test_without_the_gcs_extra_gs_urls_name_the_extra_in_one_line() -> None:
    code = (
        "import sys; sys.modules['google.cloud.storage'] = None\n"
        "from tieredbuf.store import open_store\n"
        "try:\n"
        "    open_store('gs://bucket/p', anonymous=True)\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, '|', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("ConfigError | gs://bucket/p: gs:// needs the gcs extra"), line
    assert "pip install 'tieredbuf[gcs]'" in line and "\n" not in line


def test_storage_emulator_host_is_honoured_anonymously_in_both_forms(
    gcs_endpoint: GCSEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = gcs_endpoint.new_bucket()
    for value in (gcs_endpoint.endpoint, gcs_endpoint.endpoint.removeprefix("http://")):
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", value)
        s = open_store(f"gs://{bucket}/emu")
        assert isinstance(s, GCSStore) and s.settings.endpoint == gcs_endpoint.endpoint
        s.put("k", value.encode())
        assert s.get("k").data == value.encode()
    # the object is where the URL says: bucket, then prefix
    other = open_store(f"gs://{bucket}", **gcs_endpoint.options())
    assert [m.key for m in other.list("emu/")] == ["emu/k"]


class _TokenServer:
    """An OAuth token endpoint: answers the service-account JWT grant with a token (or,
    ``refuse``, with 400 invalid_grant as Google's does for a revoked key)."""

    def __init__(self, refuse: bool = False) -> None:
        self.grants = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                assert b"grant_type=urn" in body and b"assertion=" in body
                outer.grants += 1
                if refuse:
                    answer = {"error": "invalid_grant", "error_description": "Invalid JWT"}
                    status = 400
                else:
                    answer = {"access_token": "ya29.test-token", "expires_in": 3600}
                    status = 200
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/token"

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join()


def _service_account_file(path: Path, token_uri: str) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    path.write_text(
        json.dumps(
            {
                "type": "service_account",
                "project_id": "tb-test",
                "private_key_id": "k1",
                "private_key": pem,
                "client_email": "tieredbuf@tb-test.iam.gserviceaccount.com",
                "client_id": "1",
                "token_uri": token_uri,
            }
        )
    )
    return path


@pytest.fixture
def token_server() -> Iterator[_TokenServer]:
    ts = _TokenServer()
    yield ts
    ts.close()


def test_a_service_account_key_from_google_application_credentials_gets_a_token_and_works(
    gcs_endpoint: GCSEndpoint,
    token_server: _TokenServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = _service_account_file(tmp_path / "sa.json", token_server.url)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    s = open_store(_url(gcs_endpoint), endpoint=gcs_endpoint.endpoint, probe=False)
    assert token_server.grants == 0  # nothing sent before the first request
    s.put("k", b"signed")
    assert s.get("k").data == b"signed"
    grants = token_server.grants
    assert grants >= 1
    for _ in range(5):
        s.get("k")
    assert token_server.grants == grants  # the token is reused, not fetched per request


def test_a_refused_service_account_key_is_a_one_line_credentials_error(
    gcs_endpoint: GCSEndpoint, tmp_path: Path
) -> None:
    ts = _TokenServer(refuse=True)
    try:
        key = _service_account_file(tmp_path / "sa.json", ts.url)
        s = open_store(_url(gcs_endpoint), endpoint=gcs_endpoint.endpoint, credentials_file=key)
        with pytest.raises(CredentialsError) as ei:
            s.get("k")
    finally:
        ts.close()
    msg = str(ei.value)
    assert "\n" not in msg and "rejected the credentials" in msg
    assert "GOOGLE_APPLICATION_CREDENTIALS" in msg


# --- errors against the emulator ---------------------------------------------


def test_a_missing_bucket_is_bucket_not_found_naming_it_on_every_operation(
    gcs_endpoint: GCSEndpoint,
) -> None:
    s = open_store("gs://tb-no-such-bucket/p", **gcs_endpoint.options())
    calls = {
        "get": lambda: s.get("k"),
        "head": lambda: s.head("k"),
        "get_range": lambda: s.get_range("k", 0, 4),
        "put": lambda: s.put("k", b"v", mode="create"),
        "list": lambda: list(s.list("")),
        "copy": lambda: s.copy("k", "k2"),
    }
    for name, call in calls.items():
        with pytest.raises(BucketNotFoundError) as ei:
            call()
        assert "'tb-no-such-bucket' does not exist" in str(ei.value), name
        assert "\n" not in str(ei.value), name
    assert [type(e) for _, e in s.delete_many(["a", "b"])] == [BucketNotFoundError] * 2


def test_a_missing_object_in_an_existing_bucket_is_object_not_found(
    gcs_endpoint: GCSEndpoint,
) -> None:
    s = open_store(_url(gcs_endpoint), **gcs_endpoint.options())
    with pytest.raises(ObjectNotFoundError):
        s.copy("missing", "dst")
    assert s.delete_many(["missing"]) == []


def test_an_unreachable_endpoint_is_store_unreachable_in_one_line_after_the_retries() -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = open_store("gs://bucket/p", endpoint=f"http://127.0.0.1:{port}", max_retries=1)
    for call in (lambda: s.get("k"), lambda: s.put("k", b"v", mode="create")):
        with pytest.raises(StoreUnreachableError) as ei:
            call()
        msg = str(ei.value)
        assert "\n" not in msg and "connection refused" in msg and "not sent" in msg


def _facts(status: int, message: str = "x", reason: str | None = None) -> Facts:
    return Facts(status=status, code=reason, message=message)


@pytest.mark.parametrize(
    ("facts", "write", "expected"),
    [
        (_facts(412, reason="conditionNotMet"), True, PreconditionFailedError),
        (_facts(429, reason="rateLimitExceeded"), True, ThrottledError),
        (_facts(404), True, BucketNotFoundError),
        (_facts(404), False, ObjectNotFoundError),
        (_facts(404, "The specified bucket does not exist."), False, BucketNotFoundError),
        (_facts(401, reason="required"), False, CredentialsError),
        (_facts(403, reason="forbidden"), True, AccessDeniedError),
        (_facts(503), True, OutcomeUnknownError),
        (_facts(503), False, TransientStoreError),
        (Facts(connect=True, transport="connection refused"), True, StoreUnreachableError),
        (Facts(transport="connection reset"), True, OutcomeUnknownError),
    ],
)
def test_gcs_answers_map_onto_the_error_tree(
    facts: Facts, write: bool, expected: type[Exception]
) -> None:
    err = gcs_error(facts, "queue/manifest", write=write, bucket="b", where="https://x")
    assert type(err) is expected, err
    assert "\n" not in str(err)
    if expected is AccessDeniedError:
        assert "roles/storage.objectUser" in str(err)


def test_the_clients_exceptions_give_their_facts() -> None:
    import requests
    from google.api_core import exceptions as gx

    e = gx.PreconditionFailed(
        "POST http://h/upload: Precondition failed",
        errors=[{"reason": "conditionNotMet", "message": "Precondition Failed"}],
    )
    f = gcs_facts(e)
    assert (f.status, f.code, f.message) == (412, "conditionNotMet", "Precondition Failed")
    assert gcs_facts(gx.TooManyRequests("slow down")).status == 429
    refused = requests.exceptions.ConnectionError("NewConnectionError: Connection refused")
    assert gcs_facts(refused).connect
    reset = requests.exceptions.ConnectionError("('Connection aborted.', RemoteDisconnected())")
    assert not gcs_facts(reset).connect and gcs_facts(reset).transport == "connection reset"
    assert gcs_facts(requests.exceptions.ReadTimeout("x")).transport == "timed out"


def test_only_what_may_pass_by_itself_is_retried_and_never_a_429() -> None:
    s = GCSSettings("b", "", None, None, max_retries=2, retry_timeout=30.0)
    unsent = StoreUnreachableError("x")
    assert retry_delay(unsent, 0, 0.0, s) is not None
    assert retry_delay(OutcomeUnknownError("x"), 1, 0.0, s) is not None
    assert retry_delay(unsent, 2, 0.0, s) is None  # max_retries spent
    assert retry_delay(unsent, 0, 29.99, s) is None  # retry_timeout spent
    assert retry_delay(ThrottledError("429"), 0, 0.0, s) is None  # the caller waits 1 s
    assert retry_delay(PreconditionFailedError("k"), 0, 0.0, s) is None
    assert retry_delay(BucketNotFoundError("b", "gone"), 0, 0.0, s) is None


# --- the probe, counting, the budget -----------------------------------------


def test_the_probe_passes_once_per_bucket_and_is_counted(gcs_endpoint: GCSEndpoint) -> None:
    url = _url(gcs_endpoint)
    inner = open_store(url, **gcs_endpoint.options())
    assert isinstance(inner, GCSStore)
    target = (gcs_endpoint.endpoint, url.split("/")[2])
    metered = MeteredStore(inner)
    metered.put("plain", b"x")  # an unconditional write does not probe
    assert not PROBES.passed(target)
    etag = metered.put("c", b"x", mode="create")
    assert PROBES.passed(target)
    metered.put("c", b"y", mode=IfMatch(etag))
    counts = metered.counts.as_dict()["requests"]
    # the probe's four conditional PUTs and its DELETE, and the test's own two
    assert counts["put_conditional"] == {"probe": 4, "other": 2}
    assert counts["delete"] == {"probe": 1}
    assert list(inner.list("_probe/")) == []


def test_deletes_are_counted_one_request_per_key(gcs_endpoint: GCSEndpoint) -> None:
    s = MeteredStore(open_store(_url(gcs_endpoint), **gcs_endpoint.options()))
    names = [f"d/{i}" for i in range(12)]
    for n in names:
        s.put(n, b"v")
    assert s.delete_many(names) == []
    assert s.counts.total("delete") == 12
    assert list(s.list("d/")) == []


def test_an_object_over_8_mib_round_trips_and_counts_as_the_one_operation_gcs_bills(
    gcs_endpoint: GCSEndpoint,
) -> None:
    s = MeteredStore(open_store(_url(gcs_endpoint), **gcs_endpoint.options(), probe=False))
    body = os.urandom((8 << 20) + 1)
    etag = s.put_multipart("big", [body[: 1 << 20], body[1 << 20 :]], mode="create")
    # a resumable upload (a POST and a PUT): "a completed resumable upload is considered
    # one Class A operation" (GCS's docs)
    assert s.counts.total("put_conditional") == 1
    r = s.get("big")
    assert r.data == body and r.etag == etag
    assert s.get_range("big", len(body) - 3, len(body) + 10) == body[-3:]


def test_gcs_takes_the_one_write_per_second_budget(gcs_endpoint: GCSEndpoint) -> None:
    url = _url(gcs_endpoint)
    assert manifest_writes_per_s(open_store(url, **gcs_endpoint.options())) == 1.0
    buf = tieredbuf.open(url, **gcs_endpoint.options())
    assert manifest_writes_per_s(buf.store) == 1.0  # through the request-counting wrapper
    with buf.producer() as p:
        assert p.manifest_writes_per_s == 1.0


def test_a_foreign_version_token_matches_nothing(gcs_endpoint: GCSEndpoint) -> None:
    s = open_store(_url(gcs_endpoint), **gcs_endpoint.options())
    s.put("k", b"v")
    with pytest.raises(PreconditionFailedError):
        s.put("k", b"w", mode=IfMatch('"d41d8cd98f00b204e9800998ecf8427e"'))
    changed = s.get_if_changed("k", '"d41d8cd98f00b204e9800998ecf8427e"')
    assert changed is not None and changed.data == b"v"
    assert s.get_if_changed("k", changed.etag) is None


# --- fork safety ---------------------------------------------------------------


@pytest.mark.slow
def test_a_forked_child_and_its_parent_read_at_once_without_sharing_a_connection(
    gcs_endpoint: GCSEndpoint,
) -> None:
    host, port = gcs_endpoint.endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy(host, int(port))  # counts the connections made to the server
    url = _url(gcs_endpoint)
    s = open_store(url, **{**gcs_endpoint.options(), "endpoint": proxy.endpoint})
    for who in ("parent", "child"):
        for i in range(4):
            s.put(f"{who}/{i}", f"{who}-{i}".encode() * 500)
    assert s.get("parent/0").data  # the parent's pool now holds an open connection
    before = proxy.accepted
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        code = 1
        try:
            ok = all(
                s.get(f"child/{i % 4}").data == f"child-{i % 4}".encode() * 500 for i in range(150)
            )
            code = 0 if ok else 2
        except BaseException:
            code = 3
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    for i in range(150):  # at the same time as the child
        assert s.get(f"parent/{i % 4}").data == f"parent-{i % 4}".encode() * 500
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"\x00" and os.waitstatus_to_exitcode(status) == 0
    os.close(r)
    # the child opened its own connection: it never sent on the one it inherited
    assert proxy.accepted > before
    proxy.shut()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_child_process_writes_remote_and_reads_after_the_parent_used_gcs(
    method: str, gcs_endpoint: GCSEndpoint, tmp_path: Path
) -> None:
    import multiprocessing
    import queue

    url = _url(gcs_endpoint)
    opts = dict(gcs_endpoint.options())
    buf = tieredbuf.open(url, **opts)
    producer = buf.producer()
    producer.produce([b"parent before"]).wait(Durability.REMOTE, timeout=30)
    fork_worker.INHERITED.update(buf=buf) if method == "fork" else None
    ctx = multiprocessing.get_context(method)
    results = ctx.Queue()
    proc = ctx.Process(
        target=fork_worker.child, args=(url, opts, str(tmp_path / "stage"), method, results)
    )
    proc.start()
    try:
        out: dict[str, Any] = results.get(timeout=120)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"the {method} child hung") from None
    finally:
        proc.join(120)
        fork_worker.INHERITED.clear()
    assert "error" not in out, out.get("error")
    assert out["records"] == [
        b"parent before",
        f"{method} stateless".encode(),
        f"{method} staged".encode(),
    ]
    producer.produce([b"parent after"]).wait(Durability.REMOTE, timeout=30)
    producer.close()


def test_a_listing_longer_than_a_page_is_read_page_by_page(
    gcs_endpoint: GCSEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tieredbuf.store import gcs

    s = MeteredStore(open_store(_url(gcs_endpoint), **gcs_endpoint.options()))
    names = {f"l/{i:03d}" for i in range(23)}
    for n in names:
        s.put(n, b"v")
    s.put("m/other", b"v")
    monkeypatch.setattr(gcs, "LIST_PAGE", 5)  # GCS pages up to 1000 keys
    assert {m.key for m in s.list("l/")} == names
    assert {m.key for m in s.list("")} == names | {"m/other"}
