"""The IAM policies of docs/operations.md ("IAM policy"), each as written, enforced.

Each test parses its role's policy from docs/operations.md, fills in a fresh bucket and
prefix, gives it to a new IAM user of a moto server that enforces IAM (every request
signed and checked, plus the AWS rules moto lacks: tests/iam_moto.py), and runs the
real role with that user's keys: producers in several processes (stateless and staged,
so one holds the commit lease and LISTs and deletes the others' announcements),
consumers (default, named, a worker of a shared work queue), ``tieredbuf gc`` and
``tieredbuf serve``.  The role must work and no request of it may be refused -- a
refusal tieredbuf shrugs off (a failed cleanup) would leave garbage behind on AWS.
Each test then shows, where it is cheap, what the policy does not allow.
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
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from ulid import ULID

import tieredbuf
from tests.endpoint import S3Endpoint
from tests.iam_moto import IamMoto, iam_moto_server, permits
from tieredbuf import errors, keys
from tieredbuf.store import open_store
from tieredbuf.store.probe import PROBES

pytestmark = pytest.mark.s3

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "operations.md"
PREFIX = "apps/buf"
ROLE_OF_SID = {"Producer": "producer", "Consumer": "consumer", "Gc": "gc"}
WAIT_S = 120.0


@pytest.fixture(scope="module")
def iam(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IamMoto]:
    with iam_moto_server(tmp_path_factory.mktemp("iam")) as server:
        yield server


# --- the policies, as docs/operations.md writes them ------------------------------------


def _section() -> str:
    text = DOC.read_text()
    return text.split("\n## IAM policy\n", 1)[1].split("\n## ", 1)[0]


def documented() -> dict[str, str]:
    """The JSON blocks of the section: the role policies by role, and the statements an
    operator adds (by Sid)."""
    out: dict[str, str] = {}
    for block in re.findall(r"```json\n(.*?)```", _section(), re.DOTALL):
        doc = json.loads(block.replace("BUCKET", "b").replace("PREFIX", "p"))
        if "Statement" in doc:
            sids = {
                re.match(r"Tieredbuf(Producer|Consumer|Gc)", st["Sid"]) for st in doc["Statement"]
            }
            (role,) = {ROLE_OF_SID[m.group(1)] for m in sids if m is not None}
            assert role not in out, f"two {role} policies"
            out[role] = block
        else:
            out[doc["Sid"]] = block
    return out


def policy(role: str, bucket: str, *extra: str) -> dict[str, Any]:
    """``role``'s policy for ``s3://bucket/PREFIX``, with the added statements ``extra``."""
    blocks = documented()

    def filled(block: str) -> Any:
        return json.loads(block.replace("BUCKET", bucket).replace("PREFIX", PREFIX))

    doc = filled(blocks[role])
    doc["Statement"].extend(filled(blocks[sid]) for sid in extra)
    return doc


def test_the_section_documents_one_policy_per_role_and_the_server_evaluates_all_of_it() -> None:
    blocks = documented()
    assert {"producer", "consumer", "gc", "TieredbufSubscriberRemoval"} == set(blocks)
    for role in ("producer", "consumer", "gc"):
        doc = policy(role, "b")
        # permits() refuses any element or condition it does not evaluate
        assert permits([doc], "s3:GetObject", f"arn:aws:s3:::b/{PREFIX}/queue/manifest", {})
        assert not permits([doc], "s3:GetObject", "arn:aws:s3:::b/elsewhere/queue/manifest", {})
        assert permits([doc], "s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": f"{PREFIX}/x"})
        assert not permits([doc], "s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": "other/"})
        assert not permits([doc], "s3:ListBucket", "arn:aws:s3:::b", {})


# --- helpers ---------------------------------------------------------------------------


def _options(user: S3Endpoint) -> dict[str, Any]:
    return {**user.options(), "max_retries": 2}


