"""Invariant I10 (a record is served only from an object checked against what the manifest
recorded) for every reader but Spark's (tests/spark/test_integrity.py): a data object
replaced, cut short, extended or with a byte flipped behind the buffer's back is never
served, compressed or not, small or read in ranged parts, and nothing is acked past it.

The damage is made as a person or a disk makes it (tests/damage.py): the stored object
is overwritten with a plain PUT (``aws s3 cp``), or -- for a flipped byte -- changed
in place, keeping what the store keeps beside the bytes (``file://``: the file is
written in place; elsewhere :class:`tests.damage.DamagingStore` serves the damaged
bytes).
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

import tieredbuf
from tests.damage import DAMAGES, Damage, DamagingStore, damage_object
from tieredbuf.cli import EXIT_FAILED, main
from tieredbuf.config import Compression
from tieredbuf.consume.fetch import ReadAhead
from tieredbuf.errors import AckOrderError, CorruptError, DamagedObjectError
from tieredbuf.store import open_store

COMPRESSIONS = (Compression.NONE, Compression.ZSTD)
BIG = 17 << 20
"""One record this large makes an object of more than two ranged parts (RANGE_PART)."""
RANGED_BUDGET = 16 << 20
"""A read-ahead budget under one big object: the consumer fetches it in ranged parts."""


@dataclass
class Damaged:
    """A buffer of three entries whose middle one (sequence 1) is damaged."""

    url: str
    buf: tieredbuf.Buffer
    store: DamagingStore
    produced: list[list[bytes]]
    location: str
    how: Damage


def _records(i: int, big: bool) -> list[bytes]:
    if big:
        return [os.urandom(BIG)]
    return [f"entry {i} record {j} ".encode() * 16 for j in range(3)]


def make_damaged(
    url: str, opts: dict[str, Any], how: Damage, comp: Compression, big: bool
) -> Damaged:
    store = DamagingStore(open_store(url, **opts))
    buf = tieredbuf.Buffer(store)
    produced = [_records(i, big) for i in range(3)]
    with buf.producer(batch_compression=comp) as p:
        for recs in produced:
            p.produce(recs).wait(timeout=60)
    entries = buf.entries()
    assert [e.sequence for e in entries] == [0, 1, 2]
    loc = entries[1].location
    if how == "flipped" and not url.startswith("file://"):
        store.damage(loc, how)  # bit rot under the bucket: the store's metadata stays
    else:
        damage_object(store.inner, url, loc, how)
    return Damaged(url, buf, store, produced, loc, how)


def _check_error(e: CorruptError, d: Damaged) -> None:
    assert e.obj == d.location
    if d.how != "flipped":  # a size the manifest did not record: named with both sizes
        assert isinstance(e, DamagedObjectError)
        assert e.sequence == 1 and e.recorded != e.found
        assert f"the manifest recorded {e.recorded}" in str(e)


CASES = [
    pytest.param(how, comp, id=f"{how}-{comp.name.lower()}")
    for how in DAMAGES
    for comp in COMPRESSIONS
]


def _consume_until_error(c: tieredbuf.Consumer, d: Damaged) -> CorruptError:
    """Read as an application does (next_batch, decode, ack): entry 0 is served, entry 1
    raises; what it raises is returned."""
    b0 = c.next_batch(timeout=5)
    assert b0 is not None and b0.sequence == 0 and b0.entries == d.produced[0]
    c.ack(0)
    with pytest.raises(CorruptError) as ei:
        b = c.next_batch(timeout=5)
        assert b is not None
        b.entries  # noqa: B018 -- a zstd block's checksum is checked where it is decoded
    return ei.value


def _never_past(c: tieredbuf.Consumer, d: Damaged) -> None:
    """After the error: no ack past sequence 0 lands, and reading on never serves a
    record of the damaged entry (it raises again, or -- zstd, whose batch was returned
    before its records were decoded -- the next entry cannot be acked before it)."""
    with pytest.raises(CorruptError):
        b = c.next_batch(timeout=5)
        assert b is not None
        if b.sequence == 1:
            b.entries  # noqa: B018
        else:
            assert b.sequence == 2
            with pytest.raises(AckOrderError):
                c.ack(2)
            raise CorruptError("data batch", d.location, 0, "read past, never acked past")
    c.flush()
    assert c.last_acked_sequence == 0


@pytest.mark.slow
@pytest.mark.parametrize(("how", "comp"), CASES)
def test_I10_a_consumer_never_serves_a_damaged_object(
    any_url, how: Damage, comp: Compression
) -> None:  # type: ignore[no-untyped-def]
    url, opts = any_url
    d = make_damaged(url, opts, how, comp, big=False)
    with d.buf.consumer() as c:
        c.initialize()
        _check_error(_consume_until_error(c, d), d)
        _never_past(c, d)
    assert d.buf.snapshot().footer.first_sequence == 1  # the default consumer dequeued 0 only


@pytest.mark.slow
@pytest.mark.parametrize(("how", "comp"), CASES)
@pytest.mark.parametrize("backend", ["memory", "local"])
def test_I10_a_consumer_reading_ranged_parts_never_serves_a_damaged_object(
    backend: str, how: Damage, comp: Compression, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    url = "memory://" if backend == "memory" else f"file://{tmp_path}/buf"
    with ThreadPoolExecutor(1) as pool:  # the consumer's settings: the ranged path
        assert ReadAhead(open_store(url), pool, 8, RANGED_BUDGET).ranged(BIG)
    d = make_damaged(url, {}, how, comp, big=True)
    with d.buf.consumer(read_ahead_bytes=RANGED_BUDGET) as c:
        c.initialize()
        _check_error(_consume_until_error(c, d), d)
        _never_past(c, d)


@pytest.mark.slow
@pytest.mark.parametrize(("how", "comp"), CASES)
def test_I10_a_named_subscriber_never_serves_a_damaged_object(
    how: Damage, comp: Compression, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    d = make_damaged(f"file://{tmp_path}/buf", {}, how, comp, big=False)
    with d.buf.consumer(subscriber="etl") as c:
        c.initialize()
        _check_error(_consume_until_error(c, d), d)
        _never_past(c, d)
    (etl,) = [s for s in d.buf.subscribers() if s.name == "etl"]
    assert etl.next_sequence == 1


def _claim_all(
    w: Any, d: Damaged, timeout: float | None = None
) -> tuple[list[int], list[CorruptError]]:
    """Claim until nothing is claimable (within ``timeout`` the first time), decoding and
    acking what is served; returns the sequences acked and the errors met."""
    acked: list[int] = []
    errors: list[CorruptError] = []
    for _ in range(10):
        try:
            b = w.claim(timeout=timeout if not acked and not errors else None)
            if b is None:
                break
            assert b.entries == d.produced[b.sequence]  # a zstd block's checksum: here
        except CorruptError as e:
            errors.append(e)
            continue
        w.ack(b.sequence)
        acked.append(b.sequence)
    return acked, errors


@pytest.mark.slow
@pytest.mark.parametrize(("how", "comp"), CASES)
def test_I10_a_worker_never_serves_or_acks_a_damaged_object(how: Damage, comp: Compression) -> None:
    d = make_damaged("memory://", {}, how, comp, big=False)
    with d.buf.worker("jobs") as w:
        acked, errors = _claim_all(w, d)
    assert acked == [0, 2] and len(errors) == 1
    _check_error(errors[0], d)
    # the damaged entry is still to do, handed back uncharged: the next worker meets the
    # same error once its pause is over
    with d.buf.worker("jobs") as w2:
        acked2, errors2 = _claim_all(w2, d, timeout=10)
    assert acked2 == [] and len(errors2) == 1 and errors2[0].obj == d.location


@pytest.mark.slow
@pytest.mark.parametrize(("how", "comp"), CASES)
def test_I10_buffer_read_object_never_returns_a_damaged_object(
    how: Damage, comp: Compression
) -> None:
    d = make_damaged("memory://", {}, how, comp, big=False)
    e = d.buf.entries()[1]
    reader = d.buf.reader()
    sized = dict((x.sequence, n) for x, n in reader.poll_sized())
    for size in (None, sized[1]):  # looked up, or as a reader recorded it
        with pytest.raises(CorruptError) as ei:
            data = d.buf.read_object(e, size)
            tieredbuf.ConsumedBatch(1, e.location, e.metadata, data).entries  # noqa: B018
        _check_error(ei.value, d)


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize(("how", "comp"), CASES)
@pytest.mark.parametrize("ack", [True, False], ids=["ack", "no-ack"])
def test_I10_tieredbuf_consume_writes_nothing_of_a_damaged_object_and_acks_nothing_past_it(
    how: Damage, comp: Compression, ack: bool, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    url = f"file://{tmp_path}/buf"
    d = make_damaged(url, {}, how, comp, big=False)
    code, text = _cli("consume", url, *([] if ack else ["--no-ack"]))
    assert code == EXIT_FAILED
    err = capsys.readouterr().err
    assert d.location in err and ("CorruptError" in err or "DamagedObjectError" in err)
    lines = text.splitlines()
    assert lines == [r.decode() for r in d.produced[0]]  # entry 0 only
    assert d.buf.snapshot().footer.first_sequence <= 1  # nothing past the damaged entry acked


# --- what writers keep: the checksum beside a .batch, and RFC 0001's bytes ---------------


def rfc0001_records(body: bytes) -> list[bytes]:
    """A reader written from RFC 0001's data batch section alone, nothing of tieredbuf:
    the 7-byte footer, then the record block (zstd: any conforming decoder)."""
    import struct

    import zstandard

    ctype, count, version = struct.unpack("<BIH", body[-7:])
    assert version == 1 and ctype in (0, 1)
    block = body[:-7]
    if ctype == 1:
        block = zstandard.ZstdDecompressor().decompressobj().decompress(block)
    out, pos = [], 0
    for _ in range(count):
        (n,) = struct.unpack_from("<I", block, pos)
        out.append(block[pos + 4 : pos + 4 + n])
        pos += 4 + n
    assert pos == len(block)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["direct", "staged"])
@pytest.mark.parametrize("comp", COMPRESSIONS, ids=["none", "zstd"])
def test_I10_writers_keep_a_crc32_beside_every_batch_and_its_bytes_stay_rfc_0001(
    any_url, writer: str, comp: Compression, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Every ``.batch`` a producer writes -- direct or through the local tier (a hard link
    on a local directory) -- has its CRC32 in the store's metadata (docs/format.md,
    "Checksums"), and its bytes are RFC 0001's: a reader of the RFC alone reads them."""
    from tieredbuf.format.crc import crc32

    url, opts = any_url
    buf = tieredbuf.open(url, **opts)
    produced = [[b"call %d record %d" % (i, j) for j in range(5)] for i in range(3)]
    if writer == "direct":
        p: Any = buf.producer(batch_compression=comp)
    else:
        p = buf.producer(tmp_path / "stage", records_compression=comp)
    with p:
        for recs in produced:
            p.produce(recs).wait(timeout=60)
    got: list[bytes] = []
    for e in buf.entries():
        obj = buf.store.get(e.location)
        assert obj.crc32 == crc32(obj.data, 0), e.location
        assert obj.data[-7] == comp  # RFC 0001 footer: compression_type
        got += rfc0001_records(obj.data)
    assert got == [r for recs in produced for r in recs]
