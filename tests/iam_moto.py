"""A moto server that enforces IAM policies, in a process of its own, for the tests of
the IAM policies docs/operations.md documents (tests/test_iam.py).

moto checks a request's signature and its user's policies (Action and Resource) once
``INITIAL_NO_AUTH_ACTION_COUNT`` requests have passed; that setting is global to the
process that imports moto, so the server runs alone in a subprocess with it at 0 (the
session's shared moto server stays open).  The server creates an administrator in its
own backend before it listens, and prints its port and the administrator's keys as one
JSON line; every HTTP request, the fixture's included, is then authenticated.

moto 5.2.5 is more permissive than AWS in two ways that matter here, and this server
closes both (a policy that passes here must pass on AWS):

* **Conditions.** moto ignores ``StringLike`` (it evaluates only ``StringEquals``), so a
  ``ListBucket`` restricted by ``s3:prefix`` would allow every prefix.  Here a LIST is
  answered 403 AccessDenied unless a statement allows ``s3:ListBucket`` on the bucket
  with its conditions met by the request's ``s3:prefix``.
* **Missing objects.** AWS answers a GET or HEAD of a missing key 404 only to a caller
  allowed to list the bucket (with ``s3:prefix`` the key, as Ceph RGW does to match
  AWS: ceph/ceph#68577), and 403 AccessDenied to anyone else, so that a caller cannot
  learn what it may not list; moto always answers 404.  Here that 404 becomes a 403
  unless the same ``ListBucket`` check passes.

moto is stricter than AWS in one way: it authorises a DeleteObjects (obstore sends
every delete as one, even of a single key) against the bucket's ARN instead of each
key's, so a policy that allows ``s3:DeleteObject`` on ``BUCKET/PREFIX/...`` keys could
never delete anything.  Here a user's DeleteObjects is answered as AWS answers it: each
key checked against ``s3:DeleteObject`` on its own ARN, the allowed ones deleted, the
others reported in the result as ``AccessDenied``.  (A CopyObject is checked only for
``s3:PutObject`` on its target; AWS also wants ``s3:GetObject`` on its source, which
every policy here that copies has.)

Requests are serialised (moto's conditional PUT is not atomic otherwise: see
tests/servers.py) and logged, one JSON line each: the access key, method, bucket, key,
query and final status, for the tests to check what each role sent.

    python -m tests.iam_moto LOG      # prints {"port": N, "admin": [KEY_ID, SECRET]}
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from tests.endpoint import S3Endpoint

ROOT = Path(__file__).resolve().parent.parent
ACCOUNT = "123456789012"
"""moto's default account."""
START_TIMEOUT_S = 60.0
ADMIN_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
}
_CREDENTIAL_RE = re.compile(r"Credential=([^/,\s]+)/[^/]+/([^/]+)/([^/]+)/")
_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message></Error>"
)
_S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_BUCKET_GET_FLAGS = {
    "uploads", "location", "lifecycle", "versioning", "policy", "policyStatus", "website",
    "acl", "tagging", "logging", "cors", "notification", "accelerate", "versions",
    "publicAccessBlock", "encryption", "replication", "ownershipControls", "object-lock",
}  # fmt: skip
"""A GET of a bucket with one of these is not a LIST (moto's ACTION_MAP)."""


# --- policy evaluation (what AWS decides; only what the documented policies use) -------


def _like(pattern: str, value: str) -> bool:
    """IAM's wildcard match: ``*`` any run of characters, ``?`` one; case-sensitive."""
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, value, re.DOTALL) is not None