def _env(user: S3Endpoint) -> dict[str, str]:
    """The environment of a CLI or service process running as ``user``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TIEREDBUF_"))}
    return {
        **env,
        "AWS_ACCESS_KEY_ID": user.access_key_id,
        "AWS_SECRET_ACCESS_KEY": user.secret_access_key,
        "AWS_REGION": user.region,
        "AWS_ENDPOINT_URL": user.endpoint,
        "AWS_ALLOW_HTTP": "true",
    }


def _refused(iam: IamMoto, user: S3Endpoint) -> list[dict[str, Any]]:
    """The requests of ``user`` the server refused (whole, or a key of a bulk delete)."""
    return [r for r in iam.requests(user) if r["status"] == 403 or r.get("denied")]


def _probed(iam: IamMoto, user: S3Endpoint) -> bool:
    """Whether ``user`` ran the conditional-write probe (and so its permissions too)."""
    probe = f"{PREFIX}/{keys.PROBE_PREFIX}"
    return any(r["method"] == "PUT" and r["key"].startswith(probe) for r in iam.requests(user))


def _records(url: str, admin: S3Endpoint) -> list[tuple[int, bytes]]:
    """Every (sequence, record) in the buffer, read with the administrator's keys."""
    buf = tieredbuf.open(url, **_options(admin))
    return [
        (e.sequence, r)
        for e in buf.entries()
        for r in tieredbuf.ConsumedBatch(
            e.sequence, e.location, e.metadata, buf.read_object(e)
        ).entries
    ]


def _denied(call: Any) -> None:
    with pytest.raises(errors.AccessDeniedError):
        call()


def _delete_denied(store: Any, key: str) -> None:
    failures = store.delete_many([key])
    assert [k for k, _ in failures] == [key], failures
    assert isinstance(failures[0][1], errors.AccessDeniedError), failures


def _a_data_key(url: str, admin: S3Endpoint) -> str:
    return next(m.key for m in open_store(url, **_options(admin)).list(keys.DATA_PREFIX))


def _old_key(kind: str) -> str:
    """A key of ``kind`` named an hour ago: garbage GC may delete once unreferenced."""
    old = ULID.from_timestamp(ULID().timestamp - 3600)
    return {
        "data": keys.data_key(old),
        "group": keys.group_key(0, old, "group"),
        "progress": keys.progress_key("gone", old),
    }[kind]


