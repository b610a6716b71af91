"""The errors a restore must raise instead of silently misreading state."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from backend.core import records as rec
from backend.core.descriptors import ListStateDescriptor, MapStateDescriptor, StateTtl, ValueStateDescriptor
from backend.core.errors import SchemaEvolutionError, StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.records import Op
from backend.core.serializers import Int64Serializer, JsonSerializer, StrSerializer
from backend.core.tablekeys import ckey
from dstl import CorruptChangelogError, KeyGroupRange
from dstl.format import FILE_HEADER, SEGMENT_HEADER
from tests.backend.state.support import LIST, MAP, POOL, VALUE, Env, populate


@pytest.fixture
def handle(env: Env) -> KeyedStateHandle:
    b = env.backend()
    populate([b])
    (h,) = env.checkpoint(b)
    return h


def test_restore_of_another_operator_is_refused(env: Env, handle: KeyedStateHandle) -> None:
    b = env.backend(operator_id="other-op")
    with pytest.raises(StateRestoreError, match="other-op"):
        b.restore([handle])


def test_restore_at_another_max_parallelism_is_refused(env: Env, handle: KeyedStateHandle) -> None:
    b = env.backend(KeyGroupRange(0, 63), max_parallelism=64)
    with pytest.raises(StateRestoreError, match="max parallelism"):
        b.restore([handle])


def test_restore_of_a_corrupted_log_file_names_the_file(env: Env, handle: KeyedStateHandle) -> None:
    files = sorted(p for p in env.dfs.rglob("*") if p.is_file())
    assert files
    for path in files:  # flip the first byte of the first segment's compressed changes
        data = bytearray(path.read_bytes())
        data[FILE_HEADER.size + SEGMENT_HEADER.size] ^= 0x5A
        path.write_bytes(bytes(data))

    b = env.backend()
    with pytest.raises(CorruptChangelogError) as info:
        b.restore([handle])
    names = {path.relative_to(env.dfs).as_posix() for path in files}
    assert info.value.path in names
    assert info.value.path in str(info.value)


@pytest.mark.parametrize(
    "record",
    [
        b"\x01",
        rec.record_prefix(Op.PUT, rec.state_id(MAP.name)) + b"\x00\x05\xff\xff",
        rec.record(Op.PUT, rec.state_id(MAP.name), ckey(0, b"k"), b"\x00\x09"),
        rec.record(Op.SET, rec.state_id(VALUE.name), ckey(0, b"k" * 600), b"\x00" * 8),
        rec.encode_set_column(rec.state_id(VALUE.name), [ckey(0, b"k" * 600)], b"\x00" * 8, 8),
        rec.encode_set_column(rec.state_id(VALUE.name), [ckey(0, b"k")], b"\x00" * 8, 8)[:-1],
    ],
    ids=[
        "truncated-head",
        "key-longer-than-record",
        "map-entry-user-key-longer-than-record",
        "key-longer-than-lmdb-takes",
        "column-key-longer-than-lmdb-takes",
        "truncated-column",
    ],
)
def test_restore_of_a_malformed_change_record_names_the_log_file(env: Env, record: bytes) -> None:
    """A record the writer framed and checksummed but that does not parse: the segment is intact,
    so the error comes from the replay, and it names the log file as a reader's error would."""
    b = env.backend()
    populate([b])
    assert b.writer is not None
    b.writer.append(0, record)
    (handle,) = env.checkpoint(b)

    fresh = env.backend()
    with pytest.raises(CorruptChangelogError, match="malformed change record") as info:
        fresh.restore([handle])
    names = {path.relative_to(env.dfs).as_posix() for path in env.dfs.rglob("*") if path.is_file()}
    assert info.value.path in names
    assert info.value.path in str(info.value)


def _mutated(handle: KeyedStateHandle, change: Callable[[dict[str, Any]], None]) -> str:
    value = handle.to_json()
    change(value)
    return json.dumps(value)


@pytest.mark.parametrize(
    "change",
    [
        lambda v: v.update(version=99),
        lambda v: v.pop("operator_id"),
        lambda v: v.update(max_parallelism="128"),
        lambda v: v.update(key_group_range=[0, 1 << 20]),
        lambda v: v.update(states=["value"]),
        lambda v: v.update(changelog={"log": 1}),
        lambda v: v["changelog"].__setitem__(0, "not an entry"),
        lambda v: v["changelog"].__setitem__(0, {"unknown": 1}),
    ],
    ids=[
        "version",
        "no-operator",
        "max-parallelism-type",
        "key-group-range",
        "states",
        "changelog-type",
        "changelog-entry-type",
        "changelog-entry-fields",
    ],
)
def test_malformed_handle_json_raises_state_restore_error(
    handle: KeyedStateHandle, change: Callable[[dict[str, Any]], None]
) -> None:
    with pytest.raises(StateRestoreError):
        KeyedStateHandle.loads(_mutated(handle, change))


@pytest.mark.parametrize("text", ["", "not json", "[]", "null", '{"version": 1}'])
def test_handle_text_that_is_no_handle_raises_state_restore_error(text: str) -> None:
    with pytest.raises(StateRestoreError):
        KeyedStateHandle.loads(text)


@pytest.mark.parametrize(
    ("registered", "error", "why"),
    [
        (ValueStateDescriptor(VALUE.name, StrSerializer()), SchemaEvolutionError, "not a widening"),
        (
            ValueStateDescriptor(VALUE.name, Int64Serializer(), ttl=StateTtl(10)),
            SchemaEvolutionError,
            "TTL cannot be added",
        ),
        (ListStateDescriptor(VALUE.name, Int64Serializer()), SchemaEvolutionError, "cannot change its kind"),
        (
            MapStateDescriptor(MAP.name, Int64Serializer(), user_key_serializer=JsonSerializer()),
            SchemaEvolutionError,
            "key schema cannot change",
        ),
        (ListStateDescriptor(LIST.name, Int64Serializer()), SchemaEvolutionError, "not a widening"),
    ],
    ids=["value-serializer", "value-ttl", "value-as-list", "map-user-key", "list-serializer"],
)
def test_registering_a_restored_state_incompatibly_raises(
    env: Env, handle: KeyedStateHandle, registered: Any, error: type[Exception], why: str
) -> None:
    b = env.backend()
    b.restore([handle])
    with pytest.raises(error, match=why) as info:
        b.get_state(registered)
    assert repr(registered.name) in str(info.value)
    # the compatible registrations still read the restored state
    key = POOL[5]
    b.set_current_key(key)
    assert b.get_state(VALUE).value() == 5
    assert dict(b.get_state(MAP).items()) == {"i": 5, "5": -5}
