"""``PeriodicMaterializer``: materialization racing with writes and checkpoints, incremental chunks,
failed and crashed uploads, and when a materialization is triggered.

Every restore goes through ``materializer.periodic.restore`` into fresh backends of parallelism
1..4 (each subtask from the same handle), and the union of the subtasks is compared with a dict
model: what a restarted job sees. Uploads are blocked, failed or crashed by the ``upload``
callable the materializer accepts; nothing here waits by sleeping.
"""

from __future__ import annotations

import copy
import itertools
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backend.checkpointing.cleanup import delete_unreferenced
from backend.core.descriptors import ValueStateDescriptor
from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import assign_key_group
from backend.core.serializers import Int64Serializer, serialize_key
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, ConfigurationError, KeyGroupRange, StateChangelogStorage
from materializer.options import MaterializationOptions
from materializer.periodic import MaterializationError, PeriodicMaterializer, restore
from tests.materializer.backends import (
    FULL,
    NEVER,
    WAIT_S,
    B,
    Backends,
    Env,
    FlakyUpload,
    GatedUpload,
    assert_state_equals,
    check_restores,
    checkpoint,
    environment,
    writer,
)
from tests.support.materializer_crash_child import (
    LIST,
    MAP,
    MAX_P,
    OPERATOR,
    VALUE,
    Model,
    apply_to_backend,
    apply_to_model,
    batch_a,
    batch_b,
    checkpoint_1_model,
)
from tests.support.state_models import apply_list_op

PROJECT_ROOT = Path(__file__).resolve().parents[2]


# -- helpers --------------------------------------------------------------------------------------


def fake_clock(now: list[float]) -> Callable[[], float]:
    return lambda: now[0]


def new_storage(directory: Path) -> StateChangelogStorage:
    return StateChangelogStorage(ChangelogConfig.local(directory, persist_delay_ms=0))


def materialize(m: PeriodicMaterializer) -> None:
    """Start a materialization and apply its outcome (it must start: something changed)."""
    assert m.trigger()
    m.wait(WAIT_S)


def first_keys_in_key_group(key_group: int, count: int, start: int = 0) -> list[int]:
    found: list[int] = []
    for k in itertools.count(start):
        if assign_key_group(serialize_key(k), MAX_P) == key_group:
            found.append(k)
            if len(found) == count:
                return found
    raise AssertionError("unreachable")


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    with environment(tmp_path) as e:
        yield e


# -- 1. materialization racing with writes and checkpoints ---------------------------------------

KEY_POOL = [0, 1, 7, -3, 2**40, "a", "b", "", "zz", "key-9", 1234, "k"]
KEYS = st.sampled_from(KEY_POOL)
USER_KEYS = st.sampled_from(["x", "y", "z"])
VALUES = st.integers(-1_000, 1_000)


@dataclass
class Pending:
    checkpoint_id: int
    future: Any
    model: Model
    materialized_sqn: int  # the backend's materialized SQN when the snapshot was taken