class Proc:
    """A child process whose stdout lines are read as they come (never blocking forever)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.p = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env, text=True
        )
        self.lines: list[str] = []

    def line(self, timeout: float = WAIT_S) -> str:
        assert self.p.stdout is not None
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        got = self.p.stdout.readline() if ready else ""
        if not got:
            self.p.kill()
            _, err = self.p.communicate()
            raise AssertionError(f"no line from {self.name} in {timeout} s:\n{err[-3000:]}")
        self.lines.append(got.rstrip("\n"))
        return self.lines[-1]

    def finish(self) -> list[str]:
        out, err = self.p.communicate(timeout=WAIT_S)
        self.lines += out.splitlines()
        assert self.p.returncode == 0, f"{self.name} exited {self.p.returncode}:\n{err[-3000:]}"
        return self.lines


def _producer(url: str, user: S3Endpoint, name: str, *flags: str) -> Proc:
    args = [sys.executable, "-m", "tests.iam_roles", url, json.dumps(_options(user)), name]
    return Proc(f"producer {name}", [*args, *flags])


def _acks(lines: list[str]) -> dict[str, int]:
    return {rec: int(seq) for _, rec, seq in (ln.split() for ln in lines if ln.startswith("ACK "))}


# --- producer ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stateless", "staged"])
def test_producer_policy_runs_two_producer_processes_with_fan_in(
    iam: IamMoto, tmp_path: Path, kind: str
) -> None:
    """Producer A starts alone and takes the commit lease; producer B, started once A's
    first write is REMOTE, finds the lease held, announces its writes under
    ``queue/pending/`` and waits for A to commit them; A LISTs the announcements and
    deletes the ones it committed.  Every record of both lands once, at the sequence its
    handle reported (I2), and no request of either was refused."""
    bucket = iam.admin.new_bucket()
    url = f"s3://{bucket}/{PREFIX}"
    user = iam.user(f"producer-{kind}", policy("producer", bucket))
    b_done = tmp_path / "b-done"
    stage = (
        (lambda n: ["--stage", str(tmp_path / f"stage-{n}")])
        if kind == "staged"
        else (lambda n: [])
    )
    a = _producer(url, user, "a", "--count", "3", "--until", str(b_done), *stage("a"))
    assert a.line().startswith("ACK a:0 ")  # A created the buffer and holds the lease
    b = _producer(url, user, "b", "--count", "12", *stage("b"))
    b_lines = b.finish()
    b_done.touch()
    a_lines = a.finish()
    assert b_lines[-1] == "DONE" and a_lines[-1] == "DONE"

    acked = {**_acks(a_lines), **_acks(b_lines)}
    got = _records(url, iam.admin)
    assert sorted(r.decode() for _, r in got) == sorted(acked), "I2: lost or duplicated"
    assert {r.decode(): s for s, r in got} == acked  # each at the sequence its handle got

    sent = iam.requests(user)
    pending = f"{PREFIX}/{keys.PENDING_PREFIX}"
    assert any(r["method"] == "PUT" and r["key"].startswith(pending) for r in sent), "B announced"
    assert any(
        r["method"] == "GET"
        and not r["key"]
        and f"prefix={pending.replace('/', '%2F')}" in r["query"]
        for r in sent
    ), "A listed the announcements"
    assert any(k.startswith(pending) for r in sent for k in r.get("deleted", ())), "A deleted them"
    assert _probed(iam, user)
    assert _refused(iam, user) == []

    # not wider: no deletes of data or the root, nothing outside the prefix
    store = open_store(url, **_options(user))
    _delete_denied(store, _a_data_key(url, iam.admin))
    _delete_denied(store, keys.MANIFEST_KEY)
    _denied(lambda: list(open_store(f"s3://{bucket}/elsewhere", **_options(user)).list("")))
    _denied(lambda: open_store(f"s3://{bucket}/elsewhere", **_options(user)).get("x"))


# --- consumer ----------------------------------------------------------------------------


def _fill(url: str, admin: S3Endpoint, n: int) -> list[bytes]:
    recs = [f"r{i}".encode() for i in range(n)]
    with tieredbuf.open(url, **_options(admin)).producer() as p:
        for i in range(0, n, 4):
            p.produce(recs[i : i + 4]).wait(timeout=30)
    return recs


@pytest.mark.slow
def test_consumer_policy_runs_the_default_consumer_a_named_subscriber_and_a_worker(
    iam: IamMoto,
) -> None:
    bucket = iam.admin.new_bucket()
    url = f"s3://{bucket}/{PREFIX}"
    recs = _fill(url, iam.admin, 24)
    user = iam.user("consumer", policy("consumer", bucket))
    PROBES.forget()  # the consumer's process probes the endpoint itself
    buf = tieredbuf.open(url, **_options(user))

    def drain(c: Any) -> list[bytes]:
        got: list[bytes] = []
        while (batch := c.next_batch()) is not None:
            got.extend(batch.entries)
            c.ack(batch.sequence)
        c.flush()
        return got

    # all three register before the default consumer dequeues
    etl = buf.consumer(subscriber="etl")
    etl.initialize()
    worker = buf.worker("jobs", lease=timedelta(seconds=30))
    worker.initialize()
    default = buf.consumer()
    default.initialize()
    assert drain(default) == recs
    default.close()
    assert drain(etl) == recs
    etl.close()
    claimed: list[bytes] = []
    while (batch := worker.claim()) is not None:
        claimed.extend(batch.entries)
        worker.ack(batch.sequence)
    worker.flush()
    worker.close()
    assert sorted(claimed) == sorted(recs)
    assert _probed(iam, user)
    assert _refused(iam, user) == []

    # not wider: it writes no data object and deletes nothing but its probe
    store = open_store(url, **_options(user))
    _denied(lambda: store.put(keys.data_key(ULID()), b"x", mode="create"))
    _denied(lambda: store.put(f"{keys.PENDING_PREFIX}x.1.a", b"x", mode="create"))
    _delete_denied(store, _a_data_key(url, iam.admin))
    # removing a subscriber takes the documented extra statement
    _denied(lambda: buf.remove_subscriber("etl"))
    remover = iam.user("remover", policy("consumer", bucket, "TieredbufSubscriberRemoval"))
    assert tieredbuf.open(url, **_options(remover)).remove_subscriber("jobs")
    assert _refused(iam, remover) == []


# --- GC ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_gc_policy_runs_tieredbuf_gc(iam: IamMoto) -> None:
    """``tieredbuf gc`` as the GC user: it publishes a named subscriber's flushed position
    into the root and deletes an unreferenced data object, group and progress object."""
    bucket = iam.admin.new_bucket()
    url = f"s3://{bucket}/{PREFIX}"
    _fill(url, iam.admin, 12)
    admin = tieredbuf.open(url, **_options(iam.admin))
    admin.subscription("slow").initialize()  # holds the head back, so etl publishes lazily
    etl = admin.subscription("etl")
    etl.initialize()
    first, *_, last = admin.entries()
    etl.ack_through(first.sequence)
    etl.flush(publish=True)  # published past the head
    etl.ack_through(last.sequence)
    etl.flush(publish=False)  # its progress object moves; the root learns it from GC
    garbage = [_old_key("data"), _old_key("group"), _old_key("progress")]
    for k in garbage:
        admin.store.put(k, b"unreferenced")
    user = iam.user("gc", policy("gc", bucket))

    run = subprocess.run(
        [sys.executable, "-m", "tieredbuf.cli", "gc", url, "--json"],
        env=_env(user),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert (report["deleted"], report["groups_deleted"], report["progress_deleted"]) == (1, 1, 1), (
        report
    )
    assert report["publications"] == 1, report
    assert not [k for k in garbage if _exists(admin, k)]
    assert _probed(iam, user)
    assert _refused(iam, user) == []

    # not wider: GC writes no data object and no announcement
    store = open_store(url, **_options(user))
    _denied(lambda: store.put(keys.data_key(ULID()), b"x", mode="create"))
    _denied(lambda: store.put(f"{keys.PENDING_PREFIX}x.1.a", b"x", mode="create"))


def _exists(buf: tieredbuf.Buffer, key: str) -> bool:
    try:
        buf.store.head(key)
    except errors.ObjectNotFoundError:
        return False
    return True


# --- the service -------------------------------------------------------------------------


@pytest.mark.slow
def test_producer_policy_runs_tieredbuf_serve_with_two_workers(
    iam: IamMoto, tmp_path: Path
) -> None:
    """``tieredbuf serve --workers 2`` (two processes, two hubs on one buffer) as the
    producer user: concurrent produces with durability=remote are all acknowledged and
    all land; no request was refused; SIGTERM drains and exits 0."""
    from tests.service.server import start_server

    bucket = iam.admin.new_bucket()
    url = f"s3://{bucket}/{PREFIX}"
    user = iam.user("service", policy("producer", bucket))
    server = start_server(url, tmp_path, workers=2, env=_env(user))
    statuses: list[int] = []

    def post(t: int) -> None:
        for i in range(6):
            body = f'{{"t": {t}, "i": {i}}}\n'.encode()
            r = server.post(body, "application/x-ndjson", durability="remote", timeout=60)
            statuses.append(r.status)

    threads = [threading.Thread(target=post, args=(t,)) for t in range(4)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(WAIT_S)
    finally:
        rc = server.terminate()
    assert statuses == [200] * 24, server.logs()[-3000:]
    assert rc == 0, server.logs()[-3000:]
    got = sorted((d["t"], d["i"]) for d in (json.loads(r) for _, r in _records(url, iam.admin)))
    assert got == [(t, i) for t in range(4) for i in range(6)]
    assert _probed(iam, user)
    assert _refused(iam, user) == []
