"""A state whose schema changed, materialized: the older version's table goes into the chunks
under its own name as any table, and a restore from them (at any parallelism) reads the old
values converted and the new ones as written (``backend.state.versions``)."""

from __future__ import annotations

import copy
from typing import Any

from backend.core import records as rec
from backend.core.descriptors import ListStateDescriptor, MapStateDescriptor, StateTtl, ValueStateDescriptor
from backend.core.handles import KeyedStateHandle, read_chunk
from backend.core.serializers import (
    Float64Serializer,
    Int64Serializer,
    OptionalSerializer,
    RowSerializer,
    StrSerializer,
)
from backend.state import versions
from materializer.chunks import chunk_info
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer
from tests.materializer.backends import (
    NEVER,
    WAIT_S,
    Env,
    GatedUpload,
    checkpoint,
    first_keys_in_key_group,
    materialize,
    owner,
    stored_count,
)

OLD = ValueStateDescriptor("acc", RowSerializer([("total", OptionalSerializer(Int64Serializer()))]))
NEW = ValueStateDescriptor(
    "acc",
    RowSerializer([("n", OptionalSerializer(Int64Serializer())), ("total", OptionalSerializer(Float64Serializer()))]),
)
OPTIONS = MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None)


def test_a_materialized_checkpoint_after_a_change_restores_both_versions(env: Env) -> None:
    b = env.backends.new()
    m = PeriodicMaterializer(b, OPTIONS)
    for k in range(100):
        b.set_current_key(k)
        b.get_state(OLD).update((k,))
    materialize(m)
    first = checkpoint(b, 1)
    m.close()

    (changed,) = env.backends.restored(first, 1)
    state = changed.get_state(NEW)
    expected: dict[int, Any] = {k: (None, float(k)) for k in range(100)}
    for k in range(0, 100, 3):
        changed.set_current_key(k)
        state.update((k, -1.0))
        expected[k] = (k, -1.0)
    for k in range(1, 100, 3):
        changed.set_current_key(k)
        state.clear()
        expected[k] = None
    m = PeriodicMaterializer(changed, OPTIONS)
    materialize(m)
    second = checkpoint(changed, 2)
    m.close()
    assert second.materialized  # the changes before it are in its chunks, not in the log after it
    assert second.states["acc"]["version"] == 1

    for parallelism in (1, 3):
        subtasks = env.backends.restored(second, parallelism)
        for k, value in expected.items():
            assert owner(subtasks, k).get_state(NEW).value() == value, (parallelism, k)


# -- folding: a full materialization writes the older versions' entries in today's schema ----------

OLD_ROW = RowSerializer([("total", OptionalSerializer(Int64Serializer()))])
NEW_ROW = RowSerializer(
    [("n", OptionalSerializer(Int64Serializer())), ("total", OptionalSerializer(Float64Serializer()))]
)
KINDS = ("value", "list", "map")
TTL_MS = 10**12  # never expires in a test


def descriptors(schema: RowSerializer) -> dict[str, Any]:
    return {
        "value": ValueStateDescriptor("v", schema, ttl=StateTtl(TTL_MS)),
        "list": ListStateDescriptor("l", schema),
        "map": MapStateDescriptor("m", schema, user_key_serializer=StrSerializer()),
    }


OLD_STATES, NEW_STATES = descriptors(OLD_ROW), descriptors(NEW_ROW)
OLDER_TABLES = {"v", "l", "m"}  # version 0 of each: the table named after the state
KEYS = range(60)


def write_old(b: Any, model: dict[str, dict[int, Any]]) -> None:
    for k in KEYS:
        b.set_current_key(k)
        b.get_state(OLD_STATES["value"]).update((k,))
        b.get_state(OLD_STATES["list"]).update([(k,), (k + 1,)])
        b.get_state(OLD_STATES["map"]).put_all({"a": (k,), "b": (-k,)})
        model["value"][k] = (None, float(k))
        model["list"][k] = [(None, float(k)), (None, float(k + 1))]
        model["map"][k] = {"a": (None, float(k)), "b": (None, float(-k))}


