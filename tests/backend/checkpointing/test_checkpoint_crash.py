"""A ``LocalJob`` killed with SIGKILL at every step of the checkpoint protocol, then restarted.

Each test runs ``tests.support.checkpoint_crash_child`` in a subprocess that kills itself at one step
(appending, uploading a log file or a chunk, writing ``_metadata``, before and after the commit,
subsuming, deleting files, after a materialization), checks that it died by SIGKILL, then restarts
the job on the same directory (recovery: registry rebuilt, orphans deleted) and checks:

1. the restored state equals the model of the first ``events`` events, ``events`` being the
   property of the latest completed checkpoint (none: empty state);
2. the files under the job directory are exactly the retained checkpoints' ``_metadata`` plus the
   files they reference: nothing leaked, nothing missing;
3. the job continues: more events, a materialization, checkpoints (subsuming the crashed run's
   checkpoints and deleting their files), and a second restart sees the right state and files.

Some cases restart at another parallelism, kill a job resumed from a first crash (its checkpoints
name the first run's files), or kill the recovery itself. Two cases inject a failure after the
commit point (a failed subsumption delete, a lost ``_metadata`` PUT response): the checkpoint must
stay committed, the job goes on, then crashes. Nothing
waits by sleeping: the child runs to its crash.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.checkpointing.metadata import METADATA_NAME, SnapshotMetadata, metadata_path
from backend.core.errors import StateRestoreError
from backend.job import LocalJob
from dstl.atomic import is_temporary
from tests.backend.checkpointing.crashes import crash
from tests.backend.checkpointing.workloads import files_on_dfs
from tests.support.checkpoint_crash_child import (
    CHECKPOINT_EVERY,
    JOB_ID,
    PARALLELISM,
    force_materialization,
    model,
    open_job,
    read_state,
)
from tests.support.checkpoint_crash_child import apply as process


@dataclass(frozen=True)
class Case:
    id: str
    crash: str  # a step of tests.support.checkpoint_crash_child.CRASHES
    k: int  # its occurrence
    num_retained: int = 1
    #: the ``events`` of the latest checkpoint that must survive, when the crash step fixes it
    #: (uploads may include pre-emptive ones, so a k-th upload does not name one checkpoint)
    events: int | None = None
    #: a first crash (step, k) before this one: the case's child resumes the job at ``parallelism``
    previous: tuple[str, int] | None = None
    parallelism: int = PARALLELISM
    #: then restart and kill the recovery at its n-th file deletion
    recovery_kill: int | None = None
    #: the reason of a known bug this case hits (the case is then a strict xfail)
    bug: str | None = None

    def param(self) -> object:
        marks = [pytest.mark.xfail(strict=True, raises=StateRestoreError, reason=self.bug)] if self.bug else []
        return pytest.param(self, id=self.id, marks=marks)


def nth_checkpoint(n: int) -> int:
    """The ``events`` property of the child's ``n``-th checkpoint."""
    return n * CHECKPOINT_EVERY


CASES = [
    # appending between checkpoints: right after a forced materialization started, and later
    Case("append-after-materialization-start", "append", 2 * CHECKPOINT_EVERY + 5, events=nth_checkpoint(2)),
    Case("append-mid-batch", "append", 7 * CHECKPOINT_EVERY + 13, events=nth_checkpoint(7)),
    # a log file upload (a checkpoint's persist or a pre-emptive one)
    Case("dstl-put-before-write", "dstl-put-before", 4),
    Case("dstl-put-partial-write", "dstl-put-partial", 6),
    Case("dstl-put-after-write", "dstl-put-after", 7),
    # persisted, not committed; committed, not registered
    Case("before-metadata", "before-metadata", 5, events=nth_checkpoint(4)),
    Case("after-metadata", "after-metadata", 5, events=nth_checkpoint(5)),
    Case("after-metadata-retain-2", "after-metadata", 5, num_retained=2, events=nth_checkpoint(5)),
    # the _metadata write itself: a half-written temporary file
    Case("metadata-partial-write", "metadata-put-partial", 4, events=nth_checkpoint(3)),
    # subsumption (the k-th subsumption is that of checkpoint k + num_retained) and file deletion
    Case("before-subsume-retain-1", "before-subsume", 3, events=nth_checkpoint(4)),
    Case("before-subsume-retain-2", "before-subsume", 3, num_retained=2, events=nth_checkpoint(5)),
    Case("after-subsume-metadata-retain-1", "after-subsume-metadata", 3, events=nth_checkpoint(4)),
    Case("after-subsume-metadata-retain-2", "after-subsume-metadata", 3, num_retained=2, events=nth_checkpoint(5)),
    Case("during-file-deletion-retain-1", "during-file-deletion", 2),
    Case("during-file-deletion-retain-2", "during-file-deletion", 2, num_retained=2),
    # materialization: a chunk upload (the first materialization, later ones), after the upload;
    # a materialization uploads one pack of chunks per subtask (materializer.packs)
    Case("chunk-put-before-write", "chunk-put-before", 2),
    Case("chunk-put-partial-write", "chunk-put-partial", 9),
    Case("chunk-put-after-write", "chunk-put-after", 15),
    Case("chunk-put-after-write-retain-2", "chunk-put-after", 11, num_retained=2),
    Case("materialized-before-checkpoint", "materialized", 2, events=nth_checkpoint(4)),
    Case("materialized-checkpoint-before-metadata", "materialized-checkpoint", 2, events=nth_checkpoint(4)),
    # the recovery itself killed half-way through its deletions, then recovered again
    Case("after-metadata-then-recovery-killed", "after-metadata", 5, events=nth_checkpoint(5), recovery_kill=2),
    Case(
        "during-file-deletion-retain-2-then-recovery-killed",
        "during-file-deletion",
        2,
        num_retained=2,
        recovery_kill=3,
    ),
    # a second crash in a job resumed (at parallelism 3) from the first crash's latest checkpoint:
    # its checkpoints name the first run's log files and chunks until its first materialization
    Case(
        "resumed-at-3-after-metadata",
        "after-metadata",
        2,
        events=nth_checkpoint(5),
        previous=("after-metadata", 3),
        parallelism=3,
    ),
    Case(
        "resumed-at-3-during-file-deletion-retain-2",
        "during-file-deletion",
        1,
        num_retained=2,
        previous=("before-metadata", 4),
        parallelism=3,
    ),
    Case("resumed-at-3-chunk-put-partial", "chunk-put-partial", 10, previous=("chunk-put-after", 12), parallelism=3),
    # a failure after the commit point, the job goes on, then a crash
    Case("subsume-delete-error", "subsume-delete-error", 4, events=nth_checkpoint(4)),
    Case("metadata-put-lost", "metadata-put-lost", 4),
]
BY_ID = {case.id: case for case in CASES}
RESCALED = ["after-metadata", "during-file-deletion-retain-2", "chunk-put-after-write", "metadata-partial-write"]


