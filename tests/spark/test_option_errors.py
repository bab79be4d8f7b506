"""Spark option errors a newcomer can act on: the nearest valid name, the valid names
once each (no alias list), the valid values.  Pure parsing: no SparkSession."""

from __future__ import annotations

import pytest

from tieredbuf.errors import ConfigError
from tieredbuf.spark.options import READ_OPTIONS, WRITE_OPTIONS, check_known, parse_bound


@pytest.mark.parametrize(
    ("typo", "meant", "known", "what"),
    [
        ("startingOffset", "startingOffsets", READ_OPTIONS, "read"),
        ("startingoffset", "startingOffsets", READ_OPTIONS, "read"),  # Spark lower-cases keys
        ("failOnDataLost", "failOnDataLoss", READ_OPTIONS, "read"),
        ("endpont", "endpoint", READ_OPTIONS, "read"),
        ("producerID_", "producerId", WRITE_OPTIONS, "write"),
    ],
)
def test_an_unknown_option_names_the_nearest_valid_one(
    typo: str, meant: str, known: frozenset[str], what: str
) -> None:
    with pytest.raises(ConfigError) as e:
        check_known({typo: "x"}, known, what)
    text = str(e.value)
    assert f"unknown tieredbuf {what} option {typo!r} (did you mean {meant}?)" in text
    assert "access_key_id" not in text and "accesskeyid" not in text  # no alias dump
    assert text.count("accessKeyId") == 1


def test_a_far_typo_gets_the_list_but_no_guess() -> None:
    with pytest.raises(ConfigError) as e:
        check_known({"zzz": "1"}, READ_OPTIONS, "read")
    assert "did you mean" not in str(e.value) and "startingOffsets" in str(e.value)


def test_a_bad_offset_value_lists_the_valid_values() -> None:
    with pytest.raises(ConfigError) as e:
        parse_bound("startingOffsets", "earlist")
    assert str(e.value) == (
        "option startingOffsets must be earliest, latest, a sequence "
        "number or {\"sequence\": n}, got 'earlist' (did you mean earliest?)"
    )
