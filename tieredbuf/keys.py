"""Every object key and local file name tieredbuf uses, built in one place.

Keys are relative to the buffer URL (the store is rooted there)::

    data/<ULID>.batch                       opaque records (RFC 0001 data batch)
    data/<ULID>.qseg                        Arrow bundles (Quiver segment)
    queue/manifest                          the root, the only object ever overwritten (by CAS)
    queue/groups/<first_seq:020>.<ULID>.<kind>   immutable manifest tree nodes
    queue/subscribers/<name>.<reg ULID>     a named subscriber's progress (CAS by that subscriber)
    queue/pending/<hub id>.<n>.<form>       an announcement (fan-in): a hub's n-th
    _probe/<ULID>                           conditional-write probe objects (deleted at once)
"""

from __future__ import annotations

import re

from ulid import ULID

DATA_PREFIX = "data/"
QUEUE_PREFIX = "queue/"
MANIFEST_KEY = "queue/manifest"
GROUPS_PREFIX = "queue/groups/"
SUBSCRIBERS_PREFIX = "queue/subscribers/"
PENDING_PREFIX = "queue/pending/"
PROBE_PREFIX = "_probe/"

BATCH_SUFFIX = ".batch"
SEGMENT_SUFFIX = ".qseg"
DATA_SUFFIXES = (BATCH_SUFFIX, SEGMENT_SUFFIX)
GROUP_KINDS = ("group", "kgroup", "mgroup")
STREAMS = ("batch", "qseg")
"""A stage's two ordered flows, records and bundles; each appends to the queue as a writer
of its own, ``<stage producer id>.<stream>`` (:func:`stream_producer_id`)."""


def stream_producer_id(producer_id: str, stream: str) -> str:
    """The writer id (watermark key) a stage's ``stream`` appends under."""
    return f"{producer_id}.{stream}"


# Key patterns take the whole key (fullmatch: ``$`` also matches before a final newline)
# and ASCII digits only (``\d`` takes any Unicode digit, and int() reads them): a key
# they accept is exactly one tieredbuf writes.  GC deletes by them.
_ULID_RE = r"[0-9A-HJKMNP-TV-Z]{26}"
_DATA_RE = re.compile(rf"data/({_ULID_RE})\.(batch|qseg)")
_GROUP_RE = re.compile(rf"queue/groups/(\d{{20}})\.({_ULID_RE})\.(group|kgroup|mgroup)", re.ASCII)
_PROGRESS_RE = re.compile(rf"queue/subscribers/([A-Za-z0-9_-]{{1,64}})\.({_ULID_RE})")


def data_key(ulid: ULID, suffix: str = BATCH_SUFFIX) -> str:
    """Key of a data object named by ``ulid``."""
    if suffix not in DATA_SUFFIXES:
        raise ValueError(f"unknown data suffix {suffix!r}")
    return f"{DATA_PREFIX}{ulid}{suffix}"


def parse_data_key(key: str) -> ULID | None:
    """The ULID of a data object key, or None when ``key`` is not one (GC skips those)."""
    m = _DATA_RE.fullmatch(key)
    if m is None:
        return None
    try:
        return ULID.from_str(m.group(1))
    except ValueError:
        return None


def group_key(first_seq: int, ulid: ULID, kind: str) -> str:
    """Key of an immutable manifest tree node."""
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group kind {kind!r}")
    return f"{GROUPS_PREFIX}{first_seq:020d}.{ulid}.{kind}"


def parse_group_key(key: str) -> tuple[int, ULID, str] | None:
    """(first_seq, ulid, kind) of a group key, or None."""
    m = _GROUP_RE.fullmatch(key)
    if m is None:
        return None
    try:
        return int(m.group(1)), ULID.from_str(m.group(2)), m.group(3)
    except ValueError:
        return None


