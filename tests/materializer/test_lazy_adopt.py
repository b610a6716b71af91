"""Adopting the local tables of a partly loaded lazy restore (``adopt_local``): a backend of another
process (Spark gives a subtask's next task to any Python worker of the host) continues the lazy
restore another left, from the handle of its last snapshot and the bookkeeping kept in the tables,
without reading the DFS. Every key reads what the state holds (keys loaded, keys not loaded, key
groups hydrated, keys with pending changes of the log), before and after the hydration ends, after
more changes and checkpoints, and after the first process was killed mid-way."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from backend.state.lazy import LOCAL_DB, PENDING_DB
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, adopt_local
from tests.materializer.backends import (
    FULL,
    NEVER,
    WAIT_S,
    Env,
    assert_state_equals,
    checkpoint,
    environment,
    materialize,
    model_keys,
    owner,
)
from tests.materializer.test_lazy_restore import checkpoint_1, lazily_restored
from tests.support.lazy_adopt_child import READ_KEYS
from tests.support.materializer_crash_child import (
    MAX_P,
    VALUE,
    Model,
    apply_to_backend,
    apply_to_model,
    batch_a,
    batch_c,
)
from tests.support.polling import wait_until

B = ChangelogKeyedStateBackend
PROJECT_ROOT = Path(__file__).resolve().parents[2]
#: keys a partly loaded backend read (and loaded) without changing them
LOADED = range(1, 230, 11)


def partly_loaded(env: Env, chunk_key_groups: int = 1) -> tuple[B, KeyedStateHandle, Model]:
    """A lazily restored backend that changed some keys, read others and hydrated some key groups,
    then snapshotted (checkpoint 2) and flushed, as a Spark task leaves it for the next one."""
    handle, model = checkpoint_1(env, chunk_key_groups)
    (b,) = lazily_restored(env, [handle], 1)
    apply_to_backend(b, batch_c()[:20])
    for key in LOADED:  # loaded, not changed
        owner([b], key).get_state(VALUE).value()
    b.hydrate_step(7)
    assert not b.fully_local
    second = checkpoint(b, 2)
    b.flush()
    assert second.materialized == handle.materialized  # the chunks of the key groups not hydrated
    return b, KeyedStateHandle.loads(second.dumps()), apply_to_model(model, batch_c()[:20])


def another_process(env: Env, b: B) -> B:
    """A backend over ``b``'s local tables, ``b`` closed: as a backend of another process."""
    directory = b.tables.path
    env.backends.close(b)
    again = B(b.operator_id, b.key_group_range, directory, storage=env.storage, max_parallelism=MAX_P, reuse_local=True)
    env.backends.open.append(again)
    return again


@contextlib.contextmanager
def dfs_away(env: Env) -> Iterator[None]:
    """The DFS out of reach: what runs meanwhile reads only the local tables."""
    dfs, aside = env.tmp / "dfs", env.tmp / "dfs-aside"
    os.rename(dfs, aside)
    try:
        yield
    finally:
        os.rename(aside, dfs)


def adopted_without_the_dfs(env: Env, b: B, handle: KeyedStateHandle, local_keys: Iterable[int]) -> None:
    """``adopt_local`` with the DFS out of reach: it reads nothing of it (the log and the timers are
    local, the chunks are read when their keys are first needed); nor do reads of ``local_keys``,
    which the first process loaded (or whose key groups it hydrated)."""
    with dfs_away(env):
        adopt_local(b, handle)
        for key in local_keys:
            owner([b], key).get_state(VALUE).value()


@pytest.mark.parametrize("chunk_key_groups", [1, 4])
@pytest.mark.parametrize("first", ["read", "hydrate"])
def test_adopted_tables_of_a_partly_loaded_restore_hold_every_key(env: Env, chunk_key_groups: int, first: str) -> None:
    b, second, model = partly_loaded(env, chunk_key_groups)
    again = another_process(env, b)
    adopted_without_the_dfs(env, again, second, LOADED)
    assert not again.fully_local
    if first == "read":  # each key loaded on access, then the rest hydrated
        assert_state_equals([again], model, model_keys(model))
    again.hydrate()
    assert again.fully_local
    assert not again.tables.holds_database(PENDING_DB)
    assert "set_current_key" not in vars(again)  # the hooks are gone with the lazy mode
    assert_state_equals([again], model, model_keys(model))


def test_an_adopted_partly_loaded_backend_goes_on_changing_and_checkpointing(env: Env) -> None:
    b, second, model = partly_loaded(env)
    again = another_process(env, b)
    adopt_local(again, second)
    apply_to_backend(again, batch_c()[20:40])
    model = apply_to_model(model, batch_c()[20:40])
    third = checkpoint(again, 3)
    again.flush()
    assert third.materialized == second.materialized  # still the chunks of what is not loaded
    for parallelism in (1, 2):
        assert_state_equals(env.backends.restored(third, parallelism), model, model_keys(model))
        assert_state_equals(lazily_restored(env, [third], parallelism), model, model_keys(model))
    # and a third process adopts what the second left, partly loaded still
    assert not again.fully_local
    last = another_process(env, again)
    adopt_local(last, KeyedStateHandle.loads(third.dumps()))
    assert not last.fully_local
    assert_state_equals([last], model, model_keys(model))
    last.hydrate()
    assert_state_equals([last], model, model_keys(model))


