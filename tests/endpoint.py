"""S3Endpoint: where a test S3 server listens, and how to talk to it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


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