class MaterializerMachine(RuleBasedStateMachine):
    """One backend under random writes, checkpoints (some in flight across other steps) and
    materializations (some held in flight by a gated upload across writes and checkpoints).

    After every completed checkpoint, fresh backends of parallelism 1..4 restored from its handle
    must equal the model at that checkpoint, and the log keeps nothing the last materialization
    the checkpoint builds on already holds.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="materializer-machine-"))
        self.storage = new_storage(self.tmp / "dfs")
        self.backends = Backends(self.tmp, self.storage)
        self.upload = GatedUpload(self.storage)
        self.model = Model()
        self.checkpoint_ids = itertools.count(1)
        self.pending: Pending | None = None
        self.running = False
        self.completed_materializations = 0
        self.last_completed: tuple[KeyedStateHandle, Model] | None = None
        self.b: B
        self.m: PeriodicMaterializer

    def teardown(self) -> None:
        self.upload.gate.set()
        try:
            if hasattr(self, "m"):
                self._abort_pending()
                self.m.close()
        finally:
            try:
                self.backends.close_all()
                self.storage.close()
            finally:
                shutil.rmtree(self.tmp, ignore_errors=True)

    def _start(self, handle: KeyedStateHandle | None) -> None:
        self.b = self.backends.new(cache_limit=self.cache_limit)
        if handle is not None:
            restore(self.b, [KeyedStateHandle.loads(handle.dumps())])
        self.m = PeriodicMaterializer(
            self.b,
            MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=self.chunk_key_groups),
            upload=self.upload,
        )
        self.running = False
        self.completed_materializations = 0  # by this materializer

    @initialize(chunk_key_groups=st.sampled_from([1, 1, 8, 128]), cache_limit=st.sampled_from([2, 1_000]))
    def start(self, chunk_key_groups: int, cache_limit: int) -> None:
        self.chunk_key_groups = chunk_key_groups
        self.cache_limit = cache_limit
        self._start(None)

    # -- writes -------------------------------------------------------------------------------

    def at(self, key: Any) -> B:
        self.b.set_current_key(key)
        return self.b

    @rule(key=KEYS, clear=st.booleans(), value=VALUES)
    def value_op(self, key: Any, clear: bool, value: int) -> None:
        state = self.at(key).get_state(VALUE)
        if clear:
            state.clear()
            self.model.value.pop(key, None)
        else:
            state.update(value)
            self.model.value[key] = value

    @rule(key=KEYS, op=st.sampled_from(["add", "add_all", "update", "clear"]), values=st.lists(VALUES, max_size=3))
    def list_op(self, key: Any, op: str, values: list[int]) -> None:
        state, model = self.at(key).get_state(LIST), self.model.lists
        apply_list_op(state, model, key, op, values)

    @rule(key=KEYS, op=st.sampled_from(["put", "remove", "clear"]), user_key=USER_KEYS, value=VALUES)
    def map_op(self, key: Any, op: str, user_key: str, value: int) -> None:
        state, model = self.at(key).get_state(MAP), self.model.maps
        if op == "put":
            state.put(user_key, value)
            model.setdefault(key, {})[user_key] = value
        elif op == "remove":
            state.remove(user_key)
            model.get(key, {}).pop(user_key, None)
        else:
            state.clear()
            model.pop(key, None)
        if not model.get(key, True):
            del model[key]

    @rule(keys=st.lists(KEYS, min_size=1, unique=True), value=VALUES)
    def burst(self, keys: list[Any], value: int) -> None:
        for key in keys:
            self.value_op(key, False, value)
            self.list_op(key, "add", [value])
            self.map_op(key, "put", "x", value)

    @rule()
    def flush(self) -> None:
        self.b.flush()

    @rule(key=KEYS)
    def read_key(self, key: Any) -> None:
        assert_state_equals([self.b], self.model, [key])

    # -- materializations ---------------------------------------------------------------------

    @precondition(lambda self: not self.running)
    @rule(hold=st.booleans())
    def trigger(self, hold: bool) -> None:
        """Start a materialization; ``hold``: its uploads wait until ``finish_materialization``."""
        if hold:
            self.upload.gate.clear()
        before = copy.copy(self.m.metrics)
        started = self.m.trigger()
        if started:
            assert self.m.metrics.started == before.started + 1
            self.running = True
            event("materialization held in flight" if hold else "materialization started")
        else:
            assert self.m.metrics.skipped_unchanged == before.skipped_unchanged + 1
            self.upload.gate.set()

    @precondition(lambda self: self.running)
    @rule()
    def poll_while_running(self) -> None:
        """At most one materialization at a time: neither poll() nor trigger() starts another."""
        started = self.m.metrics.started
        if self.upload.blocked.is_set():  # held inside an upload: certainly not done
            assert self.m.poll() is False
            assert self.m.metrics.completed == self.completed_materializations
        assert self.m.trigger() is False  # (also when done but not yet applied by poll/wait)
        assert self.m.metrics.started == started

    @precondition(lambda self: self.running)
    @rule()
    def finish_materialization(self) -> None:
        self.upload.gate.set()
        self.m.wait(WAIT_S)
        self.running = False
        assert self.m.metrics.failed == 0
        assert self.m.metrics.completed == self.completed_materializations + 1
        self.completed_materializations += 1

    @precondition(lambda self: not self.running and self.pending is None)
    @rule(keys=st.lists(KEYS, min_size=1, unique=True), value=VALUES, p1=st.integers(1, 4), p2=st.integers(1, 4))
    def materialize_across_checkpoints(self, keys: list[Any], value: int, p1: int, p2: int) -> None:
        """The race in one step: writes and a whole checkpoint while the materialization uploads,
        then a checkpoint after it completed."""
        self.trigger(hold=True)
        self.burst(keys, value)
        self.checkpoint(p1)
        if self.running:
            self.finish_materialization()
        self.checkpoint(p2)

    # -- checkpoints --------------------------------------------------------------------------

    def _snapshot(self) -> Pending:
        cid = next(self.checkpoint_ids)
        return Pending(cid, self.b.snapshot(cid), copy.deepcopy(self.model), int(self.b.materialized_sqn))

    def _complete(self, pending: Pending, parallelism: int) -> None:
        handle = pending.future.result(timeout=WAIT_S)
        self.b.notify_checkpoint_complete(pending.checkpoint_id)
        # The checkpoint starts from the materialization it saw: the log keeps nothing below it.
        assert all(sqn >= pending.materialized_sqn for sqn in writer(self.b).entries), (
            f"changesets {sorted(writer(self.b).entries)} kept below materialized sqn {pending.materialized_sqn}"
        )
        own = [e.log for e in handle.changelog if e.log.log_id == writer(self.b).log_id]
        assert all(log.after == pending.materialized_sqn for log in own)
        handle = KeyedStateHandle.loads(handle.dumps())
        self.last_completed = (handle, pending.model)
        event(f"restore: chunks={bool(handle.materialized)}, log={bool(handle.changelog)}, in flight={self.running}")
        subtasks = self.backends.restored(handle, parallelism)
        try:
            assert_state_equals(subtasks, pending.model, KEY_POOL)
        finally:
            for b in subtasks:
                self.backends.close(b)

    def _abort_pending(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.future.result(timeout=WAIT_S)
            self.b.notify_checkpoint_aborted(pending.checkpoint_id)

    @precondition(lambda self: self.pending is None)
    @rule(parallelism=st.integers(1, 4))
    def checkpoint(self, parallelism: int) -> None:
        self._complete(self._snapshot(), parallelism)

    @precondition(lambda self: self.pending is None)
    @rule()
    def begin_checkpoint(self) -> None:
        """Snapshot now; the checkpoint completes (or aborts) after more steps."""
        self.pending = self._snapshot()

    @precondition(lambda self: self.pending is not None)
    @rule(complete=st.booleans(), parallelism=st.integers(1, 4))
    def end_checkpoint(self, complete: bool, parallelism: int) -> None:
        assert self.pending is not None
        pending, self.pending = self.pending, None
        if complete:
            self._complete(pending, parallelism)
        else:
            self.pending = pending
            self._abort_pending()

    @precondition(lambda self: self.last_completed is not None)
    @rule()
    def restart(self) -> None:
        """The job fails and restarts from the last completed checkpoint, then goes on."""
        assert self.last_completed is not None
        handle, model = self.last_completed
        self._abort_pending()
        self.upload.gate.set()
        self.m.close()
        self.backends.close(self.b)
        self._start(handle)
        self.model = copy.deepcopy(model)
        assert_state_equals([self.b], self.model, KEY_POOL)


TestMaterializerMachine = MaterializerMachine.TestCase
TestMaterializerMachine.settings = settings(stateful_step_count=40, deadline=None)


def test_checkpoint_in_flight_across_a_materialization_restores_its_own_state(env: Env) -> None:
    """A checkpoint taken while a materialization uploads holds the log since the OLD one; the
    materialization completing first must not take away log files the checkpoint needs."""
    b = env.backends.new()
    upload = GatedUpload(env.storage)
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None), upload=upload)
    model = apply_to_model(Model(), batch_a())
    apply_to_backend(b, batch_a())
    first = checkpoint(b, 1)
    upload.gate.clear()
    assert m.trigger()
    apply_to_backend(b, batch_b())  # after the materialization's cut: only in the log
    future = b.snapshot(2)
    upload.gate.set()
    m.wait(WAIT_S)
    assert m.metrics.completed == 1
    second = future.result(timeout=WAIT_S)
    b.notify_checkpoint_complete(2)
    assert second.materialized == ()  # the snapshot was taken before the materialization completed
    check_restores(env, first, model)
    check_restores(env, second, apply_to_model(copy.deepcopy(model), batch_b()))
    third = checkpoint(b, 3)
    assert third.materialized and all(e.log.after == b.materialized_sqn for e in third.changelog)
    assert all(sqn >= b.materialized_sqn for sqn in writer(b).entries)
    check_restores(env, third, apply_to_model(copy.deepcopy(model), batch_b()), parallelisms=(2, 4))
    m.close()


def test_log_stays_bounded_over_many_materializations(env: Env) -> None:
    """The bounded log (invariant 4): with a materialization before every checkpoint, the
    changesets kept and the log a restore replays do not grow with the job's age."""
    b = env.backends.new()
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
    model = Model()
    kept: list[int] = []
    replayed: list[int] = []
    for round_ in range(12):
        ops = [(k, round_, round_, ("x", round_)) for k in range(round_ * 10, round_ * 10 + 30)]
        apply_to_backend(b, ops)
        apply_to_model(model, ops)
        materialize(m)
        handle = checkpoint(b, round_ + 1)
        kept.append(len(writer(b).entries))
        replayed.append(sum(seg.records for e in handle.changelog for seg in e.log.segments))
        assert min(writer(b).entries, default=b.materialized_sqn) >= b.materialized_sqn
    assert max(kept) <= 2, kept
    assert max(replayed) == 0, replayed  # nothing changed between materialization and checkpoint
    check_restores(env, handle, model)
    m.close()


