"""Change records: the bytes of one logged state change, and the stored forms of TTL values and lists.

Change record (one DSTL payload, tagged with its key group by the writer)::

    op:u8 | state_id:u32be | ckey | rest

(``ckey`` is the table-key head of ``backend.core.tablekeys``; it delimits itself: its bytes 2-3
are the key's length.)

``rest`` depends on the op: SET carries the stored value, ADD carries encoded list elements to
append, PUT carries ``user_key_len:u16be | user_key | value``, REMOVE carries the user key, CLEAR
and the timer ops carry nothing (a timer's domain and timestamp are its "user key"). SET_BATCH
and SET_COLUMN set many keys of one key group and have no ckey of their own: ``op | state_id |
body`` (``encode_set_batch``, ``encode_set_column``). The stored value of a state with TTL starts
with its expiry time (``expiry_ms:u64be``; 0 = never).

State ids are ``crc32(state name)``: the same name gets the same id in every subtask, so records
of any old subtask can be replayed into any new one without an id mapping.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from collections.abc import Iterator
from enum import IntEnum
from itertools import repeat

from backend.core.entries import Entries, cut
from backend.core.errors import SerializationError
from backend.core.tablekeys import CKEY_HEAD, CKEY_HEAD_BYTES

__all__ = [
    "BATCH_OPS",
    "Op",
    "concat_lists",
    "decode_list",
    "encode_list",
    "encode_set_batch",
    "encode_set_column",
    "parse_record",
    "put_rest",
    "record",
    "record_prefix",
    "split_batch",
    "split_expiry",
    "split_put",
    "split_set_batch",
    "state_id",
    "with_expiry",
]

_U16 = struct.Struct(">H")
_HEAD = struct.Struct(">BI")
_U32 = struct.Struct(">I")
_U32_PAIR = struct.Struct(">II")
_U32_LE = struct.Struct("<I")
_EXPIRY = struct.Struct(">Q")


class Op(IntEnum):
    """The kind of change a record carries (its first byte)."""

    SET = 1  # value / whole list / aggregate / whole map entry value
    CLEAR = 2  # the key's state (all map entries of the key)
    ADD = 3  # append list elements
    PUT = 4  # map entry
    REMOVE = 5  # map entry
    TIMER_ADD = 6
    TIMER_DELETE = 7
    SET_BATCH = 8  # many SETs of one state and key group in one record (see encode_set_batch)
    SET_COLUMN = 9  # the same, the stored values all of one width (see encode_set_column)


def state_id(name: str) -> int:
    """The id of a state in change records: ``crc32`` of its name, the same in every subtask."""
    return zlib.crc32(name.encode())


def record(op: Op, sid: int, ck: bytes, rest: bytes = b"") -> bytes:
    """One change record."""
    return _HEAD.pack(op, sid) + ck + rest


def record_prefix(op: Op, sid: int) -> bytes:
    """The constant head of every record of ``op`` on state ``sid``: prefix + ckey + rest is a record."""
    return _HEAD.pack(op, sid)


def put_rest(user_key: bytes, value: bytes) -> bytes:
    """The body of a PUT record: the user key, length-prefixed, then the stored value."""
    return _U16.pack(len(user_key)) + user_key + value


def _u32le(values: list[int]) -> bytes:
    """``values`` as little-endian u32s (array's constructor from a list, not an iterator: it
    extends from an iterator item by item)."""
    lengths = array("I", values)
    if sys.byteorder == "big":  # pragma: no cover
        lengths.byteswap()
    return lengths.tobytes()


def _read_u32le(rest: bytes, start: int, n: int) -> array[int]:
    """``n`` little-endian u32s of ``rest`` from ``start`` (ValueError if it is shorter)."""
    lengths = array("I")
    lengths.frombytes(rest[start : start + 4 * n])
    if len(lengths) != n:
        raise ValueError("lengths do not add up to the record")
    if sys.byteorder == "big":  # pragma: no cover
        lengths.byteswap()
    return lengths


def encode_set_batch(sid: int, ckeys: list[bytes], stored: list[bytes]) -> bytes:
    """One record for the SETs of many keys of one key group: ``ckeys[i]`` is set to ``stored[i]``.

    Layout: ``op | state_id | count:u32be | length:u32le[2 * count] | (ckey | stored)*count``,
    the lengths of every ckey and stored value in order. A checkpoint of a value state logs one
    such record per key group instead of one per key, and both encoding and decoding are C-level
    passes (arrays of lengths, join; split with ``BytesIO.read``) rather than a Python step per key.
    """
    count = len(ckeys)
    if len(stored) != count:
        raise ValueError(f"SET_BATCH of {count} keys and {len(stored)} values")
    entries: list[bytes] = [b""] * (2 * count)
    entries[0::2] = ckeys
    entries[1::2] = stored
    lengths = array("I", bytes(8 * count))
    lengths[0::2] = array("I", list(map(len, ckeys)))  # from lists: see _u32le
    lengths[1::2] = array("I", list(map(len, stored)))
    if sys.byteorder == "big":  # pragma: no cover
        lengths.byteswap()
    return b"".join((_HEAD.pack(Op.SET_BATCH, sid), _U32.pack(count), lengths.tobytes(), b"".join(entries)))


def split_set_batch(rest: bytes) -> Entries:
    """The (ckey, stored) pairs of a SET_BATCH record's body (what follows op and state id)."""
    try:
        (count,) = _U32.unpack_from(rest)
        lengths = _read_u32le(rest, 4, 2 * count)
        body_start = 4 + 8 * count
        if body_start + sum(lengths) != len(rest):
            raise ValueError("lengths do not add up to the record")
        if count and min(lengths[0::2]) < CKEY_HEAD_BYTES:
            raise ValueError("key shorter than its key-group and length prefix")
    except (struct.error, ValueError) as exc:
        raise SerializationError("change-record", f"malformed SET_BATCH: {exc}") from None
    parts = cut(rest, 2 * count, 0, lengths, body_start)
    return Entries(parts[0::2], parts[1::2])


