"""``KeyedStateHandle``: what a subtask's snapshot is, as JSON with relative paths.

A handle = the state metadata (name -> kind, serializer ids, TTL) + the materialized parts (added
by the materializer) + the changelog since them as ``LogEntry``s, oldest first: a log handle and
the key groups it applies to. Entries carried over from a restore come first, each narrowed to
the key groups this subtask took from it. Replaying a snapshot = for every subtask handle, its
entries in order, each filtered to (entry key groups & handle key groups & owned); the handles of
one snapshot own disjoint key groups, so every key's history is replayed once and in order,
whatever the old and new parallelism (also after several rescales, where one log is carried by
several handles, each for different key groups).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from backend.core.errors import StateRestoreError
from dstl import ChangelogHandle, CorruptChangelogError, KeyGroupRange

HANDLE_VERSION = 1


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
            "version": HANDLE_VERSION,
            "operator_id": self.operator_id,
            "checkpoint_id": self.checkpoint_id,
            "max_parallelism": self.max_parallelism,
            "key_group_range": self.key_group_range.to_json(),
            "states": self.states,
            "materialized": list(self.materialized),
            "changelog": [h.to_json() for h in self.changelog],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, value: Any) -> KeyedStateHandle:
        try:
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            if value.get("version") != HANDLE_VERSION:
                raise ValueError(f"unsupported keyed state handle version {value.get('version')!r}")
            states = value["states"]
            if not isinstance(states, dict) or not all(isinstance(m, dict) for m in states.values()):
                raise ValueError("malformed state metadata")
            handle = cls(
                operator_id=_typed(value["operator_id"], str),
                max_parallelism=_typed(value["max_parallelism"], int),
                key_group_range=KeyGroupRange.from_json(value["key_group_range"]),
                states=states,
                changelog=tuple(LogEntry.from_json(h) for h in _typed(value["changelog"], list)),
                materialized=tuple(_typed(value.get("materialized", []), list)),
                checkpoint_id=_typed(value.get("checkpoint_id", 0), int),
            )
        except (KeyError, TypeError, ValueError, CorruptChangelogError) as exc:
            raise StateRestoreError(f"malformed keyed state handle: {exc}") from None
        return handle

    @classmethod
    def loads(cls, text: str) -> KeyedStateHandle:
        try:
            return cls.from_json(json.loads(text))
        except json.JSONDecodeError as exc:
            raise StateRestoreError(f"keyed state handle is not JSON: {exc}") from None


def _typed(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value
