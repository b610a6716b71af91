"""``PeriodicMaterializer``: materialization racing with writes and checkpoints (a stateful
machine with checkpoints and materializations in flight), and the log it keeps staying bounded.

Every restore goes through ``materializer.periodic.restore`` into fresh backends of parallelism
1..4 (each subtask from the same handle), and the union of the subtasks is compared with a dict
model: what a restarted job sees. Uploads are held in flight by the ``upload`` callable the
materializer accepts; nothing here waits by sleeping.
"""

from __future__ import annotations

import copy
import itertools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from backend.core.handles import KeyedStateHandle
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, restore
from tests.materializer.backends import (
    NEVER,
    WAIT_S,
    B,
    Backends,
    Env,
    GatedUpload,
    assert_state_equals,
    check_restores,
    checkpoint,
    materialize,
    new_storage,
    writer,
)
from tests.support.materializer_crash_child import (
    LIST,
    MAP,
    VALUE,
    Model,
    apply_to_backend,
    apply_to_model,
    batch_a,
    batch_b,
)
from tests.support.state_models import apply_list_op

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
