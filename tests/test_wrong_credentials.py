"""Wrong credentials are reported as wrong credentials, on every command.

Against a server that checks signatures (moto with IAM enforced: tests/iam_moto.py;
Azurite's Shared Key check), a wrong key id, a wrong secret or a wrong Azure key must say
the store *rejected the credentials* and name the service's code (InvalidAccessKeyId,
SignatureDoesNotMatch, AuthenticationFailed) -- never "the credentials lack a permission"
nor an IAM role, which sends the reader to fix a policy that is fine.  A HEAD's refusal
carries no body to say which it is, and most commands start with one (does the buffer
exist?); the store asks once more with a GET, whose answer names the cause.  A real
missing permission is still reported as one.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import tieredbuf
from tests.endpoint import AzureEndpoint, S3Endpoint
from tests.iam_moto import IamMoto, iam_moto_server
from tieredbuf import errors
from tieredbuf.store import open_store
from tieredbuf.store.botostore import BotoS3Store

EXE = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
COMMANDS = [
    ["consume", "{url}"],
    ["consume", "{url}", "--no-ack"],
    ["gc", "{url}"],
    ["gc", "{url}", "--dry-run"],
    ["inspect", "{url}"],
    ["entries", "{url}"],
    ["subscribers", "{url}"],
    ["retention", "{url}"],
    ["grace", "{url}"],
]
PERMISSION = "lack a permission"


@pytest.fixture(scope="module")
def iam(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IamMoto]:
    with iam_moto_server(tmp_path_factory.mktemp("iam-creds")) as server:
        yield server


@pytest.fixture(scope="module")
def s3_buffer(iam: IamMoto) -> str:
    """A buffer holding one record, written with the administrator's keys."""
    bucket = f"tb-{uuid.uuid4().hex[:16]}"
    iam.admin.boto3_client().create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/p"
    with tieredbuf.open(url, **iam.admin.options()).producer() as p:
        p.produce([b"one"]).wait(tieredbuf.Durability.REMOTE, timeout=30)
    return url


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "AZURE_", "TIEREDBUF_"))
    }
    return subprocess.run(
        [EXE, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, "HOME": str(cwd), **env},
        stdin=subprocess.DEVNULL,
    )


def _s3_env(ep: S3Endpoint, key_id: str, secret: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": key_id,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": ep.region,
        "AWS_ENDPOINT_URL": ep.endpoint,
        "AWS_ALLOW_HTTP": "true",
    }


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and "Debug" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a[::2]) for a in COMMANDS])
def test_a_wrong_key_id_is_rejected_credentials_on_every_command(
    iam: IamMoto, s3_buffer: str, tmp_path: Path, argv: list[str]
) -> None:
    env = _s3_env(iam.admin, "AKIAWRONGWRONGWRONG1", iam.admin.secret_access_key)
    r = _run([a.format(url=s3_buffer) for a in argv], env, tmp_path)
    line = _one_line(r)
    assert r.returncode == 3, r.stderr
    assert "CredentialsError" in line and "rejected the credentials" in line, line
    assert "InvalidAccessKeyId" in line, line
    assert PERMISSION not in line, line
    assert "access_key_id" not in line, line  # a Python keyword: the CLI has no such flag


@pytest.mark.s3
@pytest.mark.parametrize("argv", [["consume", "{url}"], ["gc", "{url}"]], ids=["consume", "gc"])
def test_a_wrong_secret_is_a_signature_mismatch(
    iam: IamMoto, s3_buffer: str, tmp_path: Path, argv: list[str]
) -> None:
    env = _s3_env(iam.admin, iam.admin.access_key_id, "wrong" + iam.admin.secret_access_key)
    r = _run([a.format(url=s3_buffer) for a in argv], env, tmp_path)
    line = _one_line(r)
    assert r.returncode == 3, r.stderr
    assert "rejected the credentials" in line and "SignatureDoesNotMatch" in line, line
    assert PERMISSION not in line, line


@pytest.mark.s3
def test_a_missing_permission_is_still_a_missing_permission(
    iam: IamMoto, s3_buffer: str, tmp_path: Path
) -> None:
    """A user whose keys are right but whose policy allows only listing: the GET that
    explains the HEAD's 403 says AccessDenied, so the message stays a permission one."""
    bucket = s3_buffer.split("/")[2]
    lister = iam.user(
        f"lister-{uuid.uuid4().hex[:8]}",
        {
            "Version": "2012-10-17",
            "Statement": [
                {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}"}
            ],
        },
    )
    r = _run(
        ["consume", s3_buffer],
        _s3_env(lister, lister.access_key_id, lister.secret_access_key),
        tmp_path,
    )
    line = _one_line(r)
    assert r.returncode == 3, r.stderr
    assert "AccessDeniedError" in line and PERMISSION in line, line
    assert "rejected the credentials" not in line, line


