"""What every decoder fuzz test asserts (invariant I7).

For generated values ``x``: ``decode(encode(x)) == x``.  For damaged bytes (a cut, a
flipped bit): the decoder either raises :class:`CorruptError` naming the object and an
offset inside the input (``0 <= offset <= len``; ``len`` names the end), or returns a
value the encoder could have written -- checked by encoding it again: the same bytes
where a format has one encoding per value, the same value where it has several.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tieredbuf.errors import CorruptError

T = TypeVar("T")

FUZZ = settings(
    max_examples=int(os.environ.get("TIEREDBUF_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
"""300 examples per property; ``TIEREDBUF_FUZZ_EXAMPLES=20000`` for a deeper run."""

cuts = st.integers(min_value=0, max_value=1 << 16)
flips = st.integers(min_value=0, max_value=1 << 16)
bits = st.integers(min_value=0, max_value=7)


def damage(data: bytes, cut: int, flip: int, bit: int, *, keep_length: bool = False) -> bytes:
    """``data`` cut to ``cut % (len + 1)`` bytes (unless ``keep_length``), then one bit of
    byte ``flip % len`` flipped."""
    out = bytearray(data if keep_length else data[: cut % (len(data) + 1)])
    if out:
        out[flip % len(out)] ^= 1 << bit
    return bytes(out)


def decoded_or_named(decode: Callable[[bytes], T], data: bytes, obj: str) -> T | None:
    """``decode(data)``, or None after checking its CorruptError names ``obj`` and an
    offset inside ``data``.  Any other exception fails the test."""
    try:
        return decode(data)
    except CorruptError as e:
        assert e.obj == obj, e
        assert 0 <= e.offset <= len(data), f"offset {e.offset} outside {len(data)} bytes: {e}"
        return None


def canonical(
    decode: Callable[[bytes], T], encode: Callable[[T], bytes], data: bytes, obj: str
) -> T | None:
    """Damaged ``data`` of a one-encoding-per-value format: a CorruptError inside the
    input, or a value that encodes back to exactly ``data``."""
    got = decoded_or_named(decode, data, obj)
    if got is not None:
        assert encode(got) == data, f"decoded {got!r}, which encodes differently"
    return got
