"""Byte layouts of change records and list values (backend.core.records)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.core import records as rec
from backend.core.errors import SerializationError
from backend.core.tablekeys import ckey

elements = st.lists(st.binary(max_size=20), max_size=20)


@given(elements, elements)
def test_appending_to_a_stored_list_equals_re_encoding_it(old: list[bytes], added: list[bytes]) -> None:
    joined = rec.concat_lists(rec.encode_list(old), rec.encode_list(added))
    assert joined == rec.encode_list(old + added)
    assert rec.decode_list(joined) == old + added
    assert rec.concat_lists(None, rec.encode_list(added)) == rec.encode_list(added)


@given(st.lists(st.tuples(st.integers(0, 127), st.binary(max_size=12), st.binary(max_size=30)), max_size=30))
def test_set_batch_records_split_back_into_their_entries(entries: list[tuple[int, bytes, bytes]]) -> None:
    pairs = [(ckey(kg, key), stored) for kg, key, stored in entries]
    op, sid, _, rest = rec.parse_record(rec.encode_set_batch(7, [k for k, _ in pairs], [v for _, v in pairs]))
    assert (op, sid) == (rec.Op.SET_BATCH, 7)
    assert rec.split_set_batch(rest) == pairs


def test_a_set_batch_of_more_keys_than_values_is_refused() -> None:
    with pytest.raises(ValueError, match="2 keys and 1 values"):
        rec.encode_set_batch(7, [ckey(3, b"a"), ckey(3, b"b")], [b"x"])


@pytest.mark.parametrize("cut", [1, 5, 9])
def test_a_truncated_set_batch_is_a_named_error(cut: int) -> None:
    record = rec.encode_set_batch(7, [ckey(3, b"key")], [b"value"])
    _, _, _, rest = rec.parse_record(record)
    with pytest.raises(SerializationError, match="SET_BATCH"):
        rec.split_set_batch(rest[:-cut])


@given(st.lists(st.tuples(st.integers(0, 127), st.binary(max_size=12), st.integers(-(2**63), 2**63 - 1))))
def test_set_column_records_split_back_into_their_entries(entries: list[tuple[int, bytes, int]]) -> None:
    keys = [ckey(kg, key) for kg, key, _ in entries]
    values = [v.to_bytes(8, "big", signed=True) for _, _, v in entries]
    op, sid, ck, rest = rec.parse_record(rec.encode_set_column(7, keys, b"".join(values), 8))
    assert (op, sid, ck) == (rec.Op.SET_COLUMN, 7, b"")
    assert rec.split_batch(op, rest) == list(zip(keys, values, strict=True))


@pytest.mark.parametrize("value_size", [0, 1, 8])
@pytest.mark.parametrize("count", [1, 5000])
def test_set_column_records_of_keys_of_one_length_split_back(value_size: int, count: int) -> None:
    """Keys of one length are cut thousands at a time (``entries.cut``), values of no bytes too."""
    keys = [ckey(i % 128, i.to_bytes(4, "big")) for i in range(count)]
    values = [(i % 256).to_bytes(1, "big") * value_size for i in range(count)]
    op, _, _, rest = rec.parse_record(rec.encode_set_column(7, keys, b"".join(values), value_size))
    assert rec.split_batch(op, rest) == list(zip(keys, values, strict=True))


def test_a_column_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="7 bytes of values are not 1 x 8"):
        rec.encode_set_column(7, [ckey(3, b"a")], b"1234567", 8)


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda rest: rest[:-1], "do not add up"),
        (lambda rest: rest + b"x", "do not add up"),
        (lambda rest: rest[:6], "requires a buffer of at least 8 bytes"),
        (lambda rest: b"\xff\xff\xff\xff" + rest[4:], "do not add up"),  # a count far too large
        # the same total, cut elsewhere: a first key of 1 byte
        (lambda rest: rest[:8] + b"\x01\x00\x00\x00\x0f\x00\x00\x00" + rest[16:], "shorter than its key-group"),
    ],
    ids=["truncated", "trailing byte", "cut in the head", "count", "key length"],
)
def test_a_damaged_set_column_is_a_named_error(damage: object, why: str) -> None:
    keys = [ckey(3, b"key"), ckey(3, b"other")]
    _, _, _, rest = rec.parse_record(rec.encode_set_column(7, keys, b"12345678abcdefgh", 8))
    with pytest.raises(SerializationError, match=f"malformed SET_COLUMN: .*{why}"):
        rec.split_batch(rec.Op.SET_COLUMN, damage(rest))  # type: ignore[operator]