# -- 2. incremental materialization ---------------------------------------------------------------


def test_incremental_materialization_uploads_only_changed_key_groups(env: Env) -> None:
    b = env.backends.new()
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=1))
    model = Model()
    ops = [(k, k, k, ("x", k)) for k in range(2_000)]
    apply_to_backend(b, ops)
    apply_to_model(model, ops)
    non_empty = {b.key_group_of(k) for k in range(2_000)}
    assert len(non_empty) == MAX_P

    materialize(m)
    assert (m.metrics.chunks_uploaded, m.metrics.chunks_reused) == (MAX_P, 0)
    assert m.metrics.last_incremental_size == m.metrics.last_full_size
    first = checkpoint(b, 1)
    first_paths = {tuple(c["key_groups"]): c["path"] for c in first.materialized}
    assert len(first_paths) == MAX_P
    files_before = set(env.storage.files.list("shared"))

    changed_kg = b.key_group_of(0)
    ops = [(k, -k, -k, ("y", k)) for k in first_keys_in_key_group(changed_kg, 5)]
    apply_to_backend(b, ops)
    apply_to_model(model, ops)
    materialize(m)
    assert m.metrics.chunks_uploaded == MAX_P + 1
    assert m.metrics.chunks_reused == MAX_P - 1
    assert m.metrics.last_incremental_size * 20 < m.metrics.last_full_size, m.metrics
    second = checkpoint(b, 2)
    second_paths = {tuple(c["key_groups"]): c["path"] for c in second.materialized}
    assert {kg for kg, path in second_paths.items() if path != first_paths[kg]} == {(changed_kg, changed_kg)}
    assert set(env.storage.files.list("shared")) - files_before == {second_paths[(changed_kg, changed_kg)]}
    check_restores(env, second, model, parallelisms=(1, 2, 4))

    skipped = m.metrics.skipped_unchanged
    assert m.trigger() is False  # nothing changed since
    assert m.metrics.skipped_unchanged == skipped + 1
    checkpoint(b, 3)  # a checkpoint with nothing new does not make the next one necessary either
    assert m.trigger() is False
    assert m.metrics.skipped_unchanged == skipped + 2
    assert m.metrics.completed == 2
    m.close()


