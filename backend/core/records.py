"""Table keys and change records: the two byte layouts of keyed state.

Table key (LMDB): ``key_group:u16be | key_len:u16be | key [| user_key]``. The key group comes first
so that one key group is one contiguous key range (cheap per-key-group snapshots, scans and
deletes); the length prefix makes the map entries of one key an exact prefix range. The first
four bytes of a table key are called its *context key prefix*; ``ckey`` = prefix + key identifies
(key group, key) and is what the state wrappers cache by.

Change record (one DSTL payload, tagged with its key group by the writer)::

    op:u8 | state_id:u32be | ckey | rest

(``ckey`` delimits itself: its bytes 2-3 are the key's length.)

``rest`` depends on the op: SET carries the stored value, ADD carries encoded list elements to
append, PUT carries ``user_key_len:u16be | user_key | value``, REMOVE carries the user key, CLEAR
and the timer ops carry nothing (a timer's domain and timestamp are its "user key"). The stored
value of a state with TTL starts with its expiry time (``expiry_ms:u64be``; 0 = never).

State ids are ``crc32(state name)``: the same name gets the same id in every subtask, so records
of any old subtask can be replayed into any new one without an id mapping.
"""

from __future__ import annotations

import io
import struct
import sys
import zlib
from array import array
from collections.abc import Iterator
from enum import IntEnum

from backend.core.errors import SerializationError

_U16 = struct.Struct(">H")
_HEAD = struct.Struct(">BI")
_U32 = struct.Struct(">I")
_EXPIRY = struct.Struct(">Q")
_TIMER = struct.Struct(">BQ")
MAX_KEY_BYTES = 0xFFFF


class Op(IntEnum):
    SET = 1  # value / whole list / aggregate / whole map entry value
    CLEAR = 2  # the key's state (all map entries of the key)
    ADD = 3  # append list elements
    PUT = 4  # map entry
    REMOVE = 5  # map entry
    TIMER_ADD = 6
    TIMER_DELETE = 7
    SET_BATCH = 8  # many SETs of one state and key group in one record (see encode_set_batch)


def state_id(name: str) -> int:
    return zlib.crc32(name.encode())


CKEY_HEAD = struct.Struct(">HH")


def ckey(key_group: int, key: bytes) -> bytes:
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"serialized key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
    return CKEY_HEAD.pack(key_group, len(key)) + key


def key_group_of(ckey_bytes: bytes) -> int:
    return (ckey_bytes[0] << 8) | ckey_bytes[1]


def key_of(ckey_bytes: bytes) -> bytes:
    return ckey_bytes[4:]


def record(op: Op, sid: int, ck: bytes, rest: bytes = b"") -> bytes:
    return _HEAD.pack(op, sid) + ck + rest


def record_prefix(op: Op, sid: int) -> bytes:
    """The constant head of every record of ``op`` on state ``sid``: prefix + ckey + rest is a record."""
    return _HEAD.pack(op, sid)


def put_rest(user_key: bytes, value: bytes) -> bytes:
    return _U16.pack(len(user_key)) + user_key + value


def timer_user_key(domain: int, timestamp: int) -> bytes:
    """Timers sort by (domain, time) inside a key's prefix."""
    return _TIMER.pack(domain, timestamp)


def parse_timer_user_key(user_key: bytes) -> tuple[int, int]:
    domain, timestamp = _TIMER.unpack(user_key)
    return domain, timestamp


def encode_set_batch(sid: int, entries: list[bytes]) -> bytes:
    """One record for the SETs of many keys of one key group: ``[ckey, stored, ckey, stored, ...]``.

    Layout: ``op | state_id | count:u32 | length:u32[2 * count] | (ckey | stored)*count``, the
    lengths of every ckey and stored value in order. A checkpoint of a value state logs one such
    record per key group instead of one per key, and both encoding and decoding are C-level
    passes (array of lengths, join; split with ``BytesIO.read``) rather than a Python step per key.
    """
    lengths = array("I", map(len, entries))
    if sys.byteorder == "big":  # pragma: no cover
        lengths.byteswap()
    count = len(entries) // 2
    return b"".join((_HEAD.pack(Op.SET_BATCH, sid), _U32.pack(count), lengths.tobytes(), *entries))


def split_set_batch(rest: bytes) -> list[tuple[bytes, bytes]]:
    """The (ckey, stored) pairs of a SET_BATCH record's body (what follows op and state id)."""
    try:
        (count,) = _U32.unpack_from(rest)
        lengths = array("I")
        lengths.frombytes(rest[4 : 4 + 8 * count])
        if sys.byteorder == "big":  # pragma: no cover
            lengths.byteswap()
        body_start = 4 + 8 * count
        if len(lengths) != 2 * count or body_start + sum(lengths) != len(rest):
            raise ValueError("lengths do not add up to the record")
        if count and min(lengths[0::2]) < 4:
            raise ValueError("key shorter than its key-group and length prefix")
    except (struct.error, ValueError) as exc:
        raise SerializationError("change-record", f"malformed SET_BATCH: {exc}") from None
    read = io.BytesIO(rest[body_start:]).read
    parts = iter(list(map(read, lengths)))
    return list(zip(parts, parts, strict=True))


def parse_record(data: bytes) -> tuple[Op, int, bytes, bytes]:
    """(op, state id, ckey, rest) of a change record; malformed records raise SerializationError."""
    try:
        op, sid = _HEAD.unpack_from(data)
        if op == Op.SET_BATCH:
            return Op.SET_BATCH, sid, b"", data[_HEAD.size :]
        (key_len,) = _U16.unpack_from(data, _HEAD.size + 2)
        end = _HEAD.size + 4 + key_len
        if end > len(data):
            raise ValueError("key longer than the record")
        return Op(op), sid, data[_HEAD.size : end], data[end:]
    except (struct.error, ValueError) as exc:
        raise SerializationError("change-record", f"malformed: {exc}") from None


def split_put(rest: bytes) -> tuple[bytes, bytes]:
    try:
        (ulen,) = _U16.unpack_from(rest)
    except struct.error:
        raise SerializationError("change-record", "malformed map entry") from None
    if 2 + ulen > len(rest):
        raise SerializationError("change-record", "map entry user key longer than the record")
    return rest[2 : 2 + ulen], rest[2 + ulen :]


# -- stored values with TTL ---------------------------------------------------------------


def with_expiry(expiry_ms: int, value: bytes) -> bytes:
    return _EXPIRY.pack(expiry_ms) + value


def split_expiry(stored: bytes) -> tuple[int, bytes]:
    if len(stored) < 8:
        raise SerializationError("ttl-value", "shorter than its expiry time")
    return _EXPIRY.unpack_from(stored)[0], stored[8:]


# -- list blobs: count:u32 then (len:u32, element) per element ----------------------------


def encode_list(elements: list[bytes]) -> bytes:
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
