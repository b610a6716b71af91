"""Frames of the changelog service's protocol: a fixed header, an explicit length, a bounded payload.

Why it is shaped so: every frame is ``<u32 payload length><u8 kind><u32 request id><payload>``.
A fixed header and an explicit length let both ends read a frame with two exact reads, and bound
the memory a peer can make the other allocate: a length past its kind's bound (``payload_limit``:
a few hundred bytes for the handshake and the liveness probe, a few MiB for a JSON control
message, ``MAX_PAYLOAD`` for an ``APPEND``, whose one change may be that large) is refused before
anything is read, and so is an unknown kind. A truncated header or payload raises ``ProtocolError`` naming
what is wrong (``TruncatedFrameError``: the peer died mid-frame, which the service treats as a
lost connection, not a broken protocol); no ``struct.error`` escapes. What a payload means is
``protocol``'s (control messages) and ``appends``' (changes); this module only moves bytes.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from typing import Protocol

from dstl.errors import ProtocolError, TruncatedFrameError

__all__ = [
    "HEADER",
    "MAX_CONTROL_PAYLOAD",
    "MAX_PAYLOAD",
    "MAX_SMALL_PAYLOAD",
    "Kind",
    "Readable",
    "pack_frame",
    "payload_limit",
    "read_frame",
]

#: the largest payload either end accepts: an APPEND of one change that large (a bigger length is
#: refused before it is read)
MAX_PAYLOAD = 256 << 20
#: the largest JSON control message or reply (a handle of many segments is the largest)
MAX_CONTROL_PAYLOAD = 8 << 20
#: the largest handshake or liveness message, and any frame before the handshake is done
MAX_SMALL_PAYLOAD = 512
#: ``<u32 payload length><u8 kind><u32 request id>``
HEADER = struct.Struct("<IBI")


class Kind(enum.IntEnum):
    """The header's kind byte: requests below 64, replies from 64 (a reply is its own kind, so
    decoding never depends on the request)."""

    HELLO = 1
    OPEN_WRITER = 2
    APPEND = 3
    LAST_SQN = 4
    PERSIST = 5
    TRUNCATE = 6
    CONFIRM = 7
    RELEASE = 8
    CLOSE_WRITER = 9
    PING = 10
    EXPECT = 11
    WELCOME = 64
    OPENED = 65
    SQN = 66
    PERSISTED = 67
    ACK = 68
    ERROR = 69
    PONG = 70


_KINDS = frozenset(Kind)
_SMALL_KINDS = frozenset({Kind.HELLO, Kind.PING, Kind.WELCOME, Kind.PONG})


def payload_limit(kind: int) -> int:
    """The largest payload a frame of ``kind`` may announce (``kind`` is a known ``Kind``)."""
    if kind == Kind.APPEND:
        return MAX_PAYLOAD
    return MAX_SMALL_PAYLOAD if kind in _SMALL_KINDS else MAX_CONTROL_PAYLOAD


def pack_frame(kind: int, request_id: int, payload: bytes) -> bytes:
    """One frame: header and payload (the caller has checked the payload against ``MAX_PAYLOAD``)."""
    return HEADER.pack(len(payload), kind, request_id) + payload


class Readable(Protocol):
    def read(self, size: int, /) -> bytes | None: ...


def _read_exactly(stream: Readable, size: int, what: str) -> bytes:
    data = stream.read(size) or b""
    if len(data) != size:
        raise TruncatedFrameError(f"truncated frame: {what} of {size} bytes ended after {len(data)}")
    return data


def read_frame(stream: Readable, limit: Callable[[int], int] = payload_limit) -> tuple[int, int, bytes] | None:
    """``(kind, request id, payload)`` of the next frame of a buffered binary stream (a socket's
    ``makefile("rb")``); ``None`` at a clean end of stream (between frames). Refuses an unknown
    kind and a length past ``limit(kind)`` before reading the payload."""
    head = stream.read(HEADER.size) or b""
    if not head:
        return None
    if len(head) != HEADER.size:
        raise TruncatedFrameError(f"truncated frame: header of {HEADER.size} bytes ended after {len(head)}")
    length, kind, request_id = HEADER.unpack(head)
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"frame of kind {kind} announces {length} bytes, more than the bound {MAX_PAYLOAD}")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    if length > (bound := limit(kind)):
        raise ProtocolError(
            f"{Kind(kind).name} frame announces {length} bytes, more than the {bound} allowed for it here"
        )
    return kind, request_id, _read_exactly(stream, length, f"payload of kind {kind}")
