"""The layout of an LMDB table key, defined once for the state tables, the materializer and the tools.

A table key is ``key_group:u16be | key_len:u16be | key [| user_key]``. The key group comes first so
that one key group (and one range of them) is one contiguous key range: per-key-group snapshots,
scans and deletes are cursor ranges, not filters. The length prefix makes the entries of one key
(a map's user keys, a key's timers) an exact prefix range. ``ckey`` (context key) = the first four
bytes + the key: it names (key group, key), starts every table key of that key, and is what the
write-back caches are keyed by. A timer's user key is ``domain:u8 | timestamp_ms:u64be``, so a
key's timers sort by domain, then time.

Everything that reads or writes these bytes goes through this module; the hot paths that inline
a piece of it (``set_current_key``, the value-state cache lookup) say so where they do.
"""

from __future__ import annotations

import struct

__all__ = [
    "CKEY_HEAD",
    "CKEY_HEAD_BYTES",
    "KEY_GROUP_PREFIX_BYTES",
    "MAX_KEY_BYTES",
    "ckey",
    "key_group_of",
    "key_group_prefix",
    "key_of",
    "parse_timer_user_key",
    "split_table_key",
    "timer_user_key",
]

#: ``key_group:u16be | key_len:u16be``: the head of every ckey
CKEY_HEAD = struct.Struct(">HH")
CKEY_HEAD_BYTES = CKEY_HEAD.size
#: the key group is the first two bytes of every table key (big endian, so keys sort by key group)
KEY_GROUP_PREFIX_BYTES = 2
#: the longest serialized key a ckey can frame (its length is a u16)
MAX_KEY_BYTES = 0xFFFF

_TIMER = struct.Struct(">BQ")


def ckey(key_group: int, key: bytes) -> bytes:
    """The context key of ``key`` (its serialized bytes) in ``key_group``."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"serialized key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
    return CKEY_HEAD.pack(key_group, len(key)) + key


def key_group_of(table_key: bytes) -> int:
    """The key group of a ckey or of any table key (its first two bytes)."""
    return (table_key[0] << 8) | table_key[1]


def key_group_prefix(key_group: int) -> bytes:
    """The first bytes of every table key of ``key_group``: where its key range starts."""
    return key_group.to_bytes(KEY_GROUP_PREFIX_BYTES, "big")


def key_of(ck: bytes) -> bytes:
    """The serialized key of a ckey."""
    return ck[CKEY_HEAD_BYTES:]


def split_table_key(table_key: bytes) -> tuple[bytes, bytes]:
    """``(ckey, user_key)`` of a table key; the user key is empty for value and list state."""
    end = CKEY_HEAD_BYTES + ((table_key[2] << 8) | table_key[3])
    return table_key[:end], table_key[end:]


def timer_user_key(domain: int, timestamp_ms: int) -> bytes:
    """The user key of a timer: timers sort by (domain, time) inside their key's prefix."""
    return _TIMER.pack(domain, timestamp_ms)


def parse_timer_user_key(user_key: bytes) -> tuple[int, int]:
    """``(domain, timestamp_ms)`` of a timer's user key."""
    domain, timestamp_ms = _TIMER.unpack(user_key)
    return domain, timestamp_ms