def test_emptied_key_group_is_dropped_and_not_restored(env: Env) -> None:
    b = env.backends.new()
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=1))
    model = Model()
    ops = [(k, k, k, ("x", k)) for k in range(300)]
    apply_to_backend(b, ops)
    apply_to_model(model, ops)
    materialize(m)
    chunks = m.metrics.chunks_uploaded
    emptied = b.key_group_of(3)
    for k in [k for k in range(300) if b.key_group_of(k) == emptied]:
        b.set_current_key(k)
        b.get_state(VALUE).clear()
        b.get_state(LIST).clear()
        b.get_state(MAP).clear()
        for part in (model.value, model.lists, model.maps):
            part.pop(k)
    materialize(m)
    assert m.metrics.chunks_uploaded == chunks  # nothing to upload: the key group is empty now
    assert m.metrics.chunks_reused == chunks - 1
    handle = checkpoint(b, 1)
    assert all(c["key_groups"] != [emptied, emptied] for c in handle.materialized)
    check_restores(env, handle, model, parallelisms=(1, 2))
    m.close()


def test_materialization_after_a_restore_rewrites_restored_state(env: Env) -> None:
    """A restored backend's state came partly from logs: its first materialization writes every
    chunk (no previous chunk is complete), and checkpoints after it need no old log."""
    b = env.backends.new()
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=16))
    apply_to_backend(b, batch_a())
    materialize(m)
    apply_to_backend(b, batch_b())
    handle = checkpoint(b, 1)
    m.close()
    model = checkpoint_1_model()

    (r,) = env.backends.restored(handle, 1)
    mr = PeriodicMaterializer(
        r, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=16)
    )
    materialize(mr)  # nothing changed since the restore, but the state is partly from logs
    assert mr.metrics.chunks_reused == 0
    after = checkpoint(r, 2)
    assert all(e.log.log_id == writer(r).log_id for e in after.changelog)  # the restored log is gone
    check_restores(env, after, model, parallelisms=(1, 3))
    assert mr.trigger() is False
    mr.close()


