"""Value types shared by every part of the log: sequence numbers, key-group ranges, handles.

Sequence numbers (SQNs) number the *changesets* of one writer, not single records. A changeset is
what a writer appended between two roll-overs (``last_appended_sqn`` / ``persist_durably`` roll
over), so a checkpoint or a materialization can name an exact cut of the log with one integer.

Conventions, chosen so that no caller has to add or subtract one:

- ``last_appended_sqn()`` returns ``s``: every change appended so far has an SQN ``<= s``.
- ``persist_durably(after=s)`` covers the changesets with SQN ``> s``.
- ``truncate(before=s)`` drops the changesets with SQN ``< s``. A materializer that snapshotted
  everything up to ``s`` calls ``truncate(s)``; changeset ``s`` itself is kept until the next
  truncation, which costs one changeset of memory and buys a rule that cannot be off by one.

Handles are immutable, small and JSON-serializable, and hold paths *relative* to the storage's
base path, so that a checkpoint directory can be moved.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dstl.errors import ConfigurationError, CorruptChangelogError
from dstl.paths import check_relative


class SequenceNumber(int):
    """The SQN of a changeset of one writer. ``INITIAL`` (0) precedes every changeset."""

    INITIAL: SequenceNumber

    def next(self) -> SequenceNumber:
        return SequenceNumber(self + 1)

    def __repr__(self) -> str:
        return f"SequenceNumber({int(self)})"


SequenceNumber.INITIAL = SequenceNumber(0)

#: The largest SQN (and checkpoint id): segment headers store SQNs as a u64; a larger number in a
#: handle is damage, refused before it reaches a comparison or a struct.
MAX_SQN = (1 << 64) - 1
#: A segment is a 36-byte header plus at most 2**32 - 1 compressed bytes (its length is a u32).
MAX_SEGMENT_BYTES = 36 + (1 << 32) - 1
#: No changelog file is larger: one is encoded in memory as a single ``bytes`` and uploaded in one
#: request (S3 takes at most 5 GiB in one PUT). A segment ending past it is damage, refused before
#: anything is read: the store would refuse the range (or a file system the seek), and that failure
#: would be retried as the store's.
MAX_FILE_BYTES = 1 << 40
#: A changeset holds at most this many records (the count is a u32).
MAX_RECORDS = (1 << 32) - 1

#: Key groups are stored in two bytes in the file format; Flink's maximum max-parallelism is 2**15.
MAX_KEY_GROUP = (1 << 15) - 1


@dataclass(frozen=True, slots=True)
class KeyGroupRange:
    """An inclusive range of key groups ``[start, end]``; ``end < start`` is the empty range."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (0 <= self.start <= MAX_KEY_GROUP + 1 and -1 <= self.end <= MAX_KEY_GROUP):
            raise ValueError(f"key group range [{self.start}, {self.end}] outside [0, {MAX_KEY_GROUP}]")

    @classmethod
    def of(cls, start: int, end: int) -> KeyGroupRange:
        return cls(start, end)

    @classmethod
    def empty(cls) -> KeyGroupRange:
        return cls(0, -1)

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __len__(self) -> int:
        return max(0, self.end - self.start + 1)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def intersects(self, start: int, end: int) -> bool:
        return self.start <= end and start <= self.end

    def to_json(self) -> list[int]:
        return [self.start, self.end]

    @classmethod
    def from_json(cls, value: Any) -> KeyGroupRange:
        if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)):
            raise ValueError(f"not a key group range: {value!r}")
        return cls(value[0], value[1])


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """Where one changeset of one writer lives: a byte range of a changelog file.

    ``min_key_group``/``max_key_group`` bound the key groups present, so that a reader restoring
    another key-group range skips the segment without reading it.
    """

    path: str
    offset: int
    length: int
    sqn: int
    records: int
    min_key_group: int
    max_key_group: int

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "offset": self.offset,
            "length": self.length,
            "sqn": int(self.sqn),
            "records": self.records,
            "key_groups": [self.min_key_group, self.max_key_group],
        }

    @classmethod
    def from_json(cls, value: Any) -> SegmentRef:
        try:
            kg = value["key_groups"]
            ref = cls(
                path=_check(value["path"], str),
                offset=_check(value["offset"], int),
                length=_check(value["length"], int),
                sqn=_check(value["sqn"], int),
                records=_check(value["records"], int),
                min_key_group=_check(kg[0], int),
                max_key_group=_check(kg[1], int),
            )
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"malformed segment reference {value!r}: {exc}") from None
        if not (
            0 <= ref.offset <= MAX_FILE_BYTES - ref.length
            and 0 < ref.length <= MAX_SEGMENT_BYTES
            and 0 <= ref.sqn <= MAX_SQN
            and 0 <= ref.records <= MAX_RECORDS
        ):
            raise ValueError(f"malformed segment reference {value!r}: offset, length, sqn or records out of range")
        if (ref.min_key_group, ref.max_key_group) != (0, -1):
            KeyGroupRange(ref.min_key_group, ref.max_key_group)  # raises if outside the key groups
        return ref


