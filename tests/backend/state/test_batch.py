"""``ChangelogKeyedStateBackend.batch``: a unit of work that names its keys reads their state ahead,
and reads exactly what it would read without the batch.

The state machine (``test_state_machine``) runs every rule inside and outside batches against a
model; these tests pin the cases a batch could get wrong on its own: a spill inside the batch
(what was read ahead is older than the tables then), keys outside the batch, absent keys, keys
that are equal but of another type, bad keys, nesting; and for value state, whose batch keeps
its keys' current values (``value_table``): changes not yet in the tables when the batch starts,
and writes, checkpoints, spills and a deletion inside it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.core.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from backend.core.keygroups import assign_key_group
from backend.core.serializers import Int64Serializer, StrSerializer, serialize_key
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage

MAX_P = 128
VALUE = ValueStateDescriptor("value", Int64Serializer())
LIST = ListStateDescriptor("list", Int64Serializer())
MAP = MapStateDescriptor("map", Int64Serializer(), user_key_serializer=StrSerializer())
SUM = ReducingStateDescriptor("sum", Int64Serializer(), reduce=operator.add)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[ChangelogKeyedStateBackend]:
    storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs", persist_delay_ms=0))
    b = ChangelogKeyedStateBackend("op", KeyGroupRange(0, MAX_P - 1), tmp_path / "local", storage=storage)
    try:
        yield b
    finally:
        b.close()
        storage.close()


def write(b: ChangelogKeyedStateBackend, key: Any, value: int) -> None:
    b.set_current_key(key)
    b.get_state(VALUE).update(value)
    b.get_state(LIST).add(value)
    b.get_state(MAP).put("u", value)


def read(b: ChangelogKeyedStateBackend, key: Any) -> tuple[Any, Any, Any, Any]:
    b.set_current_key(key)
    m = b.get_state(MAP)
    return b.get_state(VALUE).value(), b.get_state(LIST).get(), m.get("u"), list(m.items())


def stored(b: ChangelogKeyedStateBackend, values: dict[Any, int]) -> None:
    for key, value in values.items():
        write(b, key, value)
    b.flush()  # in LMDB: a batch reads them ahead


def test_a_batch_reads_what_the_tables_hold(backend: ChangelogKeyedStateBackend) -> None:
    stored(backend, {1: 10, "a": 20, (3, "x"): 30})
    outside = {key: read(backend, key) for key in (1, "a", (3, "x"), 99)}
    with backend.batch([1, "a", (3, "x"), 99]):  # 99 was never written
        assert {key: read(backend, key) for key in (1, "a", (3, "x"), 99)} == outside
    assert outside[99] == (None, [], None, [])


def test_a_batch_reads_the_changes_the_tables_do_not_hold_yet(backend: ChangelogKeyedStateBackend) -> None:
    """A key changed since the last spill is read from the write-back caches: a change not yet
    logged, and one logged by a checkpoint but not yet in LMDB."""
    stored(backend, {1: 10, 2: 20, 3: 30, 4: 40})
    value = backend.get_state(VALUE)
    for key, new in ((1, 11), (2, None)):
        backend.set_current_key(key)
        value.update(new)
    backend.snapshot(1).result(10)  # logged; the changes stay in memory until a spill
    for key, new in ((3, 33), (4, None), (1, 111)):
        backend.set_current_key(key)
        value.update(new)
    with backend.batch([1, 2, 3, 4, 5]):
        assert [read(backend, k)[0] for k in (1, 2, 3, 4, 5)] == [111, None, 33, None, None]


def test_value_reads_in_a_batch_follow_its_writes_through_checkpoints_and_spills(
    backend: ChangelogKeyedStateBackend,
) -> None:
    stored(backend, {1: 10, 2: 20})
    value, total = backend.get_state(VALUE), backend.get_state(SUM)
    with backend.batch([1, 2, 3]):
        backend.set_current_key(1)
        value.update(value.value() + 1)
        total.add(5)
        backend.snapshot(1).result(10)
        assert (value.value(), total.get()) == (11, 5)
        value.update(value.value() + 1)
        total.add(5)
        backend.flush()
        assert (value.value(), total.get()) == (12, 10)
        backend.set_current_key(2)
        value.clear()
        assert value.value() is None
        value.update(21)
        backend.flush()
        value.update(None)
        assert value.value() is None
        backend.set_current_key(3)
        value.update(30)
        assert value.value() == 30
    assert [read(backend, k)[0] for k in (1, 2, 3)] == [12, None, 30]


def test_a_state_deleted_inside_a_batch_reads_as_empty(backend: ChangelogKeyedStateBackend) -> None:
    stored(backend, {1: 10})
    with backend.batch([1]):
        backend.set_current_key(1)
        old = backend.get_state(VALUE)
        assert old.value() == 10
        backend.delete_state(VALUE.name)
        assert backend.get_state(VALUE).value() is None
        assert old.value() is None


def test_a_spill_inside_a_batch_is_seen_by_the_reads_after_it(backend: ChangelogKeyedStateBackend) -> None:
    stored(backend, {1: 10, 2: 20})
    with backend.batch([1, 2]):
        assert read(backend, 1)[0] == 10
        write(backend, 1, 11)
        backend.flush()  # the caches are empty now: the next read goes below them
        assert read(backend, 1) == (11, [10, 11], 11, [("u", 11)])
        backend.set_current_key(2)
        backend.get_state(VALUE).clear()
        backend.get_state(MAP).remove("u")
        backend.flush()
        assert read(backend, 2) == (None, [20], None, [])


def test_a_key_outside_the_batch_reads_the_tables(backend: ChangelogKeyedStateBackend) -> None:
    stored(backend, {1: 10, 2: 20})
    with backend.batch([1]):
        assert read(backend, 2) == (20, [20], 20, [("u", 20)])
        write(backend, 3, 30)
        assert read(backend, 3) == (30, [30], 30, [("u", 30)])


def test_keys_equal_to_a_batch_key_but_of_another_type_are_other_keys(backend: ChangelogKeyedStateBackend) -> None:
    write(backend, 1, 10)
    write(backend, True, 77)  # not in one dict literal with 1: it would replace it
    backend.flush()
    with backend.batch([1]):
        assert read(backend, True)[0] == 77  # True == 1 in a dict, not as a key
        backend.set_current_key(1)
        one = backend.current_ckey
        backend.set_current_key(True)
        assert backend.current_ckey != one and backend.current_key is True


def test_starting_a_batch_leaves_the_current_key(backend: ChangelogKeyedStateBackend) -> None:
    backend.set_current_key("k")
    before = backend.current_ckey, backend.current_kg, backend.current_key
    with backend.batch([1, 2, 3]):
        assert (backend.current_ckey, backend.current_kg, backend.current_key) == before


def test_a_key_of_another_subtask_fails_the_batch_as_it_fails_set_current_key(tmp_path: Path) -> None:
    storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs", persist_delay_ms=0))
    b = ChangelogKeyedStateBackend("op", KeyGroupRange(0, 63), tmp_path / "local", storage=storage)
    try:
        foreign = next(k for k in range(1000) if assign_key_group(serialize_key(k), MAX_P) >= 64)
        with pytest.raises(ValueError) as outside:
            b.set_current_key(foreign)
        with pytest.raises(ValueError) as inside, b.batch([foreign]):
            pass
        assert str(inside.value) == str(outside.value)
        with b.batch([]):  # the failed batch left nothing open
            pass
    finally:
        b.close()
        storage.close()


def test_batches_do_not_nest(backend: ChangelogKeyedStateBackend) -> None:
    with backend.batch([1]), pytest.raises(RuntimeError, match="nest"), backend.batch([2]):
        pass
    with backend.batch([2]):
        pass


def test_key_groups_computed_elsewhere_address_the_same_state(backend: ChangelogKeyedStateBackend) -> None:
    """Spark passes each key's key group (its SQL hash): the batch takes them as given."""
    backend.set_current_key_in_group(("k",), 5)
    backend.get_state(VALUE).update(42)
    backend.flush()
    with backend.batch([("k",)], key_groups=[5]):
        backend.set_current_key_in_group(("k",), 5)
        assert backend.get_state(VALUE).value() == 42


def test_a_key_of_another_subtask_among_ints_fails_the_batch_as_it_fails_set_current_key(tmp_path: Path) -> None:
    storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs", persist_delay_ms=0))
    b = ChangelogKeyedStateBackend("op", KeyGroupRange(0, 63), tmp_path / "local", storage=storage)
    try:
        mine = [k for k in range(1000) if assign_key_group(serialize_key(k), MAX_P) < 64][:50]
        foreign = next(k for k in range(1000) if assign_key_group(serialize_key(k), MAX_P) >= 64)
        with pytest.raises(ValueError) as outside:
            b.set_current_key(foreign)
        with pytest.raises(ValueError) as inside, b.batch([*mine, foreign]):
            pass
        assert str(inside.value) == str(outside.value)
    finally:
        b.close()
        storage.close()
