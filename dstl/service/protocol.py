"""The changelog service's wire protocol: its messages, how they are encoded, and its errors; nothing unpickled.

Why it is shaped so:

- *Frames, then messages.* Every message travels as one frame (``framing``: fixed header,
  explicit length, bounded payload). ``APPEND``, the hot message, is binary (``appends``);
  control messages are rare (a few per checkpoint) and are small JSON objects, each field checked
  for type and range; unknown fields are ignored, the protocol version is checked once, at
  ``HELLO``. An unknown kind and a payload that does not decode raise ``ProtocolError`` naming
  what is wrong; no ``IndexError`` or ``UnicodeDecodeError`` escapes.
- *Requests and replies are matched by request id.* The service answers a connection's requests
  in order, except ``PERSIST``, whose reply is sent when the changes are durable, so a client
  keeps a table of outstanding request ids. A reply is its own kind (``WELCOME``, ``OPENED``,
  ``SQN``, ``PERSISTED``, ``ACK``, ``ERROR``), so decoding never depends on the request.
- *Liveness.* ``PING`` is the first and only frame of a connection of its own; the service answers
  ``PONG`` (its epoch and pid) from that connection's thread, which never touches the storage, so
  a service busy with backpressure answers and a stopped one does not (``liveness``).
- *Errors cross the socket by class name.* ``ERROR`` carries ``{"type", "message"}``; the client
  raises the ``dstl.errors`` class of that name from a whitelist (``error_from_reply``), anything
  else as ``StorageError``.

The error classes of the service (``ServiceUnavailableError``, ``FencedWriterError``,
``ProtocolError``) live in ``dstl.errors`` with the rest of the hierarchy; the protocol names them
on both ends.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from dstl.errors import (
    ChangelogError,
    ConfigurationError,
    DeadlineExceededError,
    FencedWriterError,
    ProtocolError,
    ServiceUnavailableError,
    StorageClosedError,
    StorageError,
    UploadFailedError,
    WriterClosedError,
)
from dstl.service.appends import Append
from dstl.service.framing import Kind, Readable, pack_frame, payload_limit, read_frame
from dstl.types import MAX_SQN, ChangelogHandle, KeyGroupRange, Note

__all__ = [
    "JOIN_S",
    "PROTOCOL_VERSION",
    "Ack",
    "CloseWriter",
    "Confirm",
    "Error",
    "Expect",
    "Hello",
    "LastSqn",
    "Message",
    "OpenWriter",
    "Opened",
    "Persist",
    "Persisted",
    "Ping",
    "Pong",
    "Release",
    "Sqn",
    "Truncate",
    "Welcome",
    "decode",
    "encode",
    "error_from_reply",
    "error_reply",
    "read_message",
]

PROTOCOL_VERSION = 2
_U32 = (1 << 32) - 1
#: how long either end, closing a connection, waits for each of that connection's threads
JOIN_S = 10.0


# -- errors -----------------------------------------------------------------------------------


#: the classes an ERROR reply may name; anything else is raised as ``StorageError``
_ERROR_TYPES: dict[str, type[ChangelogError]] = {
    cls.__name__: cls
    for cls in (
        ChangelogError,
        ConfigurationError,
        StorageError,
        DeadlineExceededError,
        UploadFailedError,
        WriterClosedError,
        StorageClosedError,
        ProtocolError,
        ServiceUnavailableError,
        FencedWriterError,
    )
}


def error_reply(exc: BaseException) -> Error:
    """The ERROR message for ``exc``: its class, or its nearest whitelisted base class, by name."""
    name = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in _ERROR_TYPES), "StorageError")
    return Error(name, str(exc))


def error_from_reply(reply: Error, context: str) -> ChangelogError:
    """The exception an ERROR reply stands for, its message prefixed with ``context``."""
    cls = _ERROR_TYPES.get(reply.type, StorageError)
    return cls(f"{context}: {reply.message}")


# -- messages ---------------------------------------------------------------------------------


class Message(Protocol):
    KIND: ClassVar[Kind]

    def payload(self) -> bytes: ...


M = TypeVar("M", bound="_Json")
#: integer fields bounded by a u32 (the others are SQNs)
_U32_FIELDS = frozenset({"writer", "version", "pid"})


def _parse_field(kind: str, name: str, annotation: str, value: Any) -> Any:
    """One JSON field of a message, checked against the dataclass field's annotation."""
    if annotation == "int":
        hi = _U32 if name in _U32_FIELDS else MAX_SQN
        if type(value) is not int or not 0 <= value <= hi:
            raise ProtocolError(f"{kind} field {name!r} must be an integer in [0, {hi}], got {value!r}")
        return value
    if annotation == "str":
        if type(value) is not str:
            raise ProtocolError(f"{kind} field {name!r} must be a string, got {value!r}")
        return value
    try:
        if annotation == "Note | None":
            return None if value is None else Note.from_json(value)
        if annotation == "ChangelogHandle":
            return ChangelogHandle.from_json(value)
        return KeyGroupRange.from_json(value)
    except (ChangelogError, ValueError) as exc:
        raise ProtocolError(f"{kind} field {name!r}: {exc}") from None


