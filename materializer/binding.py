"""A chunk bound to the handle entry that names it: what a restore and ``verify`` check before using it.

Why a module of its own: the chunk's own checks (``materializer.chunks``) prove that a file is a
well-formed chunk, not that it is the chunk the handle means; another valid chunk in its place
(other key groups of the same operator, the same key groups from an older materialization) passes
all of them. The binding compares the file with what the handle recorded when it was written: size
and content hash (``backend.core.handles``), then the footer's key groups, SQN and entry count. It
is the one piece of the chunk reader that knows the handle format, so the format stays free of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from backend.core.handles import CHUNK_HASH, chunk_digest
from dstl.types import KeyGroupRange
from materializer.chunks import ChunkIndex, chunk_info, chunk_sections
from materializer.errors import CorruptChunkError

__all__ = ["bound_chunk_sections", "bulk_load_sections", "check_binding", "check_index_binding"]


def check_binding(path: str, data: bytes, info: ChunkIndex, entry: Mapping[str, Any]) -> None:
    """Raise ``CorruptChunkError`` unless the chunk is the one the handle ``entry`` names.

    Size and hash first (the hash only if the entry records one: handles of version 1 do not),
    then what the footer says: key groups, SQN, entries.
    """
    problems = []
    if entry.get("size") != len(data):
        problems.append(f"size {len(data)} (the handle records {entry.get('size')!r})")
    digest = entry.get(CHUNK_HASH)
    if digest is not None and digest != chunk_digest(data):
        problems.append(f"{CHUNK_HASH} {chunk_digest(data)} (the handle records {digest!r})")
    _refuse(path, problems + index_problems(info, entry))


def check_index_binding(path: str, info: ChunkIndex, entry: Mapping[str, Any]) -> None:
    """Raise ``CorruptChunkError`` unless the index read from a chunk's tail (a point read, which
    has not the whole chunk to hash) says what the handle ``entry`` records: key groups, SQN, entries."""
    _refuse(path, index_problems(info, entry))


def _refuse(path: str, problems: list[str]) -> None:
    if problems:
        raise CorruptChunkError(path, "not the chunk the handle names: it has " + ", ".join(problems))


def index_problems(info: ChunkIndex, entry: Mapping[str, Any]) -> list[str]:
    """How the chunk's footer differs from the handle ``entry``: key groups, SQN, entries."""
    problems = []
    if entry.get("key_groups") != info.key_groups.to_json():
        problems.append(f"key groups {info.key_groups.to_json()} (the handle records {entry.get('key_groups')!r})")
    if entry.get("sqn") != info.sqn:
        problems.append(f"sqn {info.sqn} (the handle records {entry.get('sqn')!r})")
    if entry.get("entries") != info.entries:
        problems.append(f"{info.entries} entries (the handle records {entry.get('entries')!r})")
    return problems


def bound_chunk_sections(
    path: str, data: bytes, entry: Mapping[str, Any], key_groups: KeyGroupRange
) -> dict[str, Sequence[tuple[bytes, bytes]]]:
    """``chunk_sections`` of a chunk checked against the handle ``entry`` naming it (a restore's loader)."""
    info = chunk_info(path, data)
    check_binding(path, data, info, entry)
    return chunk_sections(path, data, key_groups, info)


def bulk_load_sections(
    path: str, data: bytes, entry: Mapping[str, Any], key_groups: KeyGroupRange
) -> dict[str, Sequence[tuple[bytes, bytes]]]:
    """``bound_chunk_sections`` for an eager restore's bulk load (``backend.state.restore.bulk_put``):
    the order of a wholly owned chunk's keys is left to LMDB's append to prove (``Entries.unproven_order``)."""
    info = chunk_info(path, data)
    check_binding(path, data, info, entry)
    return chunk_sections(path, data, key_groups, info, check_order=False)