def test_an_adopted_partly_loaded_backend_materializes_only_once_local(env: Env) -> None:
    b, second, model = partly_loaded(env)
    again = another_process(env, b)
    adopt_local(again, second)
    m = PeriodicMaterializer(again, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=1))
    try:
        assert again.begin_materialization() is None  # due, but not everything is local
        assert not m.poll() and m.in_flight is None
        materialize(m)  # forced: hydrates everything first
        assert again.fully_local
        third = checkpoint(again, 3)
    finally:
        m.close()
    assert {c["path"] for c in third.materialized}.isdisjoint(c["path"] for c in second.materialized)
    assert_state_equals(env.backends.restored(third, 2), model, model_keys(model))


def test_timers_fire_after_the_adoption_with_their_keys_state(env: Env) -> None:
    b = env.backends.new()
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
    apply_to_backend(b, batch_a())
    for key in range(0, 200, 10):  # timers in the chunks
        b.set_current_key(key)
        b.register_event_time_timer(100 + key)
    materialize(m)
    m.close()
    for key in range(5, 200, 10):  # timers in the log
        b.set_current_key(key)
        b.register_event_time_timer(100 + key)
    handle = checkpoint(b, 1)
    env.backends.close(b)
    (lazy,) = lazily_restored(env, [handle], 1)
    lazy.hydrate_step(3)
    owner([lazy], 20).delete_event_time_timer(120)
    second = checkpoint(lazy, 2)
    lazy.flush()
    again = another_process(env, lazy)
    adopt_local(again, second)
    value = again.get_state(VALUE)
    fired: list[tuple[Any, int, int | None]] = []
    assert again.advance_watermark(150, lambda key, ts: fired.append((key, ts, value.value()))) == 10
    assert fired == [(k, 100 + k, k) for k in range(0, 51, 5) if k != 20]
    assert not again.fully_local


def test_adopting_partly_loaded_tables_needs_the_chunk_format(env: Env) -> None:
    """The backend does not import the materializer: ``materializer.periodic.adopt_local`` gives it
    the chunk format; ``backend.adopt_local`` alone refuses tables that still need chunks read."""
    b, second, _ = partly_loaded(env)
    again = another_process(env, b)
    with pytest.raises(StateRestoreError, match=r"materializer\.periodic\.adopt_local"):
        again.adopt_local(second)


def test_partly_loaded_tables_without_a_record_of_what_is_local_are_refused(env: Env) -> None:
    """Tables an earlier release left partly loaded hold the pending changes but no record of the
    keys loaded and key groups hydrated: continuing would load them again over newer entries."""
    b, second, _ = partly_loaded(env)
    record = b.tables.unlisted_database(LOCAL_DB)
    with b.tables.write("forget the record of what is local") as txn:
        txn.drop(record, delete=True)
    again = another_process(env, b)
    with pytest.raises(StateRestoreError, match="partly loaded by a lazy restore that kept no record"):
        adopt_local(again, second)


def test_adopted_tables_of_a_lazy_restore_that_ended_are_local(env: Env) -> None:
    b, second, model = partly_loaded(env)
    b.hydrate()
    again = another_process(env, b)
    adopt_local(again, second)
    assert again.fully_local
    assert_state_equals([again], model, model_keys(model))


def run_killed_child(tmp: Path, handle: KeyedStateHandle) -> KeyedStateHandle:
    """Run ``tests.support.lazy_adopt_child`` until it is ready, SIGKILL it; its handle."""
    handle_path, out, ready = tmp / "checkpoint-1.json", tmp / "checkpoint-2.json", tmp / "ready"
    handle_path.write_text(handle.dumps())
    cmd = [sys.executable, "-m", "tests.support.lazy_adopt_child"]
    cmd += [str(tmp / "dfs"), str(tmp / "crashed"), str(handle_path), str(out), str(ready)]
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, "the child's partly loaded state", 60.0)
        if proc.poll() is not None:
            pytest.fail(f"the child exited with {proc.returncode}: {proc.communicate()[1]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    return KeyedStateHandle.loads(out.read_text())


def test_tables_of_a_process_killed_while_partly_loaded_are_adopted(tmp_path: Path) -> None:
    with environment(tmp_path) as env:
        handle, model = checkpoint_1(env)
        second = run_killed_child(tmp_path, handle)
        model = apply_to_model(model, batch_c()[:20])
        b = B(second.operator_id, FULL, tmp_path / "crashed", storage=env.storage, max_parallelism=MAX_P,
              reuse_local=True)  # fmt: skip
        env.backends.open.append(b)
        adopted_without_the_dfs(env, b, second, READ_KEYS)  # what the child loaded before it was killed
        assert not b.fully_local
        assert_state_equals([b], model, model_keys(model))
        b.hydrate()
        assert_state_equals([b], model, model_keys(model))
        third = checkpoint(b, 3)
        assert_state_equals(env.backends.restored(third, 2), model, model_keys(model))