def change_new(b: Any, model: dict[str, dict[int, Any]], keys: Any, tag: int) -> None:
    """Writes, clears and appends under the new schema on ``keys`` (some keys migrate)."""
    for k in keys:
        b.set_current_key(k)
        if k % 3 == 0:
            b.get_state(NEW_STATES["value"]).update((tag, -1.0))
            model["value"][k] = (tag, -1.0)
            b.get_state(NEW_STATES["list"]).add((tag, 0.5))
            model["list"][k] = [*model["list"].get(k, []), (tag, 0.5)]
            b.get_state(NEW_STATES["map"]).put("c", (tag, 2.0))
            model["map"][k] = {**model["map"].get(k, {}), "c": (tag, 2.0)}
        elif k % 3 == 1:
            b.get_state(NEW_STATES["value"]).clear()
            model["value"].pop(k, None)
            b.get_state(NEW_STATES["list"]).clear()
            model["list"].pop(k, None)
            b.get_state(NEW_STATES["map"]).remove("a")
            rest = {u: v for u, v in model["map"].get(k, {}).items() if u != "a"}
            model["map"].pop(k, None)
            if rest:
                model["map"][k] = rest


def assert_reads(subtasks: list[Any], model: dict[str, dict[int, Any]]) -> None:
    for k in KEYS:
        b = owner(subtasks, k)
        assert b.get_state(NEW_STATES["value"]).value() == model["value"].get(k), k
        assert b.get_state(NEW_STATES["list"]).get() == model["list"].get(k, []), k
        assert dict(b.get_state(NEW_STATES["map"]).items()) == model["map"].get(k, {}), k


def referenced(env: Env, handle: KeyedStateHandle) -> tuple[set[str], set[int]]:
    """The tables the handle's chunks hold sections of, and the state ids its log records name."""
    sections: set[str] = set()
    for chunk in handle.materialized:
        data = read_chunk(env.storage.files, dict(chunk))
        sections |= {s.name for s in chunk_info(str(chunk["path"]), data).sections if s.count}
    sids: set[int] = set()
    for entry in handle.changelog:
        for _, data in env.storage.read(entry.log, entry.key_groups):
            sids.add(rec.parse_record(data)[1])
    return sections, sids


def restored_from_old_checkpoint(env: Env) -> tuple[Any, KeyedStateHandle, dict[str, dict[int, Any]]]:
    """A backend restored from a fully materialized checkpoint of the old schema (nothing in its
    log: a materialization after the restore would be incremental), with the new one registered."""
    model: dict[str, dict[int, Any]] = {kind: {} for kind in KINDS}
    b = env.backends.new()
    m = PeriodicMaterializer(b, OPTIONS)
    write_old(b, model)
    materialize(m)
    first = checkpoint(b, 1)
    m.close()
    env.backends.close(b)
    (changed,) = env.backends.restored(first, 1)
    for kind in KINDS:
        changed.get_state(NEW_STATES[kind])
    return changed, first, model


def test_one_full_materialization_folds_the_older_versions(env: Env) -> None:
    changed, _, model = restored_from_old_checkpoint(env)
    assert changed.state_metadata()["v"]["version"] == 1
    # a few keys of one key group change: an incremental materialization would re-reference the rest
    change_new(changed, model, first_keys_in_key_group(5, 6), tag=1)
    m = PeriodicMaterializer(changed, OPTIONS)
    materialize(m)
    second = checkpoint(changed, 2)
    m.close()

    for kind, name in (("value", "v"), ("list", "l"), ("map", "m")):
        meta = second.states[name]
        assert "older" not in meta, meta
        assert meta["version"] == 1 and meta["serializer"] == NEW_STATES[kind].serializer.id
    sections, sids = referenced(env, second)
    assert sections == {"v~1", "l~1", "m~1"}
    assert not sids & {rec.state_id(name) for name in OLDER_TABLES}
    assert_reads([changed], model)  # the live backend reads its folded tables
    assert stored_count([changed], "v") == stored_count([changed], "l") == stored_count([changed], "m") == 0

    for parallelism in (1, 3):
        subtasks = env.backends.restored(second, parallelism)
        for b in subtasks:  # nothing of the old schema is known to the restored backends
            assert set(versions.tables_of(b.state_metadata())) == {"v~1", "l~1", "m~1"}
        assert_reads(subtasks, model)
        for b in subtasks:
            env.backends.close(b)