class _Json:
    """A message whose payload is the JSON object of its dataclass fields (``int``, ``str``,
    ``ChangelogHandle`` and ``KeyGroupRange``, the last two by their own ``to_json``)."""

    KIND: ClassVar[Kind]

    def payload(self) -> bytes:
        fields = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            fields[f.name] = value if value is None or isinstance(value, int | str) else value.to_json()
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()

    @classmethod
    def parse(cls: type[M], payload: bytes) -> M:
        kind = cls.KIND.name
        try:
            value = json.loads(payload.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{kind} payload is not UTF-8: {exc}") from None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, digits past the int limit
            raise ProtocolError(f"{kind} payload is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ProtocolError(f"{kind} payload is not a JSON object: {type(value).__name__}")
        kwargs = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in value:
                if f.default is not dataclasses.MISSING:
                    continue  # an optional field
                raise ProtocolError(f"{kind} lacks the field {f.name!r}")
            kwargs[f.name] = _parse_field(kind, f.name, str(f.type), value[f.name])
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class Hello(_Json):
    """First request of every connection: the client's protocol version and config fingerprint."""

    KIND: ClassVar[Kind] = Kind.HELLO
    version: int
    fingerprint: str


@dataclass(frozen=True, slots=True)
class Welcome(_Json):
    """Reply to HELLO: the service's epoch (one per service start) and process id."""

    KIND: ClassVar[Kind] = Kind.WELCOME
    epoch: int
    pid: int


@dataclass(frozen=True, slots=True)
class Ping(_Json):
    """The one request of a liveness probe's connection (instead of HELLO)."""

    KIND: ClassVar[Kind] = Kind.PING


@dataclass(frozen=True, slots=True)
class Pong(_Json):
    """Reply to PING: the service's epoch and pid (the prober checks it is the service it knows)."""

    KIND: ClassVar[Kind] = Kind.PONG
    epoch: int
    pid: int


@dataclass(frozen=True, slots=True)
class OpenWriter(_Json):
    KIND: ClassVar[Kind] = Kind.OPEN_WRITER
    operator_id: str
    key_group_range: KeyGroupRange


@dataclass(frozen=True, slots=True)
class Opened(_Json):
    """Reply to OPEN_WRITER: the writer's number on this connection and its log id."""

    KIND: ClassVar[Kind] = Kind.OPENED
    writer: int
    log_id: str


@dataclass(frozen=True, slots=True)
class LastSqn(_Json):
    KIND: ClassVar[Kind] = Kind.LAST_SQN
    writer: int


@dataclass(frozen=True, slots=True)
class Sqn(_Json):
    KIND: ClassVar[Kind] = Kind.SQN
    sqn: int


@dataclass(frozen=True, slots=True)
class Persist(_Json):
    KIND: ClassVar[Kind] = Kind.PERSIST
    writer: int
    after: int
    note: Note | None = None


@dataclass(frozen=True, slots=True)
class Persisted(_Json):
    """Reply to PERSIST, sent once the changes are durable."""

    KIND: ClassVar[Kind] = Kind.PERSISTED
    handle: ChangelogHandle


@dataclass(frozen=True, slots=True)
class Truncate(_Json):
    KIND: ClassVar[Kind] = Kind.TRUNCATE
    writer: int
    before: int


@dataclass(frozen=True, slots=True)
class Expect(_Json):
    """The writer will persist soon: the service's flushes may wait for it (``expect_persist``)."""

    KIND: ClassVar[Kind] = Kind.EXPECT
    writer: int


@dataclass(frozen=True, slots=True)
class Confirm(_Json):
    KIND: ClassVar[Kind] = Kind.CONFIRM
    writer: int
    handle: ChangelogHandle


@dataclass(frozen=True, slots=True)
class Release(_Json):
    KIND: ClassVar[Kind] = Kind.RELEASE
    writer: int
    handle: ChangelogHandle


@dataclass(frozen=True, slots=True)
class CloseWriter(_Json):
    KIND: ClassVar[Kind] = Kind.CLOSE_WRITER
    writer: int


@dataclass(frozen=True, slots=True)
class Ack(_Json):
    """Reply to TRUNCATE, EXPECT, CONFIRM, RELEASE and CLOSE_WRITER."""

    KIND: ClassVar[Kind] = Kind.ACK


@dataclass(frozen=True, slots=True)
class Error(_Json):
    """Reply to any request that failed: the ``dstl.errors`` class name and the message."""

    KIND: ClassVar[Kind] = Kind.ERROR
    type: str
    message: str


_BY_KIND: dict[int, Any] = {
    cls.KIND: cls
    for cls in (
        Hello,
        Welcome,
        OpenWriter,
        Opened,
        Append,
        LastSqn,
        Sqn,
        Persist,
        Persisted,
        Truncate,
        Expect,
        Confirm,
        Release,
        CloseWriter,
        Ack,
        Error,
        Ping,
        Pong,
    )
}


# -- encoding -------------------------------------------------------------------------------


def encode(message: Message, request_id: int) -> bytes:
    """One frame: header and payload (``ProtocolError`` past its kind's bound, which the peer refuses)."""
    payload = message.payload()
    if len(payload) > (bound := payload_limit(message.KIND)):
        raise ProtocolError(f"{message.KIND.name} payload of {len(payload)} bytes exceeds {bound}")
    return pack_frame(message.KIND, request_id, payload)


def decode(kind: int, payload: bytes) -> Message:
    """The message of a frame's kind and payload; ``ProtocolError`` if either is bad."""
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown frame kind {kind}")
    message: Message = cls.parse(payload)
    return message


def read_message(stream: Readable, limit: Callable[[int], int] = payload_limit) -> tuple[int, Message] | None:
    """``(request id, message)`` of the next frame, or ``None`` at a clean end of stream; a frame
    longer than ``limit(kind)`` is refused before it is read."""
    frame = read_frame(stream, limit)
    if frame is None:
        return None
    kind, request_id, payload = frame
    return request_id, decode(kind, payload)