# -- 3. failed uploads ---------------------------------------------------------------------------


def test_failed_upload_deletes_partial_chunks_and_the_retry_succeeds(env: Env) -> None:
    b = env.backends.new()
    upload = FlakyUpload(env.storage, failing={3})
    m = PeriodicMaterializer(
        b,
        MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=8, pack_bytes=1),
        upload=upload,
    )  # one chunk per upload
    model = checkpoint_1_model()
    apply_to_backend(b, batch_a())
    apply_to_backend(b, batch_b())

    assert m.trigger()
    m.wait(WAIT_S)  # two chunks uploaded, the third fails
    assert upload.calls == 3
    assert (m.metrics.failed, m.metrics.completed) == (1, 0)
    assert env.storage.files.list("shared") == []  # the two partial chunks are gone
    failed = checkpoint(b, 1)
    assert failed.materialized == ()
    check_restores(env, failed, model)  # the log was not truncated for the failed attempt

    assert m.trigger()  # the key groups are still dirty: not skipped as unchanged
    m.wait(WAIT_S)
    assert (m.metrics.failed, m.metrics.completed) == (1, 1)
    assert m.metrics.chunks_uploaded == MAX_P // 8
    handle = checkpoint(b, 2)
    assert sorted(env.storage.files.list("shared")) == sorted(c["path"] for c in handle.materialized)
    check_restores(env, handle, model, parallelisms=(1, 2, 4))
    m.close()


def test_failed_incremental_upload_keeps_the_previous_chunks_and_the_changed_key_groups_dirty(env: Env) -> None:
    b = env.backends.new()
    upload = FlakyUpload(env.storage, failing=set())
    m = PeriodicMaterializer(
        b,
        MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=1, pack_bytes=1),
        upload=upload,
    )  # one chunk per upload
    model = Model()
    ops = [(k, k, k, ("x", k)) for k in range(400)]
    apply_to_backend(b, ops)
    apply_to_model(model, ops)
    materialize(m)
    previous = set(env.storage.files.list("shared"))
    uploaded = m.metrics.chunks_uploaded

    changed = sorted({b.key_group_of(k) for k in (0, 1, 2, 5)})
    assert len(changed) >= 3
    ops = [(k, 7, 7, ("z", 7)) for kg in changed for k in first_keys_in_key_group(kg, 2)]
    apply_to_backend(b, ops)
    apply_to_model(model, ops)
    upload.failing = {upload.calls + 2}  # the second changed chunk fails
    assert m.trigger()
    m.wait(WAIT_S)
    assert m.metrics.failed == 1
    assert set(env.storage.files.list("shared")) == previous  # the first changed chunk was deleted again

    assert m.trigger()
    m.wait(WAIT_S)
    assert m.metrics.completed == 2
    assert m.metrics.chunks_uploaded == uploaded + len(changed)  # every changed key group, none more
    handle = checkpoint(b, 1)
    check_restores(env, handle, model, parallelisms=(1, 4))
    m.close()


