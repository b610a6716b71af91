"""The workload of the checkpointing tests and what they check after it: deterministic events on
value, list and map state with a dict model of the result (``Workload``), the state a job reads back,
the files on the DFS against what retained checkpoints reference, and jobs that materialize only
when a test says so."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

from backend.checkpointing.metadata import OWNER_DIR, VOID_DIR, metadata_path, parse_id_block_path
from backend.core.descriptors import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from backend.core.handles import KeyedStateHandle
from backend.core.serializers import Int64Serializer, StrSerializer
from backend.job import JobOptions, LocalJob, OperatorSpec
from materializer.options import MaterializationOptions

TOTAL = ValueStateDescriptor("total", Int64Serializer())
SEEN = ListStateDescriptor("seen", Int64Serializer())
LAST = MapStateDescriptor("last", Int64Serializer(), user_key_serializer=StrSerializer())
KEYS = [f"user-{i}" for i in range(40)]
NEVER = 10**12  # ms: an interval no test reaches


class Workload:
    """Deterministic events on value, list and map state, with a dict model of the result."""

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.model: dict[str, tuple[int, list[int], dict[str, int]]] = {}

    def run(self, job: LocalJob, count: int, uid: str = "op") -> None:
        for _ in range(count):
            key, amount = self.rng.choice(KEYS), self.rng.randrange(100)
            backend = job.backend_for(uid, key)
            total, seen, last = backend.get_state(TOTAL), backend.get_state(SEEN), backend.get_state(LAST)
            total.update((total.value() or 0) + amount)
            if amount % 3 == 0:
                seen.add(amount)
            last.put(f"k{amount % 4}", amount)
            t, s, m = self.model.get(key, (0, [], {}))
            self.model[key] = (t + amount, [*s, amount] if amount % 3 == 0 else s, {**m, f"k{amount % 4}": amount})


def read_state(job: LocalJob, uid: str = "op") -> dict[str, tuple[int, list[int], dict[str, int]]]:
    out = {}
    for key in KEYS:
        backend = job.backend_for(uid, key)
        total = backend.get_state(TOTAL).value()
        if total is not None:
            out[key] = (total, backend.get_state(SEEN).get(), dict(backend.get_state(LAST).items()))
    return out


def files_on_dfs(job_dir: Path) -> set[str]:
    """The files under a job directory, less the bookkeeping that stays while the others go: the
    reservation of checkpoint ids with the highest end (``backend.checkpointing.ids``), the voided
    ids above the latest checkpoint and the owner's claim (``backend.checkpointing.ownership``)."""
    files = {p.relative_to(job_dir).as_posix() for p in job_dir.rglob("*") if p.is_file()}
    files = {p for p in files if not p.startswith((f"{OWNER_DIR}/", f"{VOID_DIR}/"))}
    reservations = {p: block[1] for p in files if (block := parse_id_block_path(p)) is not None}
    if reservations:
        files.discard(max(reservations, key=reservations.__getitem__))
    return files


def expected_files(job: LocalJob) -> set[str]:
    expected = set()
    for meta in job.coordinator.completed:
        expected |= meta.referenced_files() | {metadata_path(meta.checkpoint_id)}
    return expected


def assert_exact(job: LocalJob, job_dir: Path) -> None:
    """DFS files == what retained checkpoints reference, plus log files a live writer still holds
    (uploaded for a checkpoint that was aborted, not yet truncated: not confirmed, so the storage
    deletes them at truncation or close); registry counts == references."""
    job.storage.flush()
    extra = files_on_dfs(job_dir) - expected_files(job)
    held = {path for path, (refs, confirmed) in job.storage.tracked_files().items() if refs and not confirmed}
    assert extra <= held, extra - held
    assert expected_files(job) <= files_on_dfs(job_dir)
    counts: Counter[str] = Counter()
    for meta in job.coordinator.completed:
        counts.update(meta.referenced_files())
    assert {p: job.coordinator.registry.count(p) for p in counts} == dict(counts)
    assert job.coordinator.registry.files() == set(counts)


def materialize(job: LocalJob) -> None:
    for subtask in job.all_subtasks():
        subtask.materializer.trigger()
        subtask.materializer.wait()


State = dict[str, tuple[int, list[int], dict[str, int]]]


def make_job(root: str | Path, local: Path, **options: Any) -> LocalJob:
    options.setdefault("materialization", MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
    return LocalJob(root, "job", [OperatorSpec("op", 2)], local, JobOptions(**options))


def snapshot_of(work: Workload) -> State:
    return {k: (t, list(s), dict(m)) for k, (t, s, m) in work.model.items()}


def chunk_handle(path: str) -> KeyedStateHandle:
    """A handle of the operator ``op`` whose state is one chunk, at ``path``."""
    chunk = {"path": path, "key_groups": [0, 127], "scope": [0, 127], "sqn": 0, "size": 1, "entries": 1}
    return KeyedStateHandle.from_json(
        {"version": 1, "operator_id": "op", "checkpoint_id": 1, "max_parallelism": 128, "key_group_range": [0, 127],
         "states": {}, "materialized": [chunk], "changelog": []}
    )  # fmt: skip
