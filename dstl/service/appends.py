"""``APPEND``, the protocol's hot message: many changes of one writer as binary columns, no reply.

Why it is shaped so: appends are nearly all the traffic, so ``APPEND`` is binary where every
other message is JSON. Its payload is ``<u32 writer><u32 n>``, the key groups as
``array('H')``, the lengths as ``array('I')`` (little-endian, whatever the host), then the
payloads back to back, so encoding and decoding are a few C-level operations per frame, not per
change. ``APPEND`` has no reply: the client streams, and an error surfaces on the writer's next
control call. ``append_frames`` cuts changes into frames of bounded size; a bad change (not bytes,
a key group out of range) is refused by the same check as an ``AppendBuffer``'s cut
(``dstl.append_buffer.check_changes``), and one larger than a frame here.
"""

from __future__ import annotations

import itertools
import struct
import sys
from array import array
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, ClassVar

from dstl.append_buffer import check_changes
from dstl.errors import ConfigurationError, ProtocolError
from dstl.service.framing import MAX_PAYLOAD, Kind, pack_frame

__all__ = ["Append", "append_frames", "encode_frames"]

_APPEND_HEAD = struct.Struct("<II")
_SWAP = sys.byteorder == "big"  # arrays travel little-endian


@dataclass(frozen=True, slots=True)
class Append:
    """Changes of one writer, ``pairs`` as ``[key_group, data, key_group, data, ...]``; no reply."""

    KIND: ClassVar[Kind] = Kind.APPEND
    writer: int
    pairs: list[Any]

    def payload(self) -> bytes:
        key_groups, payloads = self.pairs[0::2], self.pairs[1::2]
        return _columns_payload(self.writer, array("H", key_groups), array("I", map(len, payloads)), payloads)

    @classmethod
    def parse(cls, payload: bytes) -> Append:
        size = len(payload)
        if size < _APPEND_HEAD.size:
            raise ProtocolError(f"APPEND payload of {size} bytes is shorter than its {_APPEND_HEAD.size}-byte header")
        writer, n = _APPEND_HEAD.unpack_from(payload)
        columns = _APPEND_HEAD.size + 6 * n
        if size < columns:
            raise ProtocolError(f"APPEND of {n} changes needs {columns} bytes of key groups and lengths, has {size}")
        key_groups = array("H", payload[_APPEND_HEAD.size : _APPEND_HEAD.size + 2 * n])
        lengths = array("I", payload[_APPEND_HEAD.size + 2 * n : columns])
        if _SWAP:  # pragma: no cover - big-endian hosts only
            key_groups.byteswap()
            lengths.byteswap()
        total = sum(lengths)
        if columns + total != size:
            raise ProtocolError(f"APPEND lengths add up to {total} bytes of changes but {size - columns} follow")
        ends = list(itertools.accumulate(lengths, initial=columns))
        pairs: list[Any] = [None] * (2 * n)
        pairs[0::2] = key_groups.tolist()
        pairs[1::2] = [payload[a:b] for a, b in itertools.pairwise(ends)]
        return cls(writer, pairs)


def _columns_payload(writer: int, kgs: array[int], lengths: array[int], payloads: list[Any]) -> bytes:
    if _SWAP:  # pragma: no cover - big-endian hosts only
        kgs, lengths = array("H", kgs), array("I", lengths)
        kgs.byteswap()
        lengths.byteswap()
    return b"".join([_APPEND_HEAD.pack(writer, len(kgs)), kgs.tobytes(), lengths.tobytes(), *payloads])


def append_frames(writer: int, pairs: list[Any], max_bytes: int, request_id: int = 0) -> list[bytes]:
    """Encode ``pairs`` as APPEND frames of about ``max_bytes`` of changes each (at least one change
    per frame). A bad change raises ``ConfigurationError`` saying what is wrong: a payload that is
    not ``bytes``, a key group that is not an integer in [0, 65535] (``check_changes``), a change
    past ``MAX_PAYLOAD``."""
    kgs, payloads = check_changes(pairs)
    return encode_frames(writer, kgs, payloads, max_bytes, request_id)


def encode_frames(
    writer: int, kgs: array[int], payloads: list[bytes], max_bytes: int, request_id: int = 0
) -> list[bytes]:
    """``append_frames`` of changes checked already (an ``AppendBuffer``'s cut): only a change
    past ``MAX_PAYLOAD`` is refused here."""
    try:
        lengths = array("I", map(len, payloads))
    except OverflowError:
        raise ConfigurationError(f"a change is larger than the service's frame bound ({MAX_PAYLOAD})") from None
    ends = list(itertools.accumulate(lengths))
    frames: list[bytes] = []
    start, base = 0, 0
    while start < len(payloads):
        stop = max(start + 1, bisect_right(ends, base + max_bytes, lo=start))
        size = ends[stop - 1] - base + _APPEND_HEAD.size + 6 * (stop - start)
        if size > MAX_PAYLOAD:
            raise ConfigurationError(
                f"a change of {ends[stop - 1] - base} bytes is larger than the service's frame bound ({MAX_PAYLOAD})"
            )
        payload = _columns_payload(writer, kgs[start:stop], lengths[start:stop], payloads[start:stop])
        frames.append(pack_frame(Kind.APPEND, request_id, payload))
        start, base = stop, ends[stop - 1]
    return frames
