"""The outputs of ``tieredbuf consume`` (and ``tieredbuf work``'s rows): stdout, a
line per record or, with ``--json``, a JSON object per record or Arrow bundle row;
``--out DIR``, each data object as it is; ``--out FILE.arrow`` (Arrow IPC file) or
``--out FILE.parquet``, rows.  A sink's ``commit()`` makes what it wrote durable
(flushed, or fsynced) before its batch is acked."""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import decimal
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from tieredbuf import keys
from tieredbuf.cli._common import writing
from tieredbuf.consume.consumer import ConsumedBatch
from tieredbuf.errors import ConfigError, OutputError, TieredBufError
from tieredbuf.format.manifest import MetadataItem
from tieredbuf.runtime.fsutil import fsync_dir

if TYPE_CHECKING:
    import pyarrow as pa


ARROW_SUFFIXES = (".arrow", ".arrows", ".ipc", ".feather")
PARQUET_SUFFIXES = (".parquet", ".pq")


class OutputSchemaError(TieredBufError):
    """Rows for one --out file changed schema: an Arrow or Parquet file holds one."""


def _text(b: bytes, key: str) -> dict[str, str]:
    try:
        return {key: b.decode("utf-8")}
    except UnicodeDecodeError:
        return {f"{key}_base64": base64.b64encode(b).decode("ascii")}


def _json_default(v: object) -> object:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(v).decode("ascii")}
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):
        return str(v)
    return str(v)


def _item_for(md: tuple[MetadataItem, ...], index: int) -> MetadataItem | None:
    found = None
    for m in md:
        if m.start_index <= index:
            found = m
        else:
            break
    return found


def record_rows(b: ConsumedBatch) -> list[dict[str, Any]]:
    """One dict per record of a ``.batch`` object (the --json layout)."""
    rows = []
    for i, value in enumerate(b.entries):
        m = _item_for(b.metadata, i)
        row: dict[str, Any] = {
            "sequence": b.sequence,
            "index": i,
            "ingestion_time_ms": None if m is None else m.ingestion_time_ms,
        }
        row.update(_text(m.payload if m else b"", "metadata"))
        row.update(_text(value, "value"))
        rows.append(row)
    return rows


def bundle_rows(b: ConsumedBatch) -> list[dict[str, Any]]:
    """One dict per row of each slot of each bundle of a ``.qseg`` object."""
    from tieredbuf.format.segment import decode_segment

    rows: list[dict[str, Any]] = []
    for bi, bundle in enumerate(decode_segment(b.data, obj=b.location)):
        t = None if bundle.ingestion_ts_nanos is None else bundle.ingestion_ts_nanos // 1_000_000
        for slot in sorted(bundle.slots):
            for r, values in enumerate(bundle.slots[slot].to_pylist()):
                rows.append(
                    {
                        "sequence": b.sequence,
                        "bundle": bi,
                        "slot": slot,
                        "row": r,
                        "ingestion_time_ms": t,
                        "value": values,
                    }
                )
    return rows


def is_bundles(b: ConsumedBatch) -> bool:
    return b.location.endswith(keys.SEGMENT_SUFFIX)


class Sink(Protocol):
    def write(self, b: ConsumedBatch) -> int: ...
    def commit(self) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


class StdoutSink:
    """Records as lines (or JSON), bundles as JSON rows; ``commit`` flushes stdout."""

    def __init__(self, out: TextIO, as_json: bool) -> None:
        self.out, self.as_json = out, as_json

    def write(self, b: ConsumedBatch) -> int:
        if is_bundles(b):
            rows = bundle_rows(b)
        elif self.as_json:
            rows = record_rows(b)
        else:
            recs = b.entries
            self.out.write("".join(r.decode("utf-8", "backslashreplace") + "\n" for r in recs))
            return len(recs)
        self.out.write("".join(json.dumps(r, default=_json_default) + "\n" for r in rows))
        return len(rows)

    def commit(self) -> None:
        self.out.flush()

    def close(self) -> None:
        self.out.flush()

    def abort(self) -> None:
        with contextlib.suppress(OutputError):  # what was written goes out; nothing more
            self.out.flush()


class DirSink:
    """Each data object as ``DIR/<sequence>.batch|.qseg``, fsynced before its ack."""

    def __init__(self, outdir: Path) -> None:
        self.dir = outdir
        with writing(outdir):
            outdir.mkdir(parents=True, exist_ok=True)

    def write(self, b: ConsumedBatch) -> int:
        suffix = keys.SEGMENT_SUFFIX if is_bundles(b) else keys.BATCH_SUFFIX
        path = self.dir / f"{b.sequence:020d}{suffix}"
        try:
            with writing(path), open(path, "wb") as f:
                f.write(b.data)
                f.flush()
                os.fsync(f.fileno())
        except OutputError:
            path.unlink(missing_ok=True)  # no object cut short under its name
            raise
        return 0 if is_bundles(b) else len(b.entries)

    def commit(self) -> None:
        with writing(self.dir):
            fsync_dir(self.dir)

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass  # each file is complete (fsynced) before its ack; unacked ones are read again


