"""The state machine of ``tests.backend.state.test_state_machine`` with lazy restores.

Every restore (of a random completed checkpoint, at a random parallelism, also the autoscaler's
rescales) is lazy or eager, drawn; materializations (so that checkpoints hold chunks, read block by
block) and hydration steps of a random subtask are rules of their own, so accesses, batches (the
read-ahead), timers firing, checkpoints of partly loaded subtasks, materializations, restores and
hydration interleave at random against the dict model. A subtask may also go on in a new process
(``adopt_in_new_process``): snapshot, flush, close, and a new backend adopts its local tables from
the snapshot's handle, partly loaded or not, as Spark's next task in another Python worker does.
Right after a lazy restore nothing is read: the keys are checked by the rules that read them, and
the stored entries only once every subtask is fully local.
"""

from __future__ import annotations

import copy

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from backend.core.handles import KeyedStateHandle
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, adopt_local, restore
from tests.backend.state.test_state_machine import MACHINE_SETTINGS, MAX_P, OP, WAIT_S, BackendMachine, Subtask

NEVER = 10**12


class LazyBackendMachine(BackendMachine):
    @rule(index=st.integers(0, 7))
    def materialize(self, index: int) -> None:
        """A subtask materializes now (a partly loaded one hydrates first)."""
        b = self.subtasks[index % len(self.subtasks)].b
        m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
        try:
            m.trigger()
            m.wait(WAIT_S)
        finally:
            m.close()
        assert b.fully_local

    @rule(index=st.integers(0, 7), key_groups=st.integers(1, 40))
    def hydrate_step(self, index: int, key_groups: int) -> None:
        b = self.subtasks[index % len(self.subtasks)].b
        was_local = b.fully_local
        loaded = b.hydrate_step(key_groups)
        assert (loaded == 0) == was_local

    @precondition(lambda self: self.pending is None)
    @rule(index=st.integers(0, 7))
    def adopt_in_new_process(self, index: int) -> None:
        """The subtask's next unit of work runs in another process of the host: its state is
        snapshotted and flushed (a Spark task's marker names that handle), the backend closed, and a
        new backend over the same local tables adopts them; the model does not change."""
        self._end_batches()
        at = index % len(self.subtasks)
        old = self.subtasks[at].b
        handle = old.snapshot(next(self.checkpoint_ids)).result(timeout=WAIT_S)
        old.flush()
        old.close()
        new = ChangelogKeyedStateBackend(
            OP, old.key_group_range, old.tables.path, storage=self.storage, max_parallelism=MAX_P,
            clock=lambda: self.clock[0], cache_limit=self.cache_limit, reuse_local=True,
        )  # fmt: skip
        try:
            adopt_local(new, KeyedStateHandle.loads(handle.dumps()))
        finally:
            self.subtasks[at] = Subtask(new)
        # a key group whose every pending change went with a key loaded is not cold to the new one
        assert new.fully_local or not old.fully_local

    @rule()
    def check_stored_when_local(self) -> None:
        if all(sub.b.fully_local for sub in self.subtasks):
            self.check_stored()

    def _restore(self, index: int, data: st.DataObject) -> None:
        parallelism = data.draw(st.integers(1, 8), label="parallelism")
        mode = data.draw(st.sampled_from(["lazy", "eager"]), label="mode")
        if self.pending is not None:  # the job fails before the checkpoint completes
            pending, self.pending = self.pending, None
            self._finish(*pending, complete=False)
        handles, model = self.completed[index]
        self._end_batches()
        old, self.subtasks = self.subtasks, []
        for sub in old:
            sub.b.close()
        backends = self._backends(parallelism)
        try:
            for b in backends:
                restore(b, handles, mode=mode)
        finally:
            self.subtasks = [Subtask(b) for b in backends]
        self.model = copy.deepcopy(model)
        if mode == "eager":
            self.check_all()
            self.check_stored()


TestLazyStateMachine = LazyBackendMachine.TestCase
TestLazyStateMachine.settings = MACHINE_SETTINGS