@pytest.mark.s3
@pytest.mark.parametrize("wrong", ["key_id", "secret"])
def test_the_forked_childs_client_names_the_cause_of_a_refused_head(
    iam: IamMoto, s3_buffer: str, wrong: str
) -> None:
    """botocore (the client of a process forked after obstore started) sees the same bare
    403 on a HEAD: its store asks the same way."""
    ep = iam.admin
    opts = {**ep.options(), "max_retries": 0}
    if wrong == "key_id":
        opts["access_key_id"] = "AKIAWRONGWRONGWRONG1"
    else:
        opts["secret_access_key"] = "x" + ep.secret_access_key
    settings = open_store(s3_buffer, **opts).s3
    assert settings is not None
    store = BotoS3Store(settings, s3_buffer)
    with pytest.raises(errors.CredentialsError) as info:
        store.head("queue/manifest")
    code = "InvalidAccessKeyId" if wrong == "key_id" else "SignatureDoesNotMatch"
    assert code in str(info.value)


@pytest.mark.slow
@pytest.mark.azure
def test_a_wrong_azure_key_is_rejected_credentials_not_a_role(
    azurite_endpoint: AzureEndpoint, tmp_path: Path
) -> None:
    container = f"tb-{uuid.uuid4().hex[:16]}"
    azurite_endpoint.create_container(container)
    url = f"az://{container}/p"
    with tieredbuf.open(url, **azurite_endpoint.options()).producer() as p:
        p.produce([b"one"]).wait(tieredbuf.Durability.REMOTE, timeout=30)
    wrong = base64.b64encode(b"not the account key, but base64 all the same!").decode()
    env = {
        "AZURE_STORAGE_ACCOUNT_NAME": azurite_endpoint.account_name,
        "AZURE_STORAGE_ACCOUNT_KEY": wrong,
        "AZURE_STORAGE_ENDPOINT": azurite_endpoint.endpoint,
    }
    for argv in (["consume", url], ["gc", url], ["inspect", url]):
        r = _run(argv, env, tmp_path)
        line = _one_line(r)
        assert r.returncode == 3, r.stderr
        assert "rejected the credentials" in line, line
        assert "Storage Blob Data Contributor" not in line and PERMISSION not in line, line
        assert "account_key" not in line and "AZURE_STORAGE_ACCOUNT_KEY" in line, line


@pytest.mark.azure
def test_an_azure_key_that_is_not_base64_says_so(
    azurite_endpoint: AzureEndpoint, tmp_path: Path
) -> None:
    env = {
        "AZURE_STORAGE_ACCOUNT_NAME": azurite_endpoint.account_name,
        "AZURE_STORAGE_ACCOUNT_KEY": "not base64!!",
        "AZURE_STORAGE_ENDPOINT": azurite_endpoint.endpoint,
    }
    r = _run(["inspect", "az://some-container/p"], env, tmp_path)
    line = _one_line(r)
    assert r.returncode == 2, r.stderr
    assert "AZURE_STORAGE_ACCOUNT_KEY" in line and "base64" in line, line
    assert "request: failed" not in line, line
    with pytest.raises(errors.ConfigError, match="base64"):
        tieredbuf.open(
            "az://some-container/p", **{**azurite_endpoint.options(), "account_key": "%%"}
        )


@pytest.mark.slow
def test_the_cli_names_azure_settings_by_their_environment_variables(tmp_path: Path) -> None:
    """No "pass account_name=": a Python keyword the command line has no flag for."""
    r = _run(["inspect", "az://some-container/p"], {"AZURE_STORAGE_ACCOUNT_KEY": "abcd"}, tmp_path)
    line = _one_line(r)
    assert r.returncode == 2, r.stderr
    assert "AZURE_STORAGE_ACCOUNT_NAME" in line, line
    assert "pass" not in line and "account_name" not in line, line
    r = _run(["inspect", "az://some-container/p"], {"AZURE_STORAGE_ACCOUNT_NAME": "acct"}, tmp_path)
    line = _one_line(r)
    assert r.returncode == 2, r.stderr
    assert "AZURE_STORAGE_ACCOUNT_KEY" in line, line
    assert "pass" not in line and "=True" not in line, line
