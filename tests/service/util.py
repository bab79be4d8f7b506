"""Helpers for the service tests: request bodies and reading a buffer back."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa

import tieredbuf
from tieredbuf.service.bodies import encode_length_prefixed

FAST = ("--max-open-duration", "50ms", "--wal-flush-interval", "2ms")
"""Seal quickly so durability=remote answers in tens of milliseconds."""
T = TypeVar("T")


def ndjson(records: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)


def octets(records: list[bytes]) -> bytes:
    return encode_length_prefixed(records)


def arrow_stream(batches: list[pa.RecordBatch], compression: str | None = None) -> bytes:
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, batches[0].schema, options=opts) as w:
        for b in batches:
            w.write_batch(b)
    return sink.getvalue().to_pybytes()


def consume_all(url: str, **opts: Any) -> tuple[list[bytes], list[pa.RecordBatch], list[Any]]:
    """(records, slot-0 record batches, consumed batches) of every queued entry, acked."""
    buf = tieredbuf.open(url, **opts)
    c = buf.consumer()
    c.initialize()
    records: list[bytes] = []
    bundles: list[pa.RecordBatch] = []
    seen = []
    while (b := c.next_batch()) is not None:
        seen.append(b)
        if b.location.endswith(".qseg"):
            bundles.extend(bd[0] for bd in b.bundles())
        else:
            records.extend(b.entries)
        c.ack(b.sequence)
    c.flush()
    c.close()
    buf.close()
    return records, bundles, seen


def stage_files(stage: Any) -> dict[str, int]:
    """Every file under a stage root with its size (what a bad request must not change)."""
    return {
        str(p.relative_to(stage)): p.stat().st_size
        for p in stage.rglob("*")
        if p.is_file() and ".prometheus" not in p.parts
    }


def settled_stage_files(stage: Any, timeout: float = 60.0) -> dict[str, int]:
    """:func:`stage_files` once no sealed segment is left to export (a REMOTE answer comes
    when its segment is in the queue; the exporter releases the file just after, and its
    ``.json`` sidecar once the WAL cursor has passed the segment's entries)."""
    deadline = time.monotonic() + timeout
    while any(".batch" in p.name or ".qseg" in p.name for p in stage.rglob("segments/*")):
        assert time.monotonic() < deadline, f"still staged after {timeout} s"
        time.sleep(0.05)  # polling the stage directory against a deadline
    return stage_files(stage)


def samples(text: str) -> dict[str, float]:
    """Prometheus exposition -> {"name{a=1,b=2}": value} (no labels: just the name)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def worker_pids(supervisor: int) -> list[int]:
    """The supervisor's worker processes (Linux /proc)."""
    text = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text()
    return [int(p) for p in text.split()]


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def peak_growth(pid: int, action: Callable[[], T]) -> tuple[T, int]:
    """``action()``'s result and how far process ``pid``'s resident memory rose above
    where it stood before it (bytes): the peak RSS (VmHWM) is reset first, through
    ``/proc/<pid>/clear_refs``."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = _status_kib(pid, "VmRSS")
    result = action()
    return result, (_status_kib(pid, "VmHWM") - before) * 1024


def self_signed(cert_path: Path, key_path: Path) -> tuple[Path, Path, ssl.SSLContext]:
    """A certificate for 127.0.0.1 and localhost, made now (never checked in), written
    to ``cert_path`` and ``key_path``; with a client context that trusts exactly it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tieredbuf test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    client = ssl.create_default_context(cafile=str(cert_path))
    return cert_path, key_path, client