def _listed(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _conditions_hold(conditions: dict[str, Any], context: dict[str, str]) -> bool:
    for operator, tests in conditions.items():
        if operator not in ("StringLike", "StringEquals"):
            raise ValueError(f"condition operator {operator!r} is not evaluated here")
        for key, wanted in tests.items():
            if key not in context:
                return False  # a missing key fails a String* condition (no ...IfExists)
            got = context[key]
            match = _like if operator == "StringLike" else str.__eq__
            if not any(match(w, got) for w in _listed(wanted)):
                return False
    return True


def permits(
    documents: list[dict[str, Any]], action: str, resource: str, context: dict[str, str]
) -> bool:
    """Whether policy ``documents`` allow ``action`` on ``resource`` (an explicit Deny
    wins; nothing allowed is denied)."""
    allowed = False
    for doc in documents:
        statements = doc["Statement"]
        for st in [statements] if isinstance(statements, dict) else statements:
            unsupported = {"NotAction", "NotResource", "Principal", "NotPrincipal"} & set(st)
            if unsupported:
                raise ValueError(f"policy elements {sorted(unsupported)} are not evaluated here")
            if not any(_like(a.lower(), action.lower()) for a in _listed(st["Action"])):
                continue
            if not any(_like(r, resource) for r in _listed(st.get("Resource", "*"))):
                continue
            if not _conditions_hold(st.get("Condition", {}), context):
                continue
            if st["Effect"] == "Deny":
                return False
            allowed = True
    return allowed


def _user_policies(key_id: str) -> list[dict[str, Any]] | None:
    """The inline policies of the user owning ``key_id`` (None: no such key)."""
    from moto.iam.models import iam_backends

    backend = iam_backends[ACCOUNT]["aws"]
    for user in backend.users.values():
        if any(k.access_key_id == key_id for k in user.access_keys):
            if backend.list_attached_user_policies(user.name)[0]:
                raise ValueError(f"user {user.name}: managed policies are not evaluated here")
            return [
                json.loads(backend.get_user_policy(user.name, name)["policy_document"])
                for name in backend.list_user_policies(user.name)
            ]
    return None


# --- the server ----------------------------------------------------------------------


@dataclass
class _Call:
    key_id: str | None
    service: str | None
    method: str
    bucket: str
    key: str
    query: dict[str, list[str]]

    @classmethod
    def of(cls, environ: Any) -> _Call:
        auth = environ.get("HTTP_AUTHORIZATION", "")
        m = _CREDENTIAL_RE.search(auth)
        path = unquote(environ.get("PATH_INFO", "")).lstrip("/")
        bucket, _, key = path.partition("/")
        return cls(
            key_id=m.group(1) if m else None,
            service=m.group(3) if m else None,
            method=environ["REQUEST_METHOD"],
            bucket=bucket,
            key=key,
            query=parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True),
        )

    @property
    def is_list(self) -> bool:
        return (
            self.method == "GET" and not self.key and self.bucket != "" and
            not (_BUCKET_GET_FLAGS & set(self.query))
        )  # fmt: skip

    @property
    def is_bulk_delete(self) -> bool:
        return self.method == "POST" and not self.key and "delete" in self.query

    @property
    def is_object_read(self) -> bool:
        return self.method in ("GET", "HEAD") and bool(self.key) and not self.query.keys() - {
            "partNumber", "response-content-type",
        }  # fmt: skip