def encode_set_column(sid: int, ckeys: list[bytes], column: bytes, value_size: int) -> bytes:
    """One record for the SETs of many keys of one key group whose stored values all have
    ``value_size`` bytes: ``column`` is the values back to back, in the keys' order.

    Layout: ``op | state_id | count:u32be | value_size:u32be | key_length:u32le[count] |
    ckey*count | column``. A serializer of fixed width packs a key group's values into the column
    in one C-level pass (``serialize_column``: no bytes object per value), where ``SET_BATCH``
    interleaves a key's stored value with its key.
    """
    count = len(ckeys)
    if len(column) != count * value_size:
        raise ValueError(f"SET_COLUMN of {count} keys: {len(column)} bytes of values are not {count} x {value_size}")
    head = _HEAD.pack(Op.SET_COLUMN, sid) + _U32_PAIR.pack(count, value_size)
    return b"".join((head, _u32le(list(map(len, ckeys))), b"".join(ckeys), column))


def split_set_column(rest: bytes) -> Entries:
    """The (ckey, stored) pairs of a SET_COLUMN record's body (what follows op and state id)."""
    try:
        count, size = _U32_PAIR.unpack_from(rest)
        lengths = _read_u32le(rest, 8, count)
        keys_start = 8 + 4 * count
        first = rest[8:12]
        width = _U32_LE.unpack(first)[0] if count and rest[8:keys_start] == first * count else 0
        keys_end = keys_start + (width * count if width else sum(lengths))
        if keys_end + count * size != len(rest):
            raise ValueError("lengths do not add up to the record")
        if count and (width or min(lengths)) < CKEY_HEAD_BYTES:
            raise ValueError("key shorter than its key-group and length prefix")
    except (struct.error, ValueError) as exc:
        raise SerializationError("change-record", f"malformed SET_COLUMN: {exc}") from None
    return Entries(cut(rest, count, width, lengths, keys_start), cut(rest, count, size, repeat(size, count), keys_end))