def test_changes_while_the_folding_materialization_uploads(env: Env) -> None:
    """The keys migrated between its cut and its end log changes of the older versions: snapshots
    taken meanwhile and after it restore, and the next materialization forgets the older versions."""
    changed, _, model = restored_from_old_checkpoint(env)
    gate = GatedUpload(env.storage)
    m = PeriodicMaterializer(changed, OPTIONS, upload=gate)
    gate.gate.clear()
    assert m.trigger()
    assert gate.blocked.wait(WAIT_S)
    change_new(changed, model, range(0, 30), tag=2)
    during = checkpoint(changed, 2)  # the previous chunks and the log
    expected = [(during, copy.deepcopy(model))]
    gate.gate.set()
    m.wait(WAIT_S)
    assert m.in_flight is None
    change_new(changed, model, range(30, 45), tag=3)
    after = checkpoint(changed, 3)
    expected.append((after, model))
    sections, _ = referenced(env, after)
    assert sections == {"v~1", "l~1", "m~1"}
    for name in ("v", "l", "m"):  # the older versions are named by its log only: listed, never read
        older = after.states[name]["older"]
        assert older and all(old.get("dropped") for old in older), after.states[name]
    for handle, then in expected:
        for parallelism in (1, 3):
            subtasks = env.backends.restored(handle, parallelism)
            assert_reads(subtasks, then)
            for b in subtasks:
                env.backends.close(b)

    change_new(changed, model, range(45, 60), tag=4)
    materialize(m)
    last = checkpoint(changed, 4)
    m.close()
    assert all("older" not in last.states[name] for name in ("v", "l", "m")), last.states
    sections, sids = referenced(env, last)
    assert sections == {"v~1", "l~1", "m~1"} and not sids & {rec.state_id(name) for name in OLDER_TABLES}
    subtasks = env.backends.restored(last, 2)
    assert_reads(subtasks, model)


def test_subtasks_that_folded_and_that_did_not_restore_together(env: Env) -> None:
    """One subtask folded while its keys changed (its older versions listed as dropped), the other
    did not materialize (its older versions live): a restore of both at another parallelism reads
    the old values of the one and the folded values of the other."""
    _, first, model = restored_from_old_checkpoint(env)
    folded, kept = env.backends.restored(first, 2)
    for b in (folded, kept):
        for kind in KINDS:
            b.get_state(NEW_STATES[kind])
    gate = GatedUpload(env.storage)
    m = PeriodicMaterializer(folded, OPTIONS, upload=gate)
    gate.gate.clear()
    assert m.trigger()
    assert gate.blocked.wait(WAIT_S)
    owned = [k for k in KEYS if owner([folded, kept], k) is folded]
    change_new(folded, model, owned[:10], tag=5)
    folded.flush()  # logs the migrated keys' CLEARs of older entries after the cut
    gate.gate.set()
    m.wait(WAIT_S)
    m.close()
    assert all(old.get("dropped") for old in folded.state_metadata()["v"]["older"])
    assert not any(old.get("dropped") for old in kept.state_metadata()["v"]["older"])
    handles = [checkpoint(b, 2) for b in (folded, kept)]
    for parallelism in (1, 3):
        subtasks = env.backends.restored_all(handles, parallelism)
        assert_reads(subtasks, model)
        for b in subtasks:
            env.backends.close(b)