class Enforcing:
    """WSGI middleware around moto: one request at a time, AWS's ListBucket rules for a
    LIST and for a missing object (see the module docstring), and a log line each."""

    def __init__(self, app: Any, log: Path) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._log = open(log, "a")  # noqa: SIM115 -- lives as long as the server

    def __call__(self, environ: Any, start_response: Any) -> list[bytes]:
        with self._lock:
            call = _Call.of(environ)
            if call.service == "s3" and call.key_id is not None and call.is_bulk_delete:
                docs = _user_policies(call.key_id)
                if docs is not None:
                    body, deleted, denied = _delete_objects(environ, call.bucket, docs)
                    self._write(call, environ, 200, deleted=deleted, denied=denied)
                    start_response(
                        "200 OK",
                        [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
                    )
                    return [body]
            seen: dict[str, Any] = {}

            def capture(status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
                seen["status"], seen["headers"] = status, headers
                return lambda _data: None

            body = b"".join(self._app(environ, capture))
            status, headers = seen["status"], seen["headers"]
            code = int(status.split()[0])
            if call.service == "s3" and call.key_id is not None and self._refused(call, code):
                status, code = "403 Forbidden", 403
                body = b"" if call.method == "HEAD" else _DENIED
                headers = [
                    ("Content-Type", "application/xml"),
                    ("Content-Length", str(len(body))),
                ]
            self._write(call, environ, code)
            start_response(status, headers)
            return [body]

    def _write(self, call: _Call, environ: Any, code: int, **more: Any) -> None:
        line = {
            "key_id": call.key_id,
            "service": call.service,
            "method": call.method,
            "bucket": call.bucket,
            "key": call.key,
            "query": environ.get("QUERY_STRING", ""),
            "status": code,
            **more,
        }
        self._log.write(json.dumps(line) + "\n")
        self._log.flush()

    def _refused(self, call: _Call, code: int) -> bool:
        """AWS's answer differs from moto's: a LIST whose conditions fail, or a 404 for
        a missing object to a caller not allowed to list it."""
        listing = call.is_list and code == 200
        missing = call.is_object_read and code == 404
        if not (listing or missing):
            return False
        assert call.key_id is not None
        docs = _user_policies(call.key_id)
        if docs is None:
            return False  # not a user's key: moto has answered already
        prefix = call.query.get("prefix", [None])[0] if listing else call.key
        context = {} if prefix is None else {"s3:prefix": prefix}
        return not permits(docs, "s3:ListBucket", f"arn:aws:s3:::{call.bucket}", context)


def _delete_objects(
    environ: Any, bucket: str, docs: list[dict[str, Any]]
) -> tuple[bytes, list[str], list[str]]:
    """A DeleteObjects as AWS authorises it: per key (see the module docstring)."""
    from moto.s3.models import s3_backends

    size = int(environ.get("CONTENT_LENGTH") or 0)
    request = ElementTree.fromstring(environ["wsgi.input"].read(size))
    quiet = (request.findtext(f"{_S3_NS}Quiet") or request.findtext("Quiet")) == "true"
    keys = [e.text or "" for e in request.iter() if e.tag in ("Key", f"{_S3_NS}Key")]
    backend = s3_backends[ACCOUNT]["aws"]
    out = ['<?xml version="1.0" encoding="UTF-8"?>', f'<DeleteResult xmlns="{_S3_NS[1:-1]}">']
    deleted, denied = [], []
    for key in keys:
        if permits(docs, "s3:DeleteObject", f"arn:aws:s3:::{bucket}/{key}", {}):
            backend.delete_object(bucket, key)
            deleted.append(key)
            if not quiet:
                out.append(f"<Deleted><Key>{escape(key)}</Key></Deleted>")
        else:
            denied.append(key)
            out.append(
                f"<Error><Key>{escape(key)}</Key><Code>AccessDenied</Code>"
                f"<Message>Access Denied</Message></Error>"
            )
    out.append("</DeleteResult>")
    return "".join(out).encode(), deleted, denied


def _create_admin() -> tuple[str, str]:
    from moto.iam.models import iam_backends

    backend = iam_backends[ACCOUNT]["aws"]
    backend.create_user("us-east-1", "tieredbuf-test-admin")
    backend.put_user_policy("tieredbuf-test-admin", "admin", json.dumps(ADMIN_POLICY))
    key = backend.create_access_key("tieredbuf-test-admin")
    return key.access_key_id, key.secret_access_key


def main() -> None:
    if os.environ.get("INITIAL_NO_AUTH_ACTION_COUNT") != "0":
        raise SystemExit("run with INITIAL_NO_AUTH_ACTION_COUNT=0 (every request authenticated)")
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    log = Path(sys.argv[1])
    admin = _create_admin()
    app = Enforcing(DomainDispatcherApplication(create_backend_app), log)
    server = make_server("127.0.0.1", 0, app, True, request_handler=MotoRequestHandler)
    sys.stdout.write(json.dumps({"port": server.server_address[1], "admin": admin}) + "\n")
    sys.stdout.flush()
    server.serve_forever()


# --- the client side -----------------------------------------------------------------


@dataclass
class IamMoto:
    """A running IAM-enforcing moto server: its administrator, and users made from policies."""

    admin: S3Endpoint
    log: Path

    @property
    def endpoint(self) -> str:
        return self.admin.endpoint

    def _iam(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.admin.access_key_id,
            aws_secret_access_key=self.admin.secret_access_key,
            config=Config(retries={"max_attempts": 1}),
        )

    def user(self, name: str, policy: dict[str, Any]) -> S3Endpoint:
        """A new IAM user holding ``policy`` (inline), and its access key."""
        iam = self._iam()
        iam.create_user(UserName=name)
        iam.put_user_policy(
            UserName=name, PolicyName="tieredbuf", PolicyDocument=json.dumps(policy)
        )
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return S3Endpoint(self.endpoint, "us-east-1", key["AccessKeyId"], key["SecretAccessKey"])

    def requests(self, who: S3Endpoint) -> list[dict[str, Any]]:
        """Every S3 request sent with ``who``'s key so far, in order."""
        lines = self.log.read_text().splitlines()
        return [
            r
            for r in map(json.loads, lines)
            if r["key_id"] == who.access_key_id and r["service"] == "s3"
        ]


@contextmanager
def iam_moto_server(base: Path) -> Iterator[IamMoto]:
    """Start the server (``base`` holds its log); stopped on exit."""
    log = base / "iam-moto.jsonl"
    out = open(base / "iam-moto.out", "wb")  # noqa: SIM115 -- lives as long as the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.iam_moto", str(log)],
        stdout=subprocess.PIPE,
        stderr=out,
        cwd=ROOT,
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
    )
    assert proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        first = proc.stdout.readline() if ready else b""
        if not first:
            proc.kill()
            raise RuntimeError(
                f"the IAM moto server did not start in {START_TIMEOUT_S} s: "
                f"{(base / 'iam-moto.out').read_text()[-2000:]}"
            )
        info = json.loads(first)
        admin = S3Endpoint(f"http://127.0.0.1:{info['port']}", "us-east-1", *info["admin"])
        yield IamMoto(admin, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


if __name__ == "__main__":
    main()