#: the ops that set many keys of one key group and have no ckey of their own
BATCH_OPS = frozenset({Op.SET_BATCH, Op.SET_COLUMN})


def split_batch(op: Op, rest: bytes) -> Entries:
    """The (ckey, stored) pairs of a SET_BATCH or SET_COLUMN record's body."""
    if op is Op.SET_BATCH:
        return split_set_batch(rest)
    if op is Op.SET_COLUMN:
        return split_set_column(rest)
    raise ValueError(f"{op!r} is not an op of many keys")


def parse_record(data: bytes) -> tuple[Op, int, bytes, bytes]:
    """(op, state id, ckey, rest) of a change record; malformed records raise SerializationError."""
    try:
        op, sid = _HEAD.unpack_from(data)
        if op in BATCH_OPS:  # many keys: no ckey of their own
            return Op(op), sid, b"", data[_HEAD.size :]
        _, key_len = CKEY_HEAD.unpack_from(data, _HEAD.size)
        end = _HEAD.size + CKEY_HEAD_BYTES + key_len
        if end > len(data):
            raise ValueError("key longer than the record")
        return Op(op), sid, data[_HEAD.size : end], data[end:]
    except (struct.error, ValueError) as exc:
        raise SerializationError("change-record", f"malformed: {exc}") from None


def split_put(rest: bytes) -> tuple[bytes, bytes]:
    """``(user_key, stored value)`` of a PUT record's body."""
    try:
        (ulen,) = _U16.unpack_from(rest)
    except struct.error:
        raise SerializationError("change-record", "malformed map entry") from None
    if 2 + ulen > len(rest):
        raise SerializationError("change-record", "map entry user key longer than the record")
    return rest[2 : 2 + ulen], rest[2 + ulen :]


# -- stored values with TTL ---------------------------------------------------------------


def with_expiry(expiry_ms: int, value: bytes) -> bytes:
    """The stored form of a value with TTL: its expiry time first."""
    return _EXPIRY.pack(expiry_ms) + value


def split_expiry(stored: bytes) -> tuple[int, bytes]:
    """``(expiry_ms, value)`` of a stored value with TTL."""
    if len(stored) < 8:
        raise SerializationError("ttl-value", "shorter than its expiry time")
    return _EXPIRY.unpack_from(stored)[0], stored[8:]


# -- list blobs: count:u32 then (len:u32, element) per element ----------------------------


def encode_list(elements: list[bytes]) -> bytes:
    """The stored form of a list state's value (and the body of an ADD record)."""
    parts = [_U32.pack(len(elements))]
    for e in elements:
        parts.append(_U32.pack(len(e)))
        parts.append(e)
    return b"".join(parts)


def concat_lists(blob: bytes | None, added: bytes) -> bytes:
    """``encode_list(decode_list(blob) + decode_list(added))`` without touching the elements:
    appending to a long list (replay of ADD records, a flush of appends) copies bytes once
    instead of decoding and re-encoding every element already stored."""
    if blob is None:
        return added
    try:
        (old,) = _U32.unpack_from(blob)
        (new,) = _U32.unpack_from(added)
    except struct.error:
        raise SerializationError("list-value", "malformed") from None
    return b"".join((_U32.pack(old + new), memoryview(blob)[4:], memoryview(added)[4:]))


def decode_list(blob: bytes) -> list[bytes]:
    """The elements of an ``encode_list`` blob; malformed framing raises ``SerializationError``."""
    try:
        return list(_iter_list(blob))
    except struct.error:
        raise SerializationError("list-value", "malformed") from None


def _iter_list(blob: bytes) -> Iterator[bytes]:
    (count,) = _U32.unpack_from(blob)
    pos = 4
    for _ in range(count):
        (n,) = _U32.unpack_from(blob, pos)
        pos += 4
        if pos + n > len(blob):
            raise SerializationError("list-value", "element longer than the blob")
        yield blob[pos : pos + n]
        pos += n
    if pos != len(blob):
        raise SerializationError("list-value", "trailing bytes")
