"""The version-1 chunk writer, frozen as it was before version 2 (commit e2b13c4), for tests only.

Today's ``encode_chunk`` writes version 2; a reader must keep reading the version-1 chunks that
checkpoints and savepoints written before still reference. This copy makes them in any shape a
test needs (the fixtures under tests/fixtures hold chunks written by the old code itself). Do not
change it: its point is to write what the old writer wrote.
"""

from __future__ import annotations

import json
import operator
import struct
import zlib
from array import array
from collections.abc import Mapping, Sequence
from itertools import islice
from operator import itemgetter
from typing import Any

import zstandard

from backend.core.tablekeys import KEY_GROUP_PREFIX_BYTES
from backend.core.tablekeys import key_group_of as _key_group
from dstl.format import le_bytes
from dstl.types import KeyGroupRange

VERSION = 1
CHUNK_MAGIC = b"DMAT"
CHUNK_TRAILER_MAGIC = b"TAMD"
CHUNK_HEADER = struct.Struct("<4sHH")
CHUNK_TRAILER = struct.Struct("<IIH4s")
_U32 = struct.Struct("<I")
_MAX_U32 = (1 << 32) - 1
_first = itemgetter(0)
_second = itemgetter(1)


def _first_unsorted(keys: Sequence[bytes]) -> int:
    """The index of the first key not greater than its predecessor (only called when there is one)."""
    return next(i for i in range(1, len(keys)) if not keys[i - 1] < keys[i])


def _encode_section(
    name: str,
    entries: Sequence[tuple[bytes, bytes]],
    key_groups: KeyGroupRange,
    compressor: zstandard.ZstdCompressor,
) -> tuple[bytes, int, int, int, int]:
    """Returns (frame, count, raw length, min key group, max key group)."""
    count = len(entries)
    if count > _MAX_U32:
        raise ValueError(f"section {name!r} has {count} entries, at most {_MAX_U32} fit")
    keys = list(map(_first, entries))
    values = list(map(_second, entries))
    try:
        key_lens = array("I", map(len, keys))
        value_lens = array("I", map(len, values))
    except OverflowError:
        raise ValueError(f"section {name!r}: a key or value is larger than {_MAX_U32} bytes") from None
    lo, hi = 0, -1
    if count:
        if min(key_lens) < KEY_GROUP_PREFIX_BYTES:
            i = next(i for i, n in enumerate(key_lens) if n < KEY_GROUP_PREFIX_BYTES)
            raise ValueError(f"section {name!r}: key {i} ({keys[i]!r}) is shorter than its key-group prefix")
        if not all(map(operator.lt, keys, islice(keys, 1, None))):
            i = _first_unsorted(keys)
            raise ValueError(
                f"section {name!r}: keys not strictly increasing at entry {i} ({keys[i - 1]!r} >= {keys[i]!r})"
            )
        lo, hi = _key_group(keys[0]), _key_group(keys[-1])
        if lo < key_groups.start or hi > key_groups.end:
            bad = keys[0] if lo < key_groups.start else keys[-1]
            raise ValueError(
                f"section {name!r}: key {bad!r} is in key group {_key_group(bad)}, "
                f"outside the chunk's range [{key_groups.start}, {key_groups.end}]"
            )
    raw = b"".join((_U32.pack(count), le_bytes(key_lens), le_bytes(value_lens), b"".join(keys), b"".join(values)))
    return compressor.compress(raw), count, len(raw), lo, hi


def encode_chunk_v1(
    key_groups: KeyGroupRange,
    sqn: int,
    sections: Mapping[str, Sequence[tuple[bytes, bytes]]],
    level: int = 1,
) -> bytes:
    """Encode the entries of every state in ``key_groups`` as of ``sqn`` into one chunk file.

    ``sections`` maps a state (LMDB database) name to its entries, sorted by key; every key starts
    with its key group (2 bytes, big endian) inside ``key_groups``. Unsorted or duplicate keys, keys
    outside the range and a negative SQN raise ``ValueError``. Sections are written in name order,
    so equal contents give equal bytes; an empty section is kept (and decodes as an empty list).
    """
    if not isinstance(sqn, int) or isinstance(sqn, bool) or sqn < 0:
        raise ValueError(f"sqn must be a non-negative int, got {sqn!r}")
    for name in sections:
        if not isinstance(name, str):
            raise ValueError(f"section names must be str, got {name!r}")
    compressor = zstandard.ZstdCompressor(level=level)
    parts = [CHUNK_HEADER.pack(CHUNK_MAGIC, VERSION, 0)]
    offset = CHUNK_HEADER.size
    index: list[dict[str, Any]] = []
    for name in sorted(sections):
        frame, count, raw_length, lo, hi = _encode_section(name, sections[name], key_groups, compressor)
        parts.append(frame)
        index.append(
            {
                "name": name,
                "offset": offset,
                "length": len(frame),
                "count": count,
                "raw_length": raw_length,
                "crc32": zlib.crc32(frame),
                "key_groups": [lo, hi],
            }
        )
        offset += len(frame)
    footer = json.dumps(
        {
            "version": VERSION,
            "key_groups": key_groups.to_json(),
            "sqn": int(sqn),
            "sections": index,
        },
        separators=(",", ":"),
    ).encode()
    parts.append(footer)
    parts.append(CHUNK_TRAILER.pack(len(footer), zlib.crc32(footer), VERSION, CHUNK_TRAILER_MAGIC))
    return b"".join(parts)