def _check(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value


HANDLE_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class ChangelogHandle:
    """The durable changes of one writer (log id) with ``after < SQN <= upto``.

    Paths are relative to the storage's base path; ``storage.read`` resolves and checks them.
    """

    log_id: str
    key_group_range: KeyGroupRange
    after: int
    upto: int
    segments: tuple[SegmentRef, ...]

    @property
    def files(self) -> frozenset[str]:
        return frozenset(s.path for s in self.segments)

    @property
    def size(self) -> int:
        return sum(s.length for s in self.segments)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": HANDLE_FORMAT_VERSION,
            "log_id": self.log_id,
            "key_group_range": self.key_group_range.to_json(),
            "after": int(self.after),
            "upto": int(self.upto),
            "segments": [s.to_json() for s in self.segments],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_json(cls, value: Any) -> ChangelogHandle:
        """Parse a handle; anything malformed raises ``CorruptChangelogError`` naming the handle."""
        name = value.get("log_id", "?") if isinstance(value, dict) else "?"
        try:
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            if value.get("version") != HANDLE_FORMAT_VERSION:
                raise ValueError(f"unsupported handle format version {value.get('version')!r}")
            handle = cls(
                log_id=_check(value["log_id"], str),
                key_group_range=KeyGroupRange.from_json(value["key_group_range"]),
                after=_check(value["after"], int),
                upto=_check(value["upto"], int),
                segments=tuple(SegmentRef.from_json(s) for s in _check(value["segments"], list)),
            )
            if not 0 <= handle.after <= handle.upto <= MAX_SQN:
                raise ValueError(f"sqn range after {handle.after} upto {handle.upto} is not within [0, {MAX_SQN}]")
        except (KeyError, TypeError, ValueError, RecursionError) as exc:
            raise CorruptChangelogError(f"<handle of log {name}>", f"malformed handle: {exc}") from None
        return handle

    @classmethod
    def loads(cls, text: str) -> ChangelogHandle:
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:  # nesting past the parser's stack
            raise CorruptChangelogError("<handle>", f"handle is not JSON: {exc!r}") from None
        return cls.from_json(value)


@dataclass(frozen=True)
class Note:
    """What a persist may carry into the file that makes it durable (``persist_durably(after,
    note)``): ``payload``, a JSON object, is written into that file with the persist's handle, and
    the file goes to ``directory`` (relative to the base path) instead of ``dstl/<xx>/``, so that a
    reader finds it by listing that directory (``dstl.format``, notes)."""

    directory: str
    payload: dict[str, Any]

    def __post_init__(self) -> None:
        check_relative(self.directory)
        if not isinstance(self.payload, dict):
            raise ConfigurationError(f"a note's payload must be a JSON object, got {type(self.payload).__name__}")

    def to_json(self) -> dict[str, Any]:
        return {"directory": self.directory, "payload": self.payload}

    @classmethod
    def from_json(cls, value: Any) -> Note:
        """``ValueError`` (a ``ConfigurationError``) unless ``value`` is a note's JSON."""
        if not isinstance(value, dict) or not isinstance(value.get("directory"), str):
            raise ConfigurationError(f"not a note: {value!r:.200}")
        return cls(value["directory"], value.get("payload"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class NotedHandle:
    """A note read back from a file: its payload and the handle of the persist that carried it."""

    payload: dict[str, Any]
    handle: ChangelogHandle
