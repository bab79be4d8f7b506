"""A process forked after tieredbuf talked to S3 writes and reads (fork, forkserver,
spawn), and what cannot survive a fork fails at once instead of hanging.

obstore's async runtime does not survive fork(): measured before the fix, the child's
first request hung until a 15 s timeout.  A forked child's S3 store now talks through
botocore (tieredbuf/runtime/forks.py); producers and consumers created before the fork raise
ForkedError in the child.  Each start method runs a real child process on moto.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
from pathlib import Path
from typing import Any

import pytest

import tieredbuf
from tests import fork_worker
from tests.endpoint import S3Endpoint
from tieredbuf import Durability
from tieredbuf.errors import ForkedError
from tieredbuf.format.batch import decode_batch
from tieredbuf.runtime import forks
from tieredbuf.store import ObjStore

CHILD_TIMEOUT_S = 120.0


def _run_child(
    method: str, url: str, opts: dict[str, Any], stage: Path, tag: str
) -> dict[str, Any]:
    ctx = multiprocessing.get_context(method)
    results = ctx.Queue()
    proc = ctx.Process(target=fork_worker.child, args=(url, opts, str(stage), tag, results))
    proc.start()
    try:
        out: dict[str, Any] = results.get(timeout=CHILD_TIMEOUT_S)
    except queue.Empty:
        proc.kill()
        raise AssertionError(
            f"the {method} child hung (no result in {CHILD_TIMEOUT_S} s)"
        ) from None
    finally:
        proc.join(CHILD_TIMEOUT_S)
    assert proc.exitcode == 0, proc.exitcode
    assert "error" not in out, out.get("error")
    return out


@pytest.mark.s3
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
@pytest.mark.slow
def test_a_child_process_writes_remote_and_reads_after_the_parent_used_s3(
    method: str, s3_endpoint: S3Endpoint, tmp_path: Path
) -> None:
    url = f"s3://{s3_endpoint.new_bucket()}/buf"
    opts = s3_endpoint.options()
    buf = tieredbuf.open(url, **opts)
    producer = buf.producer()
    producer.produce([b"parent before"]).wait(Durability.REMOTE, timeout=30)
    consumer = buf.consumer()
    consumer.initialize()
    assert consumer.next_batch() is not None  # the read-ahead pool has threads now
    fork_worker.INHERITED.update(buf=buf, producer=producer, consumer=consumer)
    try:
        out = _run_child(method, url, opts, tmp_path / "child-stage", method)
    finally:
        fork_worker.INHERITED.clear()
    assert out["records"] == [
        b"parent before",
        f"{method} stateless".encode(),
        f"{method} staged".encode(),
    ]
    assert out["stateless_seq"] == 1 and out["staged_seq"] == 2
    if method == "fork":
        # what owns threads fails at once, naming the fix
        for name in ("producer", "consumer"):
            msg = out[f"inherited_{name}"]
            assert "created in process" in msg and f"Create the {name}" in msg, msg
    # the parent is untouched and still writes through obstore
    producer.produce([b"parent after"]).wait(Durability.REMOTE, timeout=30)
    producer.close()
    consumer.close()
    assert [r for e in buf.entries() for r in decode_batch(buf.read_object(e))][-1] == (
        b"parent after"
    )


@pytest.mark.s3
def test_a_forked_childs_s3_store_uses_botocore_and_its_own_probe(
    s3_endpoint: S3Endpoint,
) -> None:
    store = tieredbuf.open(
        f"s3://{s3_endpoint.new_bucket()}/b", **s3_endpoint.options()
    ).store.inner
    assert isinstance(store, ObjStore)
    store.put("k", b"v", mode="create")
    assert not forks.obstore_inherited()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        code = 1
        try:
            from tieredbuf.store.probe import PROBES

            ok = forks.obstore_inherited() and not PROBES.passed(store._probe_target or ("", ""))
            store.put("k2", b"child", mode="create")  # probes again, through botocore
            ok = ok and store.get("k2").data == b"child" and store._forked is not None
            code = 0 if ok else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"\x00" and os.waitstatus_to_exitcode(status) == 0
    os.close(r)
    assert store.get("k2").data == b"child"


def test_fork_guard_raises_forked_error_only_in_another_process() -> None:
    g = forks.ForkGuard("producer")
    g.check()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            g.check()
            os.write(w, b"no error")
        except ForkedError as e:
            os.write(w, str(e).encode()[:200])
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    msg = os.read(r, 1000).decode()
    os.close(r)
    assert "Create the producer after the fork" in msg, msg
