from ulid import ULID

from tieredbuf import keys


def test_data_key_round_trips_and_rejects_foreign_names() -> None:
    u = ULID()
    k = keys.data_key(u)
    assert k == f"data/{u}.batch"
    assert keys.parse_data_key(k) == u
    assert keys.parse_data_key(keys.data_key(u, ".qseg")) == u
    assert keys.parse_data_key("data/notaulid.batch") is None
    assert keys.parse_data_key(f"data/{u}.tmp") is None
    assert keys.parse_data_key(f"other/{u}.batch") is None


def test_group_key_sorts_by_first_sequence() -> None:
    a = keys.group_key(5, ULID(), "group")
    b = keys.group_key(40, ULID(), "kgroup")
    assert a < b
    parsed = keys.parse_group_key(b)
    assert parsed is not None and parsed[0] == 40 and parsed[2] == "kgroup"
