"""Randomized faults: a ``LocalJob`` checkpoints, materializes, crashes and restarts while a random
share of its DFS calls fail, stall, are slow, trickle, or land after their client gave up.

Each example is a schedule drawn by hypothesis (updates, checkpoints, materializations waited for
or left running, crashes between operations or at a step of the checkpoint protocol, late writes
landing) run on a ``faulty://`` DFS (``benchmarks.support.faulty_fs``) whose plan faults 20-40% of
the calls, and 50-90% of those on one part of the job directory (``_metadata`` writes, fences,
chunks, log files or id reservations), so that the rare paths (every attempt of a commit failing)
are taken too. A crash is in-process: the plan of the crashed "process" turns dead (every later call
fails, its stalls end), its job is closed on that dead DFS (so it changes nothing more), and a new
job starts on a new plan over the same directory; what the dead process had sent late may still
land. Invariants, checked at every step:

- a restart resumes exactly the state of the last checkpoint ``checkpoint()`` reported complete
  (a model dict snapshotted at each success). The one documented exception
  (docs/failure-semantics.md): a checkpoint whose failure said "outcome unknown" may come back;
  it is counted apart;
- every file a retained checkpoint references exists;
- after a clean shutdown and orphan cleanup (a restart on a healed DFS), the job directory holds
  exactly the retained checkpoints' ``_metadata`` and the files they reference, besides the
  bookkeeping the protocol keeps on purpose: one reservation of checkpoint ids, and fences of ids
  above the latest checkpoint (a late ``_metadata`` of theirs could still land);
- no whole-file DFS call outlives ``max_attempts`` deadlines plus backoff plus slack, and no
  operation outlives that bound per DFS call it made;
- every failure is a ``ChangelogError`` naming the object.

CI runs a few examples (the "ci" profile's ``max_examples`` / 3); ``HYPOTHESIS_PROFILE=slow`` or
``RANDOM_FAULT_EXAMPLES=<n>`` run more, and ``-s`` prints the tally (attempts, faults, fraction,
lost states, calls past their deadline).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import given, settings
from hypothesis import strategies as st

from backend.checkpointing.metadata import (
    ABORTED_NAME,
    SnapshotMetadata,
    metadata_path,
    parse_checkpoint_dir,
    parse_id_block_path,
)
from backend.core.errors import CheckpointError
from backend.job import JobOptions, LocalJob, OperatorSpec
from benchmarks.support.faulty_fs import faulty_base_path
from dstl import ChangelogConfig
from dstl.errors import StorageError
from materializer.options import MaterializationOptions
from tests.backend.checkpointing.random_faults import DeadlineMeter, RandomFaults, Tally, call_bound_s
from tests.backend.checkpointing.workloads import (
    NEVER,
    State,
    Workload,
    expected_files,
    files_on_dfs,
    read_state,
    snapshot_of,
)

T = TypeVar("T")

DEADLINE_MS = 200  # dfs_timeout_ms and upload_timeout_ms: small, so deadlines are reached
ATTEMPTS = 3
RETRY_DELAY_MS = 10
#: the slack over a call's (an operation's) deadlines and backoff. Not a timing: a call without a
#: deadline waits for its stall's end (``STALL_LIMIT_S``), far beyond; a loaded host stays far below
CALL_SLACK_S = 30.0
OPERATION_SLACK_S = 45.0
RESTART_TRIES = 4  # restarts under faults before the DFS heals (the last try has no faults)
#: where a crash may hit inside the checkpoint protocol ("": between operations)
CRASH_POINTS = [
    "",
    "",
    "before-metadata",
    "after-metadata",
    "before-subsume",
    "after-subsume-metadata",
    "during-file-deletion",
]


class Crash(BaseException):
    """The process dies (a BaseException, as nothing in the job may catch a SIGKILL)."""


def _config(root: str) -> ChangelogConfig:
    return ChangelogConfig(
        base_path=root,
        dfs_timeout_ms=DEADLINE_MS,
        upload_timeout_ms=DEADLINE_MS,
        max_attempts=ATTEMPTS,
        retry_delay_ms=RETRY_DELAY_MS,
        persist_delay_ms=1.0,
    )


CALL_BOUND_S = call_bound_s(_config("unused"), CALL_SLACK_S)


class Episode:
    """One example: the job, its current plan, the model of what was reported committed."""

    def __init__(
        self,
        tmp: Path,
        seed: int,
        rate: float,
        hot: tuple[str | None, float],
        num_retained: int,
        tally: Tally,
        meter: DeadlineMeter,
    ) -> None:
        self.dfs, self.local = tmp / "dfs", tmp / "local"
        self.rng = random.Random(seed)
        self.rate = rate
        self.hot = hot
        self.num_retained = num_retained
        self.tally, self.meter = tally, meter
        self.work = Workload(seed)
        self.committed: tuple[int, State] | None = None
        #: failed checkpoints whose failure said the outcome is unknown: id -> state
        self.uncertain: dict[int, State] = {}
        self.plans: list[RandomFaults] = []
        self.plan: RandomFaults | None = None
        self.job: LocalJob | None = None
        self.crash_at: str | None = None
        self.thread = threading.current_thread()
        self.start(rate)

    # -- helpers ------------------------------------------------------------------------

    def problem(self, text: str) -> None:
        self.tally.problems.append(text)

    def timed(self, name: str, fn: Callable[[], T]) -> T:
        """Run an operation; it must end within the call bound per DFS call it made, plus slack."""
        plan = self.plan
        decided, calls = (plan.decided if plan else 0), self.meter.calls
        start = time.monotonic()
        try:
            return fn()
        finally:
            elapsed = time.monotonic() - start
            made = (plan.decided - decided if plan else 0) + (self.meter.calls - calls) * ATTEMPTS + 1
            bound = made * (DEADLINE_MS / 1000 + RETRY_DELAY_MS / 1000 * 2 ** (ATTEMPTS - 1)) + OPERATION_SLACK_S
            self.tally.operations_timed += 1
            self.tally.slowest_operation_s = max(self.tally.slowest_operation_s, elapsed)
            if elapsed > bound:
                self.problem(f"deadline: {name} took {elapsed:.2f} s > {bound:.2f} s ({made} DFS calls)")

    def hook(self, step: str) -> None:
        """The process dies at ``step``: its DFS at once; the caller unwinds if it is the episode's
        thread (a step reached in a background deletion's callback cannot be unwound in-process: the
        process goes on until ``checkpoint`` crashes it, but nothing more reaches the DFS)."""
        if self.crash_at == step and self.plan is not None:
            self.crash_at = None
            self.plan.crash()
            if threading.current_thread() is self.thread:
                raise Crash(step)

    def land_late(self) -> None:
        for plan in self.plans:
            self.tally.late_landed += plan.land_late()

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, rate: float) -> None:
        """Start a job (a restart if checkpoints exist); a start that fails is retried, at last healed."""
        parallelism = self.rng.choice([1, 2, 3])
        for attempt in range(RESTART_TRIES):
            faulty = rate if attempt < RESTART_TRIES - 1 else 0.0
            plan = RandomFaults(self.rng.getrandbits(32), faulty, DEADLINE_MS / 1000, *self.hot)
            self.plans.append(plan)
            self.plan = plan
            root = faulty_base_path(self.dfs, plan)
            try:
                job = self.timed("restart", functools.partial(self.open_job, root, parallelism))
            except Exception as exc:
                self.tally.restarts_failed += 1
                self.tally.failed("restart", exc)
                plan.crash()
                continue
            self.job = job
            self.tally.restarts += 1
            try:
                self.check_restored(job)
            except StorageError as exc:  # a lazy restore reads a key's chunk on access: the access
                self.tally.restarts_failed += 1  # fails, and the process restarts from the checkpoint
                self.tally.failed("first access after a restart", exc)
                with contextlib.suppress(Exception):
                    job.close()
                self.job = None
                plan.crash()
                continue
            return
        raise AssertionError("a restart on a healed DFS failed")

    def open_job(self, root: str, parallelism: int) -> LocalJob:
        options = JobOptions(
            changelog=_config("unused"),
            num_retained=self.num_retained,
            materialization=MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None),
        )
        return LocalJob(root, "job", [OperatorSpec("op", parallelism)], self.local, options, on_step=self.hook)

    def check_restored(self, job: LocalJob) -> None:
        restored = job.restored_from.checkpoint_id if job.restored_from is not None else None
        state = read_state(job)
        self.tally.states_checked += 1
        expected_id = self.committed[0] if self.committed else None
        if restored == expected_id:
            expected = self.committed[1] if self.committed else {}
        elif restored is not None and restored in self.uncertain and (expected_id is None or restored > expected_id):
            self.tally.resumed_uncertain += 1
            expected = self.uncertain[restored]
        else:
            self.problem(f"state: restored checkpoint {restored}, the last reported complete is {expected_id}")
            expected = state
        if state != expected:
            self.problem(f"state: checkpoint {restored} restored another state than was checkpointed")
        self.committed = (restored, expected) if restored is not None else None
        self.uncertain = {i: s for i, s in self.uncertain.items() if restored is None or i > restored}
        self.work.model = {k: (t, list(s), dict(m)) for k, (t, s, m) in expected.items()}

    def check_live(self) -> None:
        """The retained checkpoints end with the last one reported complete; their files exist."""
        assert self.job is not None
        completed = self.job.coordinator.completed
        if self.committed is not None and (not completed or completed[-1].checkpoint_id != self.committed[0]):
            self.problem(f"state: latest retained {[m.checkpoint_id for m in completed]}, reported {self.committed[0]}")
        job_dir = self.dfs / "job"
        for meta in completed:
            for path in sorted(meta.referenced_files() | {metadata_path(meta.checkpoint_id)}):
                if not (job_dir / path).exists():
                    self.problem(f"deleted: {path} of retained checkpoint {meta.checkpoint_id} is gone")

    def crash(self) -> None:
        """The process dies: nothing it does from now on reaches the DFS; a new one restarts."""
        assert self.job is not None and self.plan is not None
        self.tally.crashes += 1
        self.plan.crash()
        with contextlib.suppress(Exception):
            self.job.close()  # on a dead DFS: releases its local tables and threads, nothing else
        self.job = None
        if self.rng.random() < 0.5:  # what it sent late may land before the restart, or after
            self.land_late()
        self.start(self.rate)

    # -- steps --------------------------------------------------------------------------

    def run(self, events: int) -> None:
        assert self.job is not None
        self.work.run(self.job, events)

    def checkpoint(self, crash_at: str) -> None:
        job = self.job
        assert job is not None
        self.tally.checkpoint_attempts += 1
        if self.plan is not None and self.plan.rate == 0:
            self.tally.checkpoints_healed += 1
        state = snapshot_of(self.work)
        self.crash_at = crash_at or None
        checkpoint_id = None
        try:
            pending = self.timed("trigger", job.trigger_checkpoint)
            checkpoint_id = pending.checkpoint_id
            meta = self.timed("checkpoint", lambda: job.complete_checkpoint(pending))
        except Crash as crash:
            self.tally.crashes_in_protocol += 1
            if str(crash) != "before-metadata" and checkpoint_id is not None:  # it was committed
                self.committed = (checkpoint_id, state)
            self.crash()
            return
        except Exception as exc:
            self.tally.checkpoint_failed(exc)
            if checkpoint_id is not None and "outcome unknown" in str(exc):
                self.uncertain[checkpoint_id] = state
        else:
            self.tally.checkpoints_completed += 1
            self.committed = (meta.checkpoint_id, state)
        finally:
            self.crash_at = None
        if crash_at:  # the step was not reached: the crash comes right after
            self.crash()

    def materialize(self, wait: bool) -> None:
        assert self.job is not None
        self.tally.materializations += 1
        for subtask in self.job.all_subtasks():
            try:  # after a lazy restore it hydrates first, reading chunks: a failed read fails it
                subtask.materializer.trigger()
            except StorageError as exc:
                self.tally.failed("materialize", exc)
        if wait:
            for subtask in self.job.all_subtasks():
                try:
                    self.timed("materialize", subtask.materializer.wait)
                except Exception as exc:
                    self.tally.failed("materialize", exc)

    def finish(self) -> None:
        """A clean shutdown under faults, then restarts on a healed DFS: state and files exact."""
        assert self.job is not None and self.plan is not None
        try:
            self.timed("close", self.job.close)
        except Exception as exc:
            self.tally.failed("close", exc)
        self.plan.close()
        self.land_late()
        self.start(0.0)  # its recovery is the orphan cleanup
        self.check_files("after orphan cleanup", reservations=1)
        self.run(10)  # a checkpoint on the healed DFS lets the fences below it go
        self.checkpoint("")
        self.job.close()
        self.check_files("after a clean shutdown", reservations=2)  # the last run's, and this run's
        self.start(0.0)
        self.check_files("after a second orphan cleanup", reservations=1)
        self.job.close()
        for plan in self.plans:
            self.tally.add_plan(plan)
            plan.close()

    def check_files(self, when: str, reservations: int) -> None:
        """The job directory holds the retained checkpoints' ``_metadata`` and the files they name;
        besides, only bookkeeping: reservations of checkpoint ids (recovery keeps the highest),
        fences of ids above the latest checkpoint."""
        assert self.job is not None
        completed = self.job.coordinator.completed
        latest = completed[-1].checkpoint_id if completed else -1
        expected, present = expected_files(self.job), files_on_dfs(self.dfs / "job")
        extra = present - expected - self.left_in_place()
        blocks = {p for p in extra if parse_id_block_path(p) is not None}
        fences = {p for p in extra if p.endswith("/" + ABORTED_NAME) and _id_of(p) > latest}
        unreferenced = extra - fences - blocks
        if unreferenced or expected - present or len(blocks) > reservations:
            self.problem(
                f"leftover {when}: unreferenced {sorted(unreferenced)[:5]}, missing {sorted(expected - present)[:5]}, "
                f"id reservations {sorted(blocks)}"
            )

    def left_in_place(self) -> set[str]:
        """What recovery keeps of a damaged checkpoint within retention (a late ``_metadata`` whose
        fence was never written, naming released files): its ``_metadata`` and the files it names."""
        assert self.job is not None
        kept: set[str] = set()
        for path in self.job.coordinator.store.damaged:
            with contextlib.suppress(OSError, CheckpointError):
                meta = SnapshotMetadata.loads((self.dfs / "job" / path).read_bytes(), path)
                kept |= {path, *meta.referenced_files()}
        return kept


def _id_of(path: str) -> int:
    checkpoint_id = parse_checkpoint_dir(path.partition("/")[0])
    return -1 if checkpoint_id is None else checkpoint_id


STEP = st.one_of(
    st.tuples(st.just("run"), st.integers(1, 150)),
    st.tuples(st.just("run"), st.integers(1, 30)),
    st.tuples(st.just("checkpoint"), st.just("")),
    st.tuples(st.just("checkpoint"), st.just("")),
    st.tuples(st.just("checkpoint"), st.sampled_from(CRASH_POINTS)),
    st.tuples(st.just("materialize"), st.booleans()),
    st.tuples(st.just("land_late"), st.just(None)),
)


def _examples() -> int:
    override = os.environ.get("RANDOM_FAULT_EXAMPLES")
    if override:
        return int(override)
    profile = settings.default
    return max(3, min((profile.max_examples if profile else 60) // 3, 300))


def test_random_faults_keep_every_reported_checkpoint() -> None:
    tally = Tally()
    meter = DeadlineMeter(CALL_BOUND_S)

    @settings(max_examples=_examples(), deadline=None)
    @given(
        seed=st.integers(0, 2**32 - 1),
        rate=st.floats(0.2, 0.4),
        hot=st.sampled_from([None, "chk-*", "chk-*/_metadata", "chk-*/_aborted", "shared/*", "dstl/*", "_ids/*"]),
        hot_rate=st.floats(0.5, 0.9),
        num_retained=st.integers(1, 2),
        steps=st.lists(STEP, min_size=3, max_size=14),
    )
    def example(
        seed: int, rate: float, hot: str | None, hot_rate: float, num_retained: int, steps: list[tuple[str, Any]]
    ) -> None:
        problems = len(tally.problems)
        late = len(meter.late)
        tally.examples += 1
        with tempfile.TemporaryDirectory(prefix="random-faults-") as tmp:
            episode = Episode(Path(tmp), seed, rate, (hot, hot_rate), num_retained, tally, meter)
            for kind, arg in steps:
                if kind == "run":
                    episode.run(arg)
                elif kind == "checkpoint":
                    episode.checkpoint(arg)
                elif kind == "materialize":
                    episode.materialize(arg)
                else:
                    episode.land_late()
                episode.check_live()
            episode.run(20)
            episode.checkpoint("")
            episode.finish()
        new = tally.problems[problems:] + meter.late[late:]
        assert not new, "\n".join(new)

    with meter.installed():
        try:
            example()
        finally:
            print("\n" + tally.summary(meter))
    injected = sum(tally.faults.values())
    assert tally.dfs_calls and injected / tally.dfs_calls >= 0.2, tally.summary(meter)