class ArrowFileSink:
    """Rows into one Arrow IPC or Parquet file.

    Records become (sequence, index, ingestion_time, metadata, value) rows; bundle slot
    0 goes to the file as its batches are, slot ``k`` > 0 to ``<stem>.slot<k><suffix>``.
    A file holds one kind of row and one schema: records and slot-0 bundles in one
    buffer, or a slot whose schema changes, fail with OutputSchemaError (use ``--out
    DIR``).  Each file is written under ``<name>.partial`` and renamed to its name only
    once closed and fsynced, so a file under the final name is always complete; the
    acking consumer acks only after :meth:`commit`, at the end.  :meth:`abort` removes
    the partial files of a failed run.
    """

    def __init__(self, path: Path, parquet: bool) -> None:
        self.path, self.parquet = path, parquet
        self._writers: dict[Path, tuple[Any, pa.Schema, str]] = {}
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)

    def _target(self, slot: int) -> Path:
        if slot <= 0:
            return self.path
        return self.path.with_name(f"{self.path.stem}.slot{slot}{self.path.suffix}")

    @staticmethod
    def _partial(target: Path) -> Path:
        return target.with_name(target.name + ".partial")

    def _put(self, slot: int, batch: pa.RecordBatch, seq: int) -> None:
        import pyarrow as pa

        target = self._target(slot)
        what = "records" if slot < 0 else f"slot-{slot} bundles"
        got = self._writers.get(target)
        if got is None:
            with writing(target):
                if self.parquet:
                    import pyarrow.parquet as pq

                    w: Any = pq.ParquetWriter(self._partial(target), batch.schema)
                else:
                    w = pa.ipc.new_file(self._partial(target), batch.schema)
            got = self._writers[target] = (w, batch.schema, what)
        w, schema, holds = got
        if holds != what:
            raise OutputSchemaError(
                f"sequence {seq}: {what} and {holds} would share {target}; write to a "
                "directory (--out DIR) instead"
            )
        if not batch.schema.equals(schema):
            raise OutputSchemaError(
                f"sequence {seq}: its rows ({', '.join(batch.schema.names)}) do not match"
                f" the schema ({', '.join(schema.names)}) of {target}; write to a directory"
                " (--out DIR) instead"
            )
        with writing(target):
            w.write_batch(batch)

    def write(self, b: ConsumedBatch) -> int:
        import pyarrow as pa

        if is_bundles(b):
            from tieredbuf.format.segment import decode_segment

            n = 0
            for bundle in decode_segment(b.data, obj=b.location):
                for slot in sorted(bundle.slots):
                    self._put(slot, bundle.slots[slot], b.sequence)
                    n += bundle.slots[slot].num_rows
            return n
        rows = record_rows(b)
        recs = b.entries
        batch = pa.record_batch(
            {
                "sequence": pa.array([b.sequence] * len(recs), pa.uint64()),
                "index": pa.array(range(len(recs)), pa.uint32()),
                "ingestion_time": pa.array(
                    [r["ingestion_time_ms"] for r in rows], pa.timestamp("ms", tz="UTC")
                ),
                "metadata": pa.array([_metadata_of(b, i) for i in range(len(recs))], pa.binary()),
                "value": pa.array(recs, pa.binary()),
            }
        )
        self._put(-1, batch, b.sequence)
        return len(recs)

    def commit(self) -> None:
        """Close every file, fsync it, rename it to its name and fsync the folder: the rows
        are durable and every file under its final name is complete."""
        for target, (w, _, _) in self._writers.items():
            partial = self._partial(target)
            with writing(target):
                w.close()
                with open(partial, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(partial, target)
        if self._writers:
            with writing(self.path.parent):
                fsync_dir(self.path.parent)
        self._writers.clear()

    def close(self) -> None:
        self.commit()

    def abort(self) -> None:
        """A failed run: drop the partial files (nothing was acked)."""
        for target, (w, _, _) in self._writers.items():
            with contextlib.suppress(Exception):
                w.close()
            self._partial(target).unlink(missing_ok=True)
        self._writers.clear()


def _metadata_of(b: ConsumedBatch, i: int) -> bytes:
    m = _item_for(b.metadata, i)
    return b"" if m is None else m.payload


def make_sink(args: argparse.Namespace, out: TextIO) -> Sink:
    if not args.out:
        return StdoutSink(out, args.json)
    path = Path(args.out)
    suffix = path.suffix.lower()
    if suffix in ARROW_SUFFIXES or suffix in PARQUET_SUFFIXES:
        if args.follow and not args.no_ack:
            raise ConfigError(
                f"--follow with --out {args.out} would never ack (an Arrow or Parquet file "
                "is complete only when closed): use --out DIR, or --no-ack"
            )
        return ArrowFileSink(path, parquet=suffix in PARQUET_SUFFIXES)
    if suffix and not path.is_dir():
        raise ConfigError(
            f"--out {args.out}: {suffix} is not an output format; give a directory (one "
            f"file per data object), FILE.arrow ({', '.join(ARROW_SUFFIXES)}) or "
            f"FILE.parquet ({', '.join(PARQUET_SUFFIXES)}); for text, redirect stdout "
            "(--json for one JSON object per record)"
        )
    return DirSink(path)