# -- helpers --------------------------------------------------------------------------------------


def checkpoints_on_dfs(job_dir: Path) -> list[SnapshotMetadata]:
    """Every ``chk-*/_metadata`` under the job directory, parsed, oldest first."""
    metas = [SnapshotMetadata.loads(p.read_bytes(), str(p)) for p in job_dir.glob(f"chk-*/{METADATA_NAME}")]
    return sorted(metas, key=lambda m: m.checkpoint_id)


def check_recovered(job: LocalJob, job_dir: Path, num_retained: int) -> int:
    """The invariants right after a restart; returns the ``events`` the state was restored to."""
    on_dfs = checkpoints_on_dfs(job_dir)
    retained = job.coordinator.completed
    assert [m.checkpoint_id for m in on_dfs] == [m.checkpoint_id for m in retained]
    assert len(retained) <= num_retained
    expected = set()
    counts: Counter[str] = Counter()
    for meta in on_dfs:
        expected |= meta.referenced_files() | {metadata_path(meta.checkpoint_id)}
        counts.update(meta.referenced_files())
    assert {p: job.coordinator.registry.count(p) for p in counts} == dict(counts)
    assert job.coordinator.registry.files() == set(counts)
    files = files_on_dfs(job_dir)
    assert not files - expected, f"leaked after recovery: {sorted(files - expected)}"
    assert not expected - files, f"referenced but missing: {sorted(expected - files)}"

    latest = job.coordinator.latest()
    events = int(latest.properties["events"]) if latest is not None else 0
    assert job.restored_from == latest
    assert read_state(job) == model(events), f"state restored from {events} events differs from the model"
    return events


def continue_and_restart(
    root: Path, local: Path, events: int, num_retained: int, parallelism: int, final_parallelism: int
) -> None:
    """Recover, check, run on (materialization and checkpoints subsume the crashed run's), restart, check."""
    job_dir = root / JOB_ID
    job = open_job(root, local, parallelism, num_retained)
    try:
        assert check_recovered(job, job_dir, num_retained) == events
        process(job, events, events + 30)
        job.checkpoint({"events": events + 30})
        force_materialization(job, wait=True)
        process(job, events + 30, events + 60)
        job.checkpoint({"events": events + 60})
        process(job, events + 60, events + 75)
        job.checkpoint({"events": events + 75})
        assert read_state(job) == model(events + 75)
        job.storage.flush()  # subsumption deletes in the background
        assert {m.checkpoint_id for m in checkpoints_on_dfs(job_dir)} == {
            m.checkpoint_id for m in job.coordinator.completed
        }
        for meta in job.coordinator.completed:  # everything a retained checkpoint names is there
            assert meta.referenced_files() <= files_on_dfs(job_dir)
        process(job, events + 75, events + 90)  # not checkpointed: lost
    finally:
        job.close()

    job = open_job(root, local, final_parallelism, num_retained)
    try:
        assert check_recovered(job, job_dir, num_retained) == events + 75
    finally:
        job.close()


def crash_and_recover(tmp_path: Path, case: Case, parallelism: int, final_parallelism: int) -> None:
    root, local = tmp_path / "dfs", tmp_path / "local"
    if case.previous is not None:
        crash(root, local, *case.previous, case.num_retained)
    crash(root, local, case.crash, case.k, case.num_retained, case.parallelism)
    job_dir = root / JOB_ID
    if case.crash.endswith("-put-partial"):  # the crash left what a killed local write leaves
        assert [p for p in job_dir.rglob("*") if is_temporary(p.name)]
    latest = checkpoints_on_dfs(job_dir)
    events = int(latest[-1].properties["events"]) if latest else 0
    if case.events is not None:
        assert events == case.events
    if case.recovery_kill is not None:
        orphans = files_on_dfs(job_dir)
        crash(root, local, "recover-delete", case.recovery_kill, case.num_retained)
        assert files_on_dfs(job_dir) < orphans  # the recovery had started deleting
    continue_and_restart(root, local, events, case.num_retained, parallelism, final_parallelism)


# -- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_crash_then_recover(tmp_path: Path, case: Case) -> None:
    crash_and_recover(tmp_path, case, PARALLELISM, PARALLELISM)


@pytest.mark.parametrize("case_id", RESCALED)
def test_crash_then_recover_at_another_parallelism(tmp_path: Path, case_id: str) -> None:
    crash_and_recover(tmp_path, BY_ID[case_id], parallelism=3, final_parallelism=PARALLELISM)
