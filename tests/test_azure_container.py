"""``tieredbuf create-container``: the Azure container obstore cannot create.

obstore writes and reads blobs but has no call that creates a container, and Azurite
(like a new storage account) starts with none, so a first ``produce az://...`` fails
with "container does not exist".  The command creates it with the account's own key
(or a SAS), on Azurite as on Azure; a container that exists already is fine; wrong
credentials and an unreachable endpoint are one line each, and an s3:// URL says how
buckets are made instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.endpoint import AzureEndpoint

EXE = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))


def _run(
    argv: list[str], env: dict[str, str], cwd: Path, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
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
        input=stdin,
    )


def _env(ep: AzureEndpoint, key: str | None = None) -> dict[str, str]:
    return {
        "AZURE_STORAGE_ACCOUNT_NAME": ep.account_name,
        "AZURE_STORAGE_ACCOUNT_KEY": key or ep.account_key,
        "AZURE_STORAGE_ENDPOINT": ep.endpoint,
    }


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and "Debug" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.slow
@pytest.mark.azure
def test_create_container_then_produce_and_consume(
    azurite_endpoint: AzureEndpoint, tmp_path: Path
) -> None:
    url = f"az://tb-{uuid.uuid4().hex[:16]}/events"
    env = _env(azurite_endpoint)
    r = _run(["produce", url], env, tmp_path, stdin="x\n")
    assert r.returncode == 3 and "does not exist" in _one_line(r)
    assert "tieredbuf create-container" in r.stderr, r.stderr  # the way out, named
    r = _run(["create-container", url], env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "created container" in r.stdout, r.stdout
    r = _run(["create-container", url], env, tmp_path)  # again: it exists, fine
    assert r.returncode == 0, r.stderr
    assert "already exists" in r.stdout, r.stdout
    r = _run(["produce", url], env, tmp_path, stdin="1\n2\n3\n")
    assert r.returncode == 0, r.stderr
    r = _run(["consume", url], env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "2", "3"]


@pytest.mark.azure
def test_create_container_with_a_wrong_key_is_rejected_credentials(
    azurite_endpoint: AzureEndpoint, tmp_path: Path
) -> None:
    import base64

    wrong = base64.b64encode(b"some other account's key, 64 bytes long: xxxxxxxxxxxx").decode()
    r = _run(
        ["create-container", f"az://tb-{uuid.uuid4().hex[:16]}/p"],
        _env(azurite_endpoint, wrong),
        tmp_path,
    )
    line = _one_line(r)
    assert r.returncode == 3, r.stderr
    assert "CredentialsError" in line and "rejected the credentials" in line, line


@pytest.mark.slow
def test_create_container_against_nothing_listening_gives_up_at_its_timeout(
    tmp_path: Path,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    env = {
        "AZURE_STORAGE_ACCOUNT_NAME": "devstoreaccount1",
        "AZURE_STORAGE_ACCOUNT_KEY": "a2V5",
        "AZURE_STORAGE_ENDPOINT": f"http://127.0.0.1:{port}/devstoreaccount1",
    }
    r = _run(["create-container", "az://some-container/p", "--timeout", "1s"], env, tmp_path)
    line = _one_line(r)
    assert r.returncode == 3, r.stderr
    assert "StoreUnreachableError" in line and "--timeout 1s" in line, line


def test_create_container_refuses_an_s3_url_and_says_how_buckets_are_made(
    tmp_path: Path,
) -> None:
    r = _run(["create-container", "s3://bucket/p"], {}, tmp_path)
    line = _one_line(r)
    assert r.returncode == 2, r.stderr
    assert "Azure" in line and "aws s3 mb" in line, line
