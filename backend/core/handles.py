"""``KeyedStateHandle``: what a subtask's snapshot is, as JSON with relative paths.

A handle = the state metadata (name -> kind, serializer ids, TTL) + the materialized parts (added
by the materializer) + the changelog since them as ``LogEntry``s, oldest first: a log handle and
the key groups it applies to. Entries carried over from a restore come first, each narrowed to
the key groups this subtask took from it. Replaying a snapshot = for every subtask handle, its
entries in order, each filtered to (entry key groups & handle key groups & owned); the handles of
one snapshot own disjoint key groups, so every key's history is replayed once and in order,
whatever the old and new parallelism (also after several rescales, where one log is carried by
several handles, each for different key groups).

A materialized entry names one chunk: ``path``, its ``key_groups``, the ``scope`` a restore takes
from it, its ``sqn``, ``size`` and ``entries``, and (version 2) ``sha256``, the hash of its bytes,
so that a restore can tell the chunk it reads is the one the handle names (another valid chunk in
its place passes every checksum of the chunk format). Version 3 adds ``offset``: the chunk is the
``size`` bytes at ``offset`` of the file at ``path``, which may hold other chunks too (a *pack*:
one materialization, or the materializations a Spark task started together, write one file
instead of one per key-group range; see ``materializer.packs``). Without ``offset`` the chunk is
the whole file. Version 1 (written before the hash) is still read: its entries are bound by the
other fields. A handle is written as version 1 when an entry lacks its hash (entries carried over
from a version-1 handle without reading their chunk), as version 3 when an entry has an offset,
else as version 2 (so that a reader of version 2 still reads it); a version-2 handle with an entry
lacking the hash, or an older one with an offset, is refused. Every number is
bounded and nothing nests deeper than the format does, so a damaged handle raises
``StateRestoreError`` instead of an overflow or a recursion error later.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from backend.core.errors import StateRestoreError
from backend.core.keygroups import UPPER_BOUND_MAX_PARALLELISM
from dstl.api import DfsFiles
from dstl.errors import CorruptChangelogError
from dstl.types import MAX_SQN, ChangelogHandle, KeyGroupRange, NotedHandle

HANDLE_VERSION = 3
#: handles of this version (and up to HANDLE_VERSION) are read; before 2, chunks carry no hash
OLDEST_HANDLE_VERSION = 1
#: the oldest version whose chunk entries may carry an offset (a chunk inside a pack)
PACKED_HANDLE_VERSION = 3
#: the chunk entry field holding the SHA-256 (hex) of the chunk's bytes
CHUNK_HASH = "sha256"
#: larger numbers in a handle are damage (a chunk's size is at most this many bytes)
MAX_FILE_BYTES = (1 << 63) - 1
#: state metadata is flat JSON (name -> fields); deeper nesting is damage
_MAX_METADATA_DEPTH = 8
_HEX64 = re.compile(r"[0-9a-f]{64}")


def chunk_digest(data: bytes) -> str:
    """The content hash a handle records for a chunk (``CHUNK_HASH``)."""
    return hashlib.sha256(data).hexdigest()


def check_chunk_entry(value: Any, version: int = HANDLE_VERSION) -> dict[str, Any]:
    """A materialized chunk entry, checked field by field; raises ``ValueError`` naming the field."""
    if not isinstance(value, dict):
        raise ValueError(f"materialized chunk entry is not an object: {value!r}")
    path = value.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"materialized chunk entry without a path: {value!r}")
    try:
        key_groups = KeyGroupRange.from_json(value["key_groups"])
        scope = KeyGroupRange.from_json(value["scope"])
        _bounded(value["sqn"], 0, MAX_SQN)
        _bounded(value["size"], 1, MAX_FILE_BYTES)
        _bounded(value["entries"], 0, MAX_FILE_BYTES)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"materialized chunk entry {path}: {type(exc).__name__} {exc}") from None
    if not len(key_groups) or (len(scope) and not (key_groups.start <= scope.start and scope.end <= key_groups.end)):
        raise ValueError(f"materialized chunk entry {path}: scope {scope.to_json()} outside {key_groups.to_json()}")
    if "offset" in value:
        if version < PACKED_HANDLE_VERSION:
            raise ValueError(f"materialized chunk entry {path} has an offset (handle version {version})")
        try:
            _bounded(value["offset"], 0, MAX_FILE_BYTES)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"materialized chunk entry {path}: offset: {exc}") from None
    digest = value.get(CHUNK_HASH)
    if digest is None and version >= 2:
        raise ValueError(f"materialized chunk entry {path} has no {CHUNK_HASH} (handle version {version})")
    if digest is not None and not (isinstance(digest, str) and _HEX64.fullmatch(digest)):
        raise ValueError(f"materialized chunk entry {path}: {CHUNK_HASH} {digest!r} is not 64 hex digits")
    return value


def read_chunk(files: DfsFiles, entry: dict[str, Any], timeout: float | None = None) -> bytes:
    """The bytes of the chunk ``entry`` names, from ``files`` (a storage's): a ranged read inside a
    pack, the whole file otherwise. Raises what the files raise (``FileNotFoundError``, ...)."""
    path = str(entry["path"])
    if "offset" in entry:
        return bytes(files.read_range(path, int(entry["offset"]), int(entry["size"]), timeout=timeout))
    return bytes(files.get(path, timeout=timeout))


def handle_version(chunks: Any) -> int:
    """The version a handle (or a savepoint's part) holding the chunk entries ``chunks`` is written as."""
    if not all(CHUNK_HASH in chunk for chunk in chunks):
        return OLDEST_HANDLE_VERSION
    return PACKED_HANDLE_VERSION if any("offset" in chunk for chunk in chunks) else 2


def _bounded(value: Any, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"expected an int in [{low}, {high}], got {value!r}")
    return value


def _check_depth(value: Any, limit: int) -> None:
    """Raise ``ValueError`` if ``value`` nests deeper than ``limit`` (iteratively: no recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise ValueError(f"nested deeper than {limit} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


@dataclass(frozen=True)
class LogEntry:
    log: ChangelogHandle
    key_groups: KeyGroupRange

    def to_json(self) -> dict[str, Any]:
        return {"log": self.log.to_json(), "key_groups": self.key_groups.to_json()}

    @classmethod
    def from_json(cls, value: Any) -> LogEntry:
        if not isinstance(value, dict):
            raise ValueError("changelog entry is not an object")
        return cls(ChangelogHandle.from_json(value["log"]), KeyGroupRange.from_json(value["key_groups"]))


def intersect(a: KeyGroupRange, b: KeyGroupRange) -> KeyGroupRange:
    start, end = max(a.start, b.start), min(a.end, b.end)
    return KeyGroupRange(start, end) if start <= end else KeyGroupRange.empty()


@dataclass(frozen=True)
class KeyedStateHandle:
    operator_id: str
    max_parallelism: int
    key_group_range: KeyGroupRange
    states: dict[str, dict[str, Any]]
    changelog: tuple[LogEntry, ...]
    materialized: tuple[dict[str, Any], ...] = field(default=())
    checkpoint_id: int = 0

    def referenced_files(self) -> set[str]:
        """Every DFS file (relative path) a restore of this handle reads: chunks and log files."""
        chunks = {str(chunk["path"]) for chunk in self.materialized}
        return chunks | {seg.path for entry in self.changelog for seg in entry.log.segments}

    def to_json(self) -> dict[str, Any]:
        return {
            "version": handle_version(self.materialized),
            "operator_id": self.operator_id,
            "checkpoint_id": self.checkpoint_id,
            "max_parallelism": self.max_parallelism,
            "key_group_range": self.key_group_range.to_json(),
            "states": self.states,
            "materialized": [dict(chunk) for chunk in self.materialized],
            "changelog": [h.to_json() for h in self.changelog],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, value: Any) -> KeyedStateHandle:
        try:
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            version = value.get("version")
            if type(version) is not int or not OLDEST_HANDLE_VERSION <= version <= HANDLE_VERSION:
                raise ValueError(f"unsupported keyed state handle version {version!r}")
            states = value["states"]
            if not isinstance(states, dict) or not all(isinstance(m, dict) for m in states.values()):
                raise ValueError("malformed state metadata")
            _check_depth(states, _MAX_METADATA_DEPTH)
            materialized = _typed(value.get("materialized", []), list)
            handle = cls(
                operator_id=_typed(value["operator_id"], str),
                max_parallelism=_bounded(value["max_parallelism"], 1, UPPER_BOUND_MAX_PARALLELISM),
                key_group_range=KeyGroupRange.from_json(value["key_group_range"]),
                states=states,
                changelog=tuple(LogEntry.from_json(h) for h in _typed(value["changelog"], list)),
                materialized=tuple(check_chunk_entry(c, version) for c in materialized),
                checkpoint_id=_bounded(value.get("checkpoint_id", 0), 0, MAX_SQN),
            )
        except (KeyError, TypeError, ValueError, RecursionError, CorruptChangelogError) as exc:
            raise StateRestoreError(f"malformed keyed state handle: {exc}") from None
        return handle

    def with_own_log(self, own: ChangelogHandle) -> KeyedStateHandle:
        """This handle (a snapshot's template: everything but the persist of its own log) with
        ``own``, the persist's handle, appended to its changelog (if it holds any change)."""
        if not own.segments:
            return self
        return dataclasses.replace(self, changelog=(*self.changelog, LogEntry(own, self.key_group_range)))

    @classmethod
    def from_note(cls, noted: NotedHandle) -> KeyedStateHandle:
        """The handle a snapshot carried in a note (``ChangelogKeyedStateBackend.snapshot(note=)``):
        the template under ``"handle"`` of the payload, with the persist's own log."""
        if "handle" not in noted.payload:
            raise StateRestoreError("a note without a keyed state handle")
        return cls.from_json(noted.payload["handle"]).with_own_log(noted.handle)

    @classmethod
    def loads(cls, text: str) -> KeyedStateHandle:
        try:
            return cls.from_json(json.loads(text))
        except (json.JSONDecodeError, RecursionError) as exc:  # nesting past the parser's stack
            raise StateRestoreError(f"keyed state handle is not JSON: {exc!r}") from None


def _typed(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value