def progress_key(name: str, reg: ULID) -> str:
    """Key of a named subscriber's progress object (one per registration)."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ValueError(f"bad subscriber name {name!r}")
    return f"{SUBSCRIBERS_PREFIX}{name}.{reg}"


def parse_progress_key(key: str) -> tuple[str, ULID] | None:
    """(name, registration ULID) of a progress key, or None (GC leaves those alone)."""
    m = _PROGRESS_RE.fullmatch(key)
    if m is None:
        return None
    try:
        return m.group(1), ULID.from_str(m.group(2))
    except ValueError:
        return None


_SAFE_ID_RE = r"[A-Za-z0-9_.:-]{1,200}"
_PENDING_RE = re.compile(r"queue/pending/(~?[A-Za-z0-9_.:-]{1,510})\.(\d{20})", re.ASCII)
_PENDING_FORM_RE = re.compile(
    r"queue/pending/([A-Za-z0-9_:-]{1,200})\.([1-9]\d{0,19})\."
    r"(b|i[A-Za-z0-9_.:-]{1,250})",
    re.ASCII,
)


def pending_key(announcer: str, n: int, spelled: str = "") -> str:
    """Key of a commit hub's ``n``-th announcement: ``<announcer>.<n>.<form>``, its
    form the announcement spelled out (format/spelled.py ``key_form``) or ``b`` (read
    the body).  The form makes the key one an older tieredbuf's reader never matches:
    it commits none of this hub's announcements, rather than some (it would hold back
    none behind a damaged one).  The announcer (a hub's ``h-<ULID>``) has no dot."""
    if not 0 < n < 10**20:
        raise ValueError(f"announcement number {n} out of range")
    key = f"{PENDING_PREFIX}{announcer}.{n}.{spelled or 'b'}"
    if (
        _PENDING_FORM_RE.fullmatch(key) is None
        or _PENDING_RE.fullmatch(key) is not None  # an older reader would read it
        or len(key) - len(PENDING_PREFIX) > 255
    ):
        raise ValueError(f"{announcer!r} and {spelled!r} cannot name an announcement")
    return key


def pending_room(announcer: str, n: int) -> int:
    """How long the form of ``pending_key(announcer, n, form)`` may be: the key's last
    part within 255 bytes, a local file system's longest name."""
    return 255 - len(f"{announcer}.{n}.")


def legacy_pending_key(announcer: str, n: int) -> str:
    """``<announcer id>.<n:020>``: the key tieredbuf gave an announcement before the key
    form (version 1 named a writer and its first producer seq); still read.  An
    announcer id outside ``[A-Za-z0-9_.:-]`` (at most 200 characters) was written as
    ``~`` and its UTF-8 in hex."""
    if not 0 < n < 10**20:
        raise ValueError(f"announcement number {n} out of range")
    name = (
        announcer
        if re.fullmatch(_SAFE_ID_RE, announcer)
        else ("~" + announcer.encode("utf-8").hex())
    )
    if not announcer or len(name) > 511:
        raise ValueError(f"announcer id {announcer!r} cannot name an announcement")
    return f"{PENDING_PREFIX}{name}.{n:020d}"


def parse_pending_key(key: str) -> tuple[str, int] | None:
    """(announcer id, n) of an announcement key (either layout), or None.  The older
    layout is tried first: ``pending_key`` never makes a key it matches, while an older
    key whose producer id looks like ``<x>.<digits>.i...`` also matches the newer one."""
    m = _PENDING_RE.fullmatch(key)
    if m is None:
        if (m := _PENDING_FORM_RE.fullmatch(key)) is not None:
            return m.group(1), int(m.group(2))
        return None
    name = m.group(1)
    if name.startswith("~"):
        try:
            name = bytes.fromhex(name[1:]).decode("utf-8")
        except ValueError:
            return None
    return name, int(m.group(2))


def pending_key_form(key: str) -> str | None:
    """The announcement an announcement key spells out (``pending_key``), or None."""
    m = None if _PENDING_RE.fullmatch(key) else _PENDING_FORM_RE.fullmatch(key)
    return None if m is None or m.group(3) == "b" else m.group(3)


def probe_key(ulid: ULID) -> str:
    return f"{PROBE_PREFIX}{ulid}"


# --- what a store keeps beside a data object --------------------------------------

CHECKSUM_METADATA = "tieredbuf_crc32"
"""The name of a data object's CRC32 in its store's metadata: S3 user metadata
(``x-amz-meta-tieredbuf_crc32``), Azure blob metadata (``x-ms-meta-tieredbuf_crc32``: a
C# identifier, hence the underscore), obstore attributes (docs/format.md, "Checksums")."""
CHECKSUM_XATTR = "user.tieredbuf.crc32"
"""The same, as a local directory store's extended attribute of the object's file (and of
the local tier's sealed ``.batch`` segment it is a hard link of)."""


def format_crc32(crc32: int) -> str:
    """A checksum's text in the metadata: 8 lowercase hex digits."""
    return f"{crc32 & 0xFFFF_FFFF:08x}"


def parse_crc32(text: str | bytes | None) -> int | None:
    """A checksum read back from the metadata; None when absent or not one tieredbuf
    wrote (not a failure: the object then carries none)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    if text is None or len(text) != 8:
        return None
    try:
        return int(text, 16)
    except ValueError:
        return None


# --- what kind of object a key names (request accounting) --------------------

KIND_DATA = "data"
KIND_ROOT = "root"
KIND_GROUP = "group"
KIND_SUBSCRIBER = "subscriber"
KIND_PENDING = "announcement"
KIND_PROBE = "probe"
KIND_OTHER = "other"
KINDS = (KIND_DATA, KIND_ROOT, KIND_GROUP, KIND_SUBSCRIBER, KIND_PENDING, KIND_PROBE, KIND_OTHER)
"""Every value :func:`key_kind` returns."""


def key_kind(key: str) -> str:
    """The kind of object ``key`` (or a list prefix) names: ``data`` (data objects),
    ``root`` (the queue manifest), ``group`` (tree nodes), ``subscriber`` (a named
    subscriber's state), ``announcement`` (a writer's pending appends), ``probe``
    (conditional-write probes) or ``other``.

    Decided by prefix only (cheap: it runs on every store request), so a list of
    ``data/`` is a data request and a foreign key under ``data/`` still counts as data.
    """
    if key.startswith(DATA_PREFIX):
        return KIND_DATA
    if key.startswith(QUEUE_PREFIX):
        if key == MANIFEST_KEY:
            return KIND_ROOT
        if key.startswith(GROUPS_PREFIX):
            return KIND_GROUP
        if key.startswith(SUBSCRIBERS_PREFIX):
            return KIND_SUBSCRIBER
        if key.startswith(PENDING_PREFIX):
            return KIND_PENDING
        return KIND_OTHER
    if key.startswith(PROBE_PREFIX):
        return KIND_PROBE
    return KIND_OTHER


# --- local stage file names (used by stage/) --------------------------------

STAGE_LOCK_NAME = "stage.lock"
STAGE_ID_NAME = "producer.id"
STAGE_BUFFER_NAME = "buffer.json"
"""Which buffer a producer stage belongs to (tieredbuf/produce/stage_binding.py)."""
WAL_DIR_NAME = "wal"
SEGMENTS_DIR_NAME = "segments"
