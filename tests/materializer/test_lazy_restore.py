"""Lazy restore (``backend.state.lazy``): a lazily restored backend reads what an eagerly restored
one reads, for every state kind, before and after its hydration, at any parallelism; keys changed
before the hydration keep their changes; snapshots of a partly loaded backend restore; timers fire
without loading key groups; a batch's keys are loaded before its work; a materialization waits for
the hydration or forces it. The failure paths are in ``test_lazy_restore_failures``."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from backend.core.descriptors import MapStateDescriptor, StateTtl, ValueStateDescriptor
from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import key_group_ranges
from backend.core.serializers import Int64Serializer, StrSerializer
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from backend.state.lazy import PENDING_DB
from dstl import KeyGroupRange
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, restore
from tests.materializer.backends import (
    FULL,
    NEVER,
    WAIT_S,
    Env,
    assert_state_equals,
    checkpoint,
    materialize,
    model_keys,
    owner,
)
from tests.support.materializer_crash_child import (
    LIST,
    MAP,
    MAX_P,
    VALUE,
    Model,
    apply_to_backend,
    apply_to_model,
    batch_a,
    batch_b,
    batch_c,
)

B = ChangelogKeyedStateBackend


def materializer(b: B, chunk_key_groups: int = 1) -> PeriodicMaterializer:
    options = MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=chunk_key_groups)
    return PeriodicMaterializer(b, options)


def checkpoint_1(env: Env, chunk_key_groups: int = 1) -> tuple[KeyedStateHandle, Model]:
    """Batch A materialized (chunks of ``chunk_key_groups`` key groups), batch B in the log: the
    state of checkpoint 1 and its model."""
    b = env.backends.new()
    m = materializer(b, chunk_key_groups)
    apply_to_backend(b, batch_a())
    materialize(m)
    apply_to_backend(b, batch_b())
    handle = checkpoint(b, 1)
    m.close()
    env.backends.close(b)
    return KeyedStateHandle.loads(handle.dumps()), apply_to_model(apply_to_model(Model(), batch_a()), batch_b())


def lazily_restored(env: Env, handles: list[KeyedStateHandle], parallelism: int) -> list[B]:
    subtasks = [env.backends.new(rng) for rng in key_group_ranges(MAX_P, parallelism)]
    for b in subtasks:
        restore(b, handles, mode="lazy")
    return subtasks


def stored_keys(b: B, name: str) -> int:
    return len(list(b.tables.scan_prefix(b.tables.database(name), b"")))


@pytest.mark.parametrize("parallelism", [1, 3])
def test_a_lazy_restore_reads_what_the_checkpoint_holds_before_any_hydration(env: Env, parallelism: int) -> None:
    handle, model = checkpoint_1(env)
    subtasks = lazily_restored(env, [handle], parallelism)
    assert not any(b.fully_local for b in subtasks)
    assert all(stored_keys(b, VALUE.name) == 0 for b in subtasks)  # nothing of the states loaded yet
    assert_state_equals(subtasks, model, model_keys(model))
    # a key the checkpoint does not hold reads empty, and loading it wrote nothing
    b = owner(subtasks, 10_000)
    assert b.get_state(VALUE).value() is None and b.get_state(LIST).get() == []


@pytest.mark.parametrize("parallelism", [1, 3])
def test_hydration_loads_every_key_group_and_ends_the_lazy_mode(env: Env, parallelism: int) -> None:
    handle, model = checkpoint_1(env)
    subtasks = lazily_restored(env, [handle], parallelism)
    for b in subtasks:
        steps = 0
        while not b.fully_local:
            assert b.hydrate_step(5) > 0
            steps += 1
        assert steps > 1
        assert "set_current_key" not in vars(b)  # the hot path is the class's again
        assert not b.tables.holds_database(PENDING_DB)
        assert b.hydrate_step(5) == 0
    assert_state_equals(subtasks, model, model_keys(model))


def test_a_key_changed_before_the_hydration_keeps_its_change(env: Env) -> None:
    handle, model = checkpoint_1(env)
    (b,) = lazily_restored(env, [handle], 1)
    apply_to_backend(b, batch_c())  # loads and changes every third key
    b.flush()
    b.hydrate()
    assert b.fully_local
    assert_state_equals([b], apply_to_model(model, batch_c()), model_keys(model))


def test_a_partly_loaded_backend_snapshots_the_chunks_and_logs_it_did_not_load(env: Env) -> None:
    handle, model = checkpoint_1(env)
    (b,) = lazily_restored(env, [handle], 1)
    apply_to_backend(b, batch_c()[:20])
    b.hydrate_step(7)
    assert not b.fully_local
    second = checkpoint(b, 2)
    assert second.materialized == handle.materialized  # referenced again, nothing uploaded
    model = apply_to_model(model, batch_c()[:20])
    for parallelism in (1, 2):
        assert_state_equals(env.backends.restored(second, parallelism), model, model_keys(model))
        assert_state_equals(lazily_restored(env, [second], parallelism), model, model_keys(model))


def test_a_rescale_of_a_lazily_restored_checkpoint_is_lazy_too(env: Env) -> None:
    handle, model = checkpoint_1(env)
    subtasks = lazily_restored(env, [handle], 2)
    handles = []
    for i, b in enumerate(subtasks):
        apply_to_backend(b, [op for op in batch_c() if b.key_group_of(op[0]) in b.key_group_range])
        handles.append(checkpoint(b, 2 + i))
    model = apply_to_model(model, batch_c())
    assert_state_equals(lazily_restored(env, handles, 3), model, model_keys(model))


def test_a_log_only_checkpoint_restores_lazily(env: Env) -> None:
    b = env.backends.new()
    apply_to_backend(b, batch_a()[:50])
    handle = checkpoint(b, 1)
    env.backends.close(b)
    model = apply_to_model(Model(), batch_a()[:50])
    (lazy,) = lazily_restored(env, [handle], 1)
    assert not lazy.fully_local
    assert_state_equals([lazy], model, model_keys(model))


def test_ttl_states_read_the_same_lazily(env: Env) -> None:
    now = [1_000]
    ttl = StateTtl(ttl_ms=500)
    value = ValueStateDescriptor("v-ttl", Int64Serializer(), ttl=ttl)
    entries = MapStateDescriptor("m-ttl", Int64Serializer(), user_key_serializer=StrSerializer(), ttl=ttl)

    def new(rng: KeyGroupRange = FULL) -> B:
        return env.backends.new(rng, clock=lambda: now[0])

    b = new()
    m = materializer(b)
    for key in range(40):
        b.set_current_key(key)
        b.get_state(value).update(key)
        b.get_state(entries).put("a", key)
    materialize(m)
    now[0] = 1_300
    for key in range(0, 40, 2):  # refreshed: these outlive the others
        b.set_current_key(key)
        b.get_state(value).update(-key)
        b.get_state(entries).put("b", key)
    handle = checkpoint(b, 1)
    m.close()
    now[0] = 1_600  # the first writes expired, the refreshed ones not

    def read(subtasks: list[B]) -> dict[int, Any]:
        out = {}
        for key in range(40):
            s = owner(subtasks, key)
            out[key] = (s.get_state(value).value(), dict(s.get_state(entries).items()))
        return out

    eager = [new(rng) for rng in key_group_ranges(MAX_P, 2)]
    for s in eager:
        restore(s, [handle])
    lazy = [new(rng) for rng in key_group_ranges(MAX_P, 2)]
    for s in lazy:
        restore(s, [handle], mode="lazy")
    expected = read(eager)
    assert expected[2] == (-2, {"b": 2}) and expected[1] == (None, {})
    assert read(lazy) == expected


def test_due_timers_fire_without_loading_any_other_key(env: Env) -> None:
    b = env.backends.new()
    m = materializer(b)
    apply_to_backend(b, batch_a())
    for key in range(0, 200, 10):
        b.set_current_key(key)
        b.register_event_time_timer(100 + key)
    materialize(m)
    for key in range(5, 200, 10):  # timers in the log only
        b.set_current_key(key)
        b.register_event_time_timer(100 + key)
    handle = checkpoint(b, 1)
    m.close()
    (lazy,) = lazily_restored(env, [handle], 1)
    fired: list[tuple[Any, int, int | None]] = []
    value = lazy.get_state(VALUE)

    def on_timer(key: Any, ts: int) -> None:
        fired.append((key, ts, value.value()))

    assert lazy.advance_watermark(100 + 50, on_timer) == 11
    assert [(k, ts) for k, ts, _ in fired] == [(k, 100 + k) for k in range(0, 51, 5)]
    assert all(v == k for k, _, v in fired)  # the timer's key was loaded, with its state
    assert stored_keys(lazy, VALUE.name) == 11  # and no other key
    assert not lazy.fully_local


def test_a_batch_loads_its_keys_before_its_work_runs(env: Env) -> None:
    handle, model = checkpoint_1(env)
    (b,) = lazily_restored(env, [handle], 1)
    keys = list(range(0, 200, 4))
    with b.batch(keys):
        loaded = stored_keys(b, VALUE.name)
        for key in keys:
            b.set_current_key(key)
            assert b.get_state(VALUE).value() == model.value.get(key)
        assert stored_keys(b, VALUE.name) == loaded  # the work loaded nothing more
    assert loaded == sum(1 for key in keys if key in model.value)
    assert_state_equals([b], model, model_keys(model))


def test_a_batch_on_a_local_directory_reads_on_its_own_thread_not_behind_the_read_ahead(env: Env) -> None:
    """A local directory reads one at a time (``parallel_reads`` 1): the reader pool has one thread,
    which the hydration's read-ahead may keep busy; a batch's reads (of many chunks) run on the
    batch's thread and do not wait for it. Here the pool's thread is held until the batch is done."""
    assert env.storage.files.parallel_reads == 1
    handle, model = checkpoint_1(env)
    (b,) = lazily_restored(env, [handle], 1)
    lazy = b._lazy
    assert lazy is not None
    release = threading.Event()
    held = lazy.reader.pool().submit(release.wait, 60)  # bounded: a batch that queued fails, not hangs
    keys = list(range(0, 200, 3))  # keys of every key group: a read of each of their chunks
    try:
        with b.batch(keys):
            for key in keys:
                b.set_current_key(key)
                assert b.get_state(VALUE).value() == model.value.get(key)
        assert not held.done()  # the pool's thread was busy throughout
    finally:
        release.set()
        held.result(60)


def test_materialization_waits_for_the_hydration_or_forces_it(env: Env) -> None:
    handle, model = checkpoint_1(env)
    (b,) = lazily_restored(env, [handle], 1)
    m = materializer(b)
    apply_to_backend(b, batch_c()[:5])
    assert b.begin_materialization() is None  # not everything is local
    assert not m.poll() and not b.fully_local
    materialize(m)  # trigger hydrates everything first
    assert b.fully_local
    third = checkpoint(b, 3)
    assert not third.changelog or all(e.log.log_id == b.writer.log_id for e in third.changelog)  # type: ignore[union-attr]
    m.close()
    model = apply_to_model(model, batch_c()[:5])
    assert_state_equals(env.backends.restored(third, 2), model, model_keys(model))


def test_a_no_claim_restore_materializes_fully_before_the_first_snapshot(env: Env) -> None:
    handle, model = checkpoint_1(env)
    (b,) = lazily_restored(env, [handle], 1)
    b.disown_restored()
    assert b.needs_full_materialization
    with pytest.raises(StateRestoreError, match="materialize it fully"):
        b.snapshot(2)
    m = materializer(b)
    m.poll()  # waits for the hydration: nothing started
    assert m.in_flight is None
    materialize(m)
    assert b.fully_local and not b.needs_full_materialization
    second = checkpoint(b, 2)
    m.close()
    assert {c["path"] for c in second.materialized}.isdisjoint(c["path"] for c in handle.materialized)
    assert_state_equals(env.backends.restored(second, 1), model, model_keys(model))


def test_delete_state_and_views_of_every_key_hydrate_first(env: Env) -> None:
    handle, model = checkpoint_1(env)
    (b,) = lazily_restored(env, [handle], 1)
    b.get_state(MAP)
    b.delete_state(MAP.name)
    assert b.fully_local
    assert stored_keys(b, MAP.name) == 0
    (c,) = lazily_restored(env, [handle], 1)
    txn, databases = c.consistent_view()
    try:
        assert txn.stat(databases[VALUE.name])["entries"] == len(model.value)
    finally:
        txn.abort()


def test_progress_counts_timers_and_kept_records(env: Env) -> None:
    handle, _ = checkpoint_1(env)
    b = env.backends.new()
    seen: list[int] = []
    count = restore(b, [handle], progress=seen.append, mode="lazy")
    assert count > 0 and seen and seen[-1] == count
    assert WAIT_S > 0


@pytest.mark.parametrize("name", ["checkpoint", "native_savepoint"])
def test_the_snapshots_of_an_earlier_release_restore_lazily(name: str, tmp_path: Path) -> None:
    """Version-1 chunks (one block per section) and handles without hashes, read key by key."""
    from backend.tools.inspect_state import open_snapshot
    from tests.test_fixtures_restore import ATTRS, COUNT, EVENTS, EXPECTED, FIXTURE, KEYS, MAX_PARALLELISM, UID

    copy = shutil.copytree(FIXTURE, tmp_path / "fixture")
    state = EXPECTED["state"]
    with open_snapshot(str(copy / EXPECTED["snapshots"][name])) as snapshot:
        for parallelism in (1, 3):
            subtasks = [
                ChangelogKeyedStateBackend(
                    UID,
                    rng,
                    tmp_path / f"local-{parallelism}-{rng.start}",
                    storage=None,
                    max_parallelism=MAX_PARALLELISM,
                    log_enabled=False,
                )
                for rng in key_group_ranges(MAX_PARALLELISM, parallelism)
            ]
            try:
                for b in subtasks:
                    restore(b, snapshot.handles(UID), source=snapshot.storage, mode="lazy")
                assert not any(b.fully_local for b in subtasks)
                for key in KEYS:
                    b = next(s for s in subtasks if s.key_group_of(key) in s.key_group_range)
                    b.set_current_key(key)
                    assert b.get_state(COUNT).value() == state["count"].get(key), key
                    assert b.get_state(EVENTS).get() == state["events"].get(key, []), key
                    assert dict(b.get_state(ATTRS).items()) == state["attrs"].get(key, {}), key
                for b in subtasks:
                    b.hydrate()
                    assert b.fully_local
            finally:
                for b in subtasks:
                    b.close()