def test_too_many_consecutive_failures_raise_naming_operator_and_count(env: Env) -> None:
    b = env.backends.new()
    upload = FlakyUpload(env.storage, failing={1, 2, 4, 5, 6})
    m = PeriodicMaterializer(
        b,
        MaterializationOptions(
            interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=MAX_P, max_failures_allowed=2
        ),
        upload=upload,
    )
    model = Model()

    def write(round_: int) -> None:
        ops = [(k, round_, round_, ("x", round_)) for k in range(round_, round_ + 5)]
        apply_to_backend(b, ops)
        apply_to_model(model, ops)

    for round_ in range(3):  # fail, fail, succeed: the count of failures in a row resets
        write(round_)
        materialize(m)
    assert (m.metrics.failed, m.metrics.completed) == (2, 1)
    for round_ in range(3, 5):  # fail, fail: as many in a row as allowed
        write(round_)
        materialize(m)
    assert m.metrics.failed == 4
    write(5)
    assert m.trigger()
    with pytest.raises(MaterializationError, match=rf"operator {OPERATOR}\b.* failed 3 times") as info:
        m.wait(WAIT_S)
    assert "injected upload failure" in str(info.value)
    assert m.metrics.failed == 5
    handle = checkpoint(b, 1)  # the last good materialization plus the log still restore
    check_restores(env, handle, model)
    m.close()


def test_failure_restores_the_size_trigger(env: Env) -> None:
    """A failed materialization's logged bytes count again: the size trigger retries at once."""
    b = env.backends.new()
    upload = FlakyUpload(env.storage, failing={1})
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=500), upload=upload)
    apply_to_backend(b, batch_a())
    b.flush()
    assert b.log_bytes_since_materialization >= 500
    assert m.poll() is True
    m.wait(WAIT_S)
    assert m.metrics.failed == 1
    assert b.log_bytes_since_materialization >= 500
    assert m.poll() is True
    m.wait(WAIT_S)
    assert m.metrics.completed == 1
    assert b.log_bytes_since_materialization == 0
    m.close()


# -- 4. a crash in the middle of a materialization's upload --------------------------------------


