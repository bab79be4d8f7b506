"""S3Endpoint: where a test S3 server listens, and how to talk to it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

# Azurite's well-known development account (public: Azurite's README)
from tieredbuf.store.settings import AZURITE_ACCOUNT, AZURITE_KEY


@dataclass(frozen=True)
class S3Endpoint:
    endpoint: str
    region: str
    access_key_id: str
    secret_access_key: str

    def options(self) -> dict[str, str | bool]:
        """Keyword options for tieredbuf.open() / store.open_store()."""
        return {
            "endpoint": self.endpoint,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "allow_http": self.endpoint.startswith("http://"),
        }

    def boto3_client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )

    def new_bucket(self) -> str:
        name = f"tb-{uuid.uuid4().hex[:16]}"
        self.boto3_client().create_bucket(Bucket=name)
        return name


@dataclass(frozen=True)
class AzureEndpoint:
    """An Azure Blob endpoint (Azurite on loopback): path-style, account in the path."""

    endpoint: str
    """``http://127.0.0.1:PORT/devstoreaccount1``"""
    account_name: str = AZURITE_ACCOUNT
    account_key: str = AZURITE_KEY

    def options(self) -> dict[str, str | bool | int]:
        """Keyword options for tieredbuf.open() / store.open_store()."""
        return {
            "endpoint": self.endpoint,
            "account_name": self.account_name,
            "account_key": self.account_key,
            "max_retries": 2,
        }

    def create_container(self, name: str) -> None:
        """Create a container (obstore cannot): one Shared Key signed request."""
        import base64
        import email.utils
        import hashlib
        import hmac
        import http.client
        from urllib.parse import urlsplit

        parts = urlsplit(self.endpoint)
        date = email.utils.formatdate(usegmt=True)
        version = "2021-08-06"
        # Blob service Shared Key: VERB, 11 standard headers (empty), x-ms-* headers,
        # the canonical resource (/account/path, then the query parameters)
        to_sign = "\n".join(
            [
                "PUT",
                *[""] * 11,
                f"x-ms-date:{date}\nx-ms-version:{version}",
                f"/{self.account_name}{parts.path}/{name}\nrestype:container",
            ]
        )
        mac = hmac.new(base64.b64decode(self.account_key), to_sign.encode(), hashlib.sha256)
        auth = f"SharedKey {self.account_name}:{base64.b64encode(mac.digest()).decode()}"
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        try:
            conn.request(
                "PUT",
                f"{parts.path}/{name}?restype=container",
                headers={
                    "x-ms-date": date,
                    "x-ms-version": version,
                    "Authorization": auth,
                    "Content-Length": "0",
                },
            )
            r = conn.getresponse()
            body = r.read()
        finally:
            conn.close()
        if r.status != 201:
            raise RuntimeError(f"creating container {name}: HTTP {r.status} {body[:300]!r}")

    def new_container(self) -> str:
        name = f"tb-{uuid.uuid4().hex[:16]}"
        self.create_container(name)
        return name


@dataclass(frozen=True)
class GCSEndpoint:
    """A GCS JSON API endpoint (fake-gcs-server on loopback): anonymous, plain HTTP."""

    endpoint: str
    """``http://127.0.0.1:PORT``"""

    def options(self) -> dict[str, str | int]:
        """Keyword options for tieredbuf.open() / store.open_store()."""
        return {"endpoint": self.endpoint, "max_retries": 2}

    def create_bucket(self, name: str) -> None:
        """Create a bucket through the JSON API (the store never creates one)."""
        import json
        import urllib.request

        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            if r.status != 200:
                raise RuntimeError(f"creating bucket {name}: HTTP {r.status}")

    def new_bucket(self) -> str:
        name = f"tb-{uuid.uuid4().hex[:16]}"
        self.create_bucket(name)
        return name
