"""A restore checks every materialized chunk against its handle entry before loading it.

A chunk file replaced by another *valid* chunk (other key groups of the same operator, or the same
key groups from an older materialization) passes every checksum of the chunk format; only the
handle can tell it is not the chunk it names. Handles record each chunk's key groups, SQN, size,
entry count and (since handle version 2) its SHA-256; handles of version 1 (written before the
hash) are checked on what they have. The files are replaced on the local DFS as a damaged or
misplaced upload would leave them; no code of ours is patched. The world materializes one chunk
per file (``pack_bytes=1``) so that a file can be swapped for another, as before packs existed;
a chunk inside a pack is bound the same way (the last tests).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.core.descriptors import ValueStateDescriptor
from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import assign_key_group
from backend.core.serializers import Int64Serializer, serialize_key
from backend.core.tablekeys import key_group_prefix
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, CorruptDataError, KeyGroupRange
from materializer.chunks import decode_chunk, read_chunk_index
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, restore
from tests.support.backend_world import BackendWorld

MAX_P = 4
FULL = KeyGroupRange(0, MAX_P - 1)
COUNT = ValueStateDescriptor("count", Int64Serializer())
NEVER = 10**12


class World(BackendWorld):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, ChangelogConfig.local(tmp / "dfs", persist_delay_ms=0), MAX_P)
        self.checkpoint_id = 0

    def materialize(self, b: ChangelogKeyedStateBackend, pack_bytes: int = 1) -> None:
        m = PeriodicMaterializer(
            b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, pack_bytes=pack_bytes)
        )
        assert m.trigger()
        m.wait(30)
        m.close()
        assert m.metrics.completed == 1

    def checkpoint(self, b: ChangelogKeyedStateBackend) -> KeyedStateHandle:
        self.checkpoint_id += 1
        handle = b.snapshot(self.checkpoint_id).result(30)
        return KeyedStateHandle.loads(handle.dumps())

    def restored(self, handle: KeyedStateHandle) -> ChangelogKeyedStateBackend:
        b = self.backend()
        restore(b, [handle])
        return b


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    try:
        yield w
    finally:
        w.close()


def keys_by_group() -> dict[int, int]:
    """One int key per key group."""
    found: dict[int, int] = {}
    key = 0
    while len(found) < MAX_P:
        found.setdefault(assign_key_group(serialize_key(key), MAX_P), key)
        key += 1
    return found


def write(b: ChangelogKeyedStateBackend, values: dict[int, int]) -> None:
    for key, value in values.items():
        b.set_current_key(key)
        b.get_state(COUNT).update(value)


def read(b: ChangelogKeyedStateBackend, keys: list[int]) -> dict[int, int | None]:
    out = {}
    for key in keys:
        b.set_current_key(key)
        out[key] = b.get_state(COUNT).value()
    return out


def chunk_path(world: World, handle: KeyedStateHandle, key_group: int) -> Path:
    (entry,) = [c for c in handle.materialized if c["key_groups"] == [key_group, key_group]]
    return world.dfs / str(entry["path"])


def materialized_handle(
    world: World, values: dict[int, int], pack_bytes: int = 1
) -> tuple[ChangelogKeyedStateBackend, KeyedStateHandle]:
    b = world.backend()
    write(b, values)
    world.materialize(b, pack_bytes)
    return b, world.checkpoint(b)


def whole_files(handle: KeyedStateHandle) -> KeyedStateHandle:
    """``handle`` as a writer before packs wrote it (version 2): each chunk is a whole file."""
    value = json.loads(handle.dumps())
    value["version"] = 2
    for entry in value["materialized"]:
        assert entry.pop("offset") == 0
    return KeyedStateHandle.from_json(value)


def legacy_version_1(handle: KeyedStateHandle) -> dict[str, Any]:
    """``handle`` as a version-1 writer wrote it: no hash, one chunk per file (no offset)."""
    legacy = json.loads(handle.dumps())
    legacy["version"] = 1
    for entry in legacy["materialized"]:
        assert entry.pop("offset") == 0
        del entry["sha256"]
    return legacy


def test_a_chunk_replaced_by_a_chunk_of_other_key_groups_is_refused(world: World) -> None:
    keys = keys_by_group()
    values = {key: 100 + kg for kg, key in keys.items()}
    _, packed = materialized_handle(world, values)
    handle = whole_files(packed)
    chunk_path(world, handle, 0).write_bytes(chunk_path(world, handle, 1).read_bytes())
    with pytest.raises(CorruptDataError) as info:
        world.restored(handle)
    assert str(chunk_path(world, handle, 0).relative_to(world.dfs)) in str(info.value)
    assert "key groups" in str(info.value)


def test_a_chunk_replaced_by_an_older_chunk_of_the_same_key_groups_is_refused(world: World) -> None:
    keys = keys_by_group()
    b, old_handle = materialized_handle(world, {key: 1 for key in keys.values()})
    old_bytes = chunk_path(world, old_handle, 2).read_bytes()
    write(b, {keys[2]: 2})
    world.materialize(b)
    handle = whole_files(world.checkpoint(b))
    assert read(world.restored(handle), [keys[2]]) == {keys[2]: 2}
    chunk_path(world, handle, 2).write_bytes(old_bytes)
    with pytest.raises(CorruptDataError, match="sqn"):
        world.restored(handle)


def test_a_version_1_handle_is_checked_on_what_it_records(world: World) -> None:
    """Handles written before the hash existed: key groups, SQN, size and entries still bind."""
    keys = keys_by_group()
    _, handle = materialized_handle(world, {key: 7 for key in keys.values()})
    old = KeyedStateHandle.from_json(legacy_version_1(handle))
    assert read(world.restored(old), list(keys.values())) == {key: 7 for key in keys.values()}
    chunk_path(world, handle, 3).write_bytes(chunk_path(world, handle, 1).read_bytes())
    with pytest.raises(CorruptDataError, match="key groups"):
        world.restored(old)


def test_a_version_2_handle_without_a_hash_is_refused(world: World) -> None:
    keys = keys_by_group()
    _, handle = materialized_handle(world, {key: 7 for key in keys.values()})
    value: dict[str, Any] = handle.to_json()
    del value["materialized"][0]["sha256"]
    with pytest.raises(StateRestoreError, match="sha256"):
        KeyedStateHandle.from_json(value)


def test_a_chunk_whose_bytes_differ_from_the_recorded_hash_is_refused(world: World) -> None:
    """Same key groups, SQN, size and entry count, other bytes: only the hash can tell."""
    keys = keys_by_group()
    _, handle = materialized_handle(world, {key: 7 for key in keys.values()})
    value: dict[str, Any] = handle.to_json()
    value["materialized"][0]["sha256"] = "0" * 64
    forged = KeyedStateHandle.from_json(value)
    with pytest.raises(CorruptDataError, match="sha256"):
        world.restored(forged)


def test_restoring_a_version_1_handle_records_the_hash_of_the_chunks_it_checked(world: World) -> None:
    """Later snapshots carry the restored chunks: they must be version-2 entries, hash included."""
    keys = keys_by_group()
    _, handle = materialized_handle(world, {key: 7 for key in keys.values()})
    b = world.restored(KeyedStateHandle.from_json(legacy_version_1(handle)))
    again = world.checkpoint(b)
    assert again.to_json()["version"] == 2  # no offsets: a reader of version 2 still reads it
    assert [c["sha256"] for c in again.materialized] == [c["sha256"] for c in handle.materialized]


def test_a_materialization_packs_its_chunks_into_one_file_and_a_restore_reads_each_by_its_range(
    world: World,
) -> None:
    keys = keys_by_group()
    values = {key: 100 + kg for kg, key in keys.items()}
    _, handle = materialized_handle(world, values, pack_bytes=1 << 20)
    assert len({c["path"] for c in handle.materialized}) == 1
    assert sorted(c["offset"] for c in handle.materialized) == [
        sum(c["size"] for c in handle.materialized[:i]) for i in range(len(handle.materialized))
    ]
    assert handle.to_json()["version"] == 3
    assert read(world.restored(handle), list(keys.values())) == values


def test_a_materialized_chunk_has_blocks_and_a_key_is_read_from_its_pack_by_ranges(world: World) -> None:
    """What the lazy restore does: a chunk's tail with one ranged read of its pack, then a key's blocks."""
    keys = keys_by_group()
    values = {key: 100 + kg for kg, key in keys.items()}
    _, handle = materialized_handle(world, values, pack_bytes=1 << 20)
    pack = (world.dfs / str(handle.materialized[0]["path"])).read_bytes()
    for entry in handle.materialized:
        start, size = entry["offset"], entry["size"]
        reads: list[tuple[int, int]] = []

        def read(offset: int, length: int, start: int = start, reads: list[tuple[int, int]] = reads) -> bytes:
            reads.append((start + offset, length))
            return pack[start + offset : start + offset + length]

        index = read_chunk_index(str(entry["path"]), size, read)
        assert len(reads) == 1 and index.version == 2
        assert (index.key_groups.to_json(), index.sqn, index.entries) == (
            entry["key_groups"],
            entry["sqn"],
            entry["entries"],
        )
        whole = decode_chunk(str(entry["path"]), pack[start : start + size]).sections
        for section in index.sections:
            found = []
            for block in section.blocks_for(key_group_prefix(entry["key_groups"][0])):
                found += index.decode_block(read(block.offset, block.length), block)
            assert found == whole[section.name] and found


def test_a_pack_entry_pointing_at_another_chunk_of_its_pack_is_refused(world: World) -> None:
    keys = keys_by_group()
    _, handle = materialized_handle(world, {key: 100 + kg for kg, key in keys.items()}, pack_bytes=1 << 20)
    value: dict[str, Any] = handle.to_json()
    first, second = value["materialized"][:2]
    first["offset"], first["size"] = second["offset"], second["size"]
    with pytest.raises(CorruptDataError, match="key groups"):
        world.restored(KeyedStateHandle.from_json(value))


def test_a_pack_entry_reaching_past_the_end_of_its_file_is_refused(world: World) -> None:
    keys = keys_by_group()
    _, handle = materialized_handle(world, {key: 100 + kg for kg, key in keys.items()}, pack_bytes=1 << 20)
    value: dict[str, Any] = handle.to_json()
    value["materialized"][-1]["offset"] += 10
    with pytest.raises(CorruptDataError):
        world.restored(KeyedStateHandle.from_json(value))


@pytest.mark.parametrize("offset", [-1, "0", 1.5, None])
def test_a_malformed_offset_is_refused_by_name(world: World, offset: object) -> None:
    keys = keys_by_group()
    _, handle = materialized_handle(world, {key: 7 for key in keys.values()}, pack_bytes=1 << 20)
    value: dict[str, Any] = handle.to_json()
    value["materialized"][0]["offset"] = offset
    with pytest.raises(StateRestoreError, match="offset"):
        KeyedStateHandle.from_json(value)


def test_an_offset_in_a_handle_older_than_packs_is_refused(world: World) -> None:
    keys = keys_by_group()
    _, handle = materialized_handle(world, {key: 7 for key in keys.values()}, pack_bytes=1 << 20)
    value: dict[str, Any] = handle.to_json()
    value["version"] = 2
    with pytest.raises(StateRestoreError, match="offset"):
        KeyedStateHandle.from_json(value)


def test_state_adopted_from_a_version_1_handle_materializes_into_a_readable_handle(world: World) -> None:
    """A Spark worker adopting local tables whose record is a version-1 handle (no hashes) and
    materializing incrementally: the unhashed chunks are rewritten, not mixed with packed ones."""
    keys = keys_by_group()
    values = {key: 100 + kg for kg, key in keys.items()}
    a, handle = materialized_handle(world, values)
    directory = world.tmp / "local-0"
    a.close()
    world.backends.remove(a)
    b = ChangelogKeyedStateBackend(
        "op", FULL, directory, storage=world.storage, max_parallelism=MAX_P, reuse_local=True
    )
    world.backends.append(b)
    b.adopt_local(KeyedStateHandle.from_json(legacy_version_1(handle)))
    write(b, {keys[0]: 1})  # one key group changes; the others are clean
    values[keys[0]] = 1
    world.materialize(b, pack_bytes=1 << 20)
    again = world.checkpoint(b)  # read back from JSON: it must be a valid handle
    assert again.to_json()["version"] == 3 and all("sha256" in c for c in again.materialized)
    assert read(world.restored(again), list(keys.values())) == values