def run_crashing_child(tmp: Path) -> tuple[KeyedStateHandle, str]:
    """Run the child until it hangs in its upload, SIGKILL it; return its handle and partial chunk."""
    handle_path, marker = tmp / "checkpoint-1.json", tmp / "uploading"
    cmd = [sys.executable, "-m", "tests.support.materializer_crash_child"]
    cmd += [str(tmp / "child"), str(handle_path), str(marker)]
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60.0
        while not marker.exists():
            try:
                code = proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                assert time.monotonic() < deadline, "the child never reached its upload"
                continue
            pytest.fail(f"the child exited with {code} before its upload: {proc.communicate()[1]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    return KeyedStateHandle.loads(handle_path.read_text()), marker.read_text()


def test_crash_during_materialization_upload(tmp_path: Path) -> None:
    handle, partial = run_crashing_child(tmp_path)
    model = checkpoint_1_model()
    assert handle.materialized and handle.changelog  # chunks of batch A, the log of batch B

    storage = new_storage(tmp_path / "child" / "dfs")
    backends = Backends(tmp_path, storage)
    env = Env(tmp_path, storage, backends)
    try:
        check_restores(env, handle, model, parallelisms=(1, 2))

        referenced = handle.referenced_files()
        shared, logs = set(storage.files.list("shared")), set(storage.files.list("dstl"))
        assert referenced <= shared | logs
        assert shared - referenced == {partial}  # what the crash left behind: the partial upload

        deleted = delete_unreferenced(storage.files, [handle])  # orphan cleanup after the crash
        assert set(deleted) == (shared | logs) - referenced
        assert set(storage.files.list("shared")) | set(storage.files.list("dstl")) == referenced
        check_restores(env, handle, model, parallelisms=(1, 4))
    finally:
        backends.close_all()
        storage.close()


# -- 5. when a materialization starts ------------------------------------------------------------


def test_periodic_trigger_waits_for_the_jittered_due_time(env: Env) -> None:
    now = [1_000_000.0]  # ms
    interval = 100_000
    b = env.backends.new()
    upload = GatedUpload(env.storage)
    m = PeriodicMaterializer(
        b,
        MaterializationOptions(interval_ms=interval, size_trigger_bytes=None),
        clock_ms=fake_clock(now),
        rng=random.Random(7),
        upload=upload,
    )
    due = now[0] + interval * random.Random(7).uniform(0.5, 1.0)
    apply_to_backend(b, batch_a())
    b.flush()

    for t in (now[0], now[0] + interval * 0.5 - 1e-6, due - 1e-6):
        now[0] = t
        assert m.poll() is False
    assert m.metrics.started == 0
    now[0] = due
    upload.gate.clear()
    assert m.poll() is True
    assert m.metrics.started == 1

    apply_to_backend(b, batch_b())  # while it runs, even past the next due time, none starts
    b.flush()
    now[0] = due + 2 * interval
    assert m.poll() is False
    assert m.trigger() is False
    assert m.metrics.started == 1
    upload.gate.set()
    m.wait(WAIT_S)
    assert m.metrics.completed == 1
    assert m.poll() is True  # overdue and batch B changed the state: starts at once
    m.wait(WAIT_S)

    started = now[0]  # the next due time counts from when the last one started
    apply_to_backend(b, [(1, 1, 1, ("x", 1))])
    b.flush()
    now[0] = started + interval - 1e-6
    assert m.poll() is False
    now[0] = started + interval
    assert m.poll() is True
    m.wait(WAIT_S)
    assert m.metrics.started == 3

    now[0] = started + 2 * interval  # due, but nothing changed: skipped, due again an interval later
    assert m.poll() is False
    assert (m.metrics.skipped_unchanged, m.metrics.started) == (1, 3)
    apply_to_backend(b, [(2, 2, 2, ("x", 2))])
    b.flush()
    now[0] = started + 3 * interval - 1e-6
    assert m.poll() is False
    now[0] = started + 3 * interval
    assert m.poll() is True
    m.wait(WAIT_S)
    assert (m.metrics.started, m.metrics.completed, m.metrics.skipped_unchanged) == (4, 4, 1)
    m.close()


def test_first_due_time_is_jittered_between_half_and_one_interval(env: Env) -> None:
    b = env.backends.new()
    apply_to_backend(b, [(1, 1, 1, ("x", 1))])
    b.flush()
    dues = set()
    for seed in range(5):
        now = [0.0]
        m = PeriodicMaterializer(
            b,
            MaterializationOptions(interval_ms=100_000, size_trigger_bytes=None),
            clock_ms=fake_clock(now),
            rng=random.Random(seed),
        )
        expected = 100_000 * random.Random(seed).uniform(0.5, 1.0)
        now[0] = expected - 1e-6
        assert m.poll() is False
        now[0] = expected
        assert m.poll() is True
        m.close()
        dues.add(expected)
        apply_to_backend(b, [(seed, seed, seed, ("x", seed))])
        b.flush()
    assert len(dues) == 5  # subtasks do not all upload at once


def test_size_trigger_starts_as_soon_as_enough_was_logged(env: Env) -> None:
    now = [0.0]
    b = env.backends.new()
    upload = GatedUpload(env.storage)
    m = PeriodicMaterializer(
        b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=2_000), clock_ms=fake_clock(now), upload=upload
    )
    key = itertools.count()
    while True:
        k = next(key)
        apply_to_backend(b, [(k, k, k, ("x", k))])
        b.flush()  # logged: the size counts what the log holds
        if b.log_bytes_since_materialization >= 2_000:
            break
        assert m.poll() is False
    upload.gate.clear()
    assert m.poll() is True
    assert b.log_bytes_since_materialization == 0
    for _ in range(30):  # a burst while it runs: no second one starts
        k = next(key)
        apply_to_backend(b, [(k, k, k, ("x", k))])
    b.flush()
    assert b.log_bytes_since_materialization >= 2_000
    assert m.poll() is False
    assert m.metrics.started == 1
    upload.gate.set()
    m.wait(WAIT_S)
    assert m.poll() is True  # the burst alone was enough
    m.wait(WAIT_S)
    assert (m.metrics.started, m.metrics.completed) == (2, 2)
    m.close()


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"interval_ms": 0}, "interval_ms"),
        ({"chunk_key_groups": 0}, "chunk_key_groups"),
        ({"max_failures_allowed": -1}, "max_failures_allowed"),
    ],
)
def test_bad_settings_are_rejected(env: Env, kwargs: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        PeriodicMaterializer(env.backends.new(), MaterializationOptions(**kwargs))


def test_materialization_needs_the_changelog(env: Env) -> None:
    b = B(OPERATOR, FULL, env.tmp / "no-log", storage=None, max_parallelism=MAX_P, log_enabled=False)
    try:
        with pytest.raises(ConfigurationError, match="changelog storage"):
            PeriodicMaterializer(b)
    finally:
        b.close()


@pytest.mark.parametrize("path", ["../outside.chunk", "/etc/passwd", "s3://other/bucket.chunk"])
def test_a_chunk_path_outside_the_base_path_is_refused(tmp_path: Path, path: str) -> None:
    storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs"))
    try:
        backend = ChangelogKeyedStateBackend("op", KeyGroupRange(0, 127), tmp_path / "a", storage=storage)
        m = PeriodicMaterializer(backend, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
        backend.get_state(ValueStateDescriptor("v", Int64Serializer()))
        backend.set_current_key(1)
        backend.get_state(ValueStateDescriptor("v", Int64Serializer())).update(1)
        assert m.trigger()
        m.wait()
        handle = backend.snapshot(1).result(30)
        backend.notify_checkpoint_complete(1)
        tampered = handle.to_json()
        tampered["materialized"][0]["path"] = path
        fresh = ChangelogKeyedStateBackend("op", KeyGroupRange(0, 127), tmp_path / "b", storage=storage)
        with pytest.raises(StateRestoreError, match=r"outside|not relative"):
            restore(fresh, [KeyedStateHandle.from_json(tampered)])
        m.close()
    finally:
        storage.close()


# -- 6. metrics ----------------------------------------------------------------------------------


def test_metrics_are_exposed_through_prometheus_client(env: Env) -> None:
    b = env.backends.new()
    m = PeriodicMaterializer(
        b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=MAX_P // 2)
    )
    apply_to_backend(b, batch_a())
    materialize(m)
    assert m.trigger() is False  # nothing changed: skipped
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(m.metrics.registry).decode())}

    def value(name: str, suffix: str = "") -> float:
        (sample,) = [s for s in families[name].samples if s.name == name + suffix]
        assert sample.labels == {"operator": OPERATOR, "key_groups": f"0-{MAX_P - 1}"}
        return float(sample.value)

    metrics = m.metrics
    assert value("dstl_materialization_started", "_total") == metrics.started == 1
    assert value("dstl_materialization_completed", "_total") == metrics.completed == 1
    assert value("dstl_materialization_failed", "_total") == metrics.failed == 0
    assert value("dstl_materialization_skipped_unchanged", "_total") == metrics.skipped_unchanged == 1
    assert value("dstl_materialization_chunks_uploaded", "_total") == metrics.chunks_uploaded == 2
    assert value("dstl_materialization_chunks_reused", "_total") == metrics.chunks_reused == 0
    assert value("dstl_materialization_last_full_size_bytes") == metrics.last_full_size > 0
    assert value("dstl_materialization_last_incremental_size_bytes") == metrics.last_incremental_size
    assert metrics.last_duration_ms > 0  # code reads milliseconds, Prometheus gets seconds
    assert value("dstl_materialization_last_duration_seconds") == pytest.approx(metrics.last_duration_ms / 1000)
    assert value("dstl_materialization_duration_seconds", "_count") == 1
    assert value("dstl_materialization_duration_seconds", "_sum") == pytest.approx(metrics.last_duration_ms / 1000)
    m.close()
