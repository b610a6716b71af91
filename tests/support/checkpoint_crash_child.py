"""Child process of the checkpoint crash tests: a ``LocalJob`` killed with SIGKILL at one step.

``python -m tests.support.checkpoint_crash_child ROOT LOCAL CRASH [K] [NUM_RETAINED] [PARALLELISM]`` (cwd:
the project root) runs the job ``JOB_ID`` on the DFS root ``ROOT`` (local LMDB directories under
``LOCAL``), resuming from its latest checkpoint if it has one (a job crashed before), processes
the next ``CHILD_EVENTS`` events of the deterministic stream ``events()`` and checkpoints every
``CHECKPOINT_EVERY`` events with ``{"events": n}`` in the checkpoint's properties. After every
``MATERIALIZE_EVERY``-th checkpoint every subtask is asked to materialize (``trigger()``, not
waited for); a small size trigger starts more materializations from ``poll()`` after each
checkpoint, and small caches make the backends log changes between checkpoints.

The process kills itself (``os.kill(os.getpid(), SIGKILL)``) at the ``K``-th occurrence of the
step ``CRASH`` (see ``CRASHES``): in a coordinator step hook (``LocalJob(on_step=...)``), in the
uploader (``LocalJob(uploader=...)``, a wrapper of ``FsspecUploader``) or in its own loop. When
the step never comes it exits with ``NOT_REACHED``. ``recover-delete`` reopens an existing job
instead and dies in its recovery.

The event stream, the state it builds (``apply``), its dict model (``model``) and how to read
the state back (``read_state``) live here so that parent and child agree on them.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from backend.checkpointing.ownership import is_ownership_file
from backend.core.descriptors import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from backend.core.errors import CheckpointError
from backend.core.serializers import Int64Serializer, StrSerializer
from backend.job import JobOptions, LocalJob, OperatorSpec
from dstl import ChangelogConfig
from dstl.atomic import temporary_path
from dstl.uploaders import FsspecUploader
from materializer.options import MaterializationOptions

JOB_ID = "job"
SEED = 20261121
NUM_KEYS = 48
MAX_PARALLELISM = 32
PARALLELISM = 2
CHECKPOINT_EVERY = 40
MATERIALIZE_EVERY = 2
CHILD_EVENTS = 400
TOTAL_EVENTS = 1_000
WAIT_S = 60.0
#: small caches and thresholds: changes spill to LMDB and are logged between checkpoints, where
#: pre-emptive persists may upload them in the middle of a batch (timing decides whether they do)
CACHE_LIMIT = 4
PREEMPTIVE_BYTES = 128
#: exit code of a child whose crash step never came
NOT_REACHED = 3

TOTALS, COUNTS = "totals", "counts"
TOTAL = ValueStateDescriptor("total", Int64Serializer())
AMOUNTS = ListStateDescriptor("amounts", Int64Serializer())
LAST = MapStateDescriptor("last", Int64Serializer(), user_key_serializer=StrSerializer())
COUNT = ValueStateDescriptor("count", Int64Serializer())
SEEN = MapStateDescriptor("seen", Int64Serializer(), user_key_serializer=StrSerializer())

#: crash steps: how the child dies at the K-th occurrence of the step
CRASHES = {
    "append": "before processing event K of the stream (between checkpoints, in the middle of a batch)",
    "dstl-put-before": "in the K-th upload of a dstl/ log file, before anything is written",
    "dstl-put-partial": "in the K-th upload of a dstl/ log file, leaving half of it in a temporary file",
    "dstl-put-after": "in the K-th upload of a dstl/ log file, after it was written (before it is acknowledged)",
    "chunk-put-before": "in the K-th upload of a shared/ chunk, before anything is written",
    "chunk-put-partial": "in the K-th upload of a shared/ chunk, leaving half of it in a temporary file",
    "chunk-put-after": "in the K-th upload of a shared/ chunk, after it was written",
    "metadata-put-partial": "in the K-th _metadata write, leaving half of it in a temporary file",
    "before-metadata": "at the K-th coordinator step 'before-metadata' (all handles acknowledged)",
    "after-metadata": "at the K-th coordinator step 'after-metadata' (committed, nothing registered)",
    "before-subsume": "at the K-th coordinator step 'before-subsume'",
    "after-subsume-metadata": "at the K-th 'after-subsume-metadata' (old _metadata gone, its files not)",
    "during-file-deletion": "at the K-th 'during-file-deletion' (first file of a subsumed checkpoint deleted)",
    "materialized": "right after the K-th forced materialization completed (chunks uploaded, none checkpointed)",
    "materialized-checkpoint": "before the _metadata of the checkpoint after the K-th forced materialization",
    "recover-delete": "reopen the existing job; die at the K-th file deletion of its recovery",
    "claim-put-after": "die right after the K-th write of an ownership claim (a start, before its recovery)",
    # faults after the commit point, then a crash: checkpoint K follows a waited materialization; the
    # fault hits its completion; the child goes on (a runtime retries), materializes again and dies
    "metadata-put-lost": "checkpoint K's _metadata is written but its put raises (a lost response)",
    "subsume-delete-error": "deleting the _metadata subsumed by checkpoint K raises once",
}
FAULTS = ("metadata-put-lost", "subsume-delete-error")


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


# -- the event stream, the state and its model -----------------------------------------------------


@cache
def events() -> tuple[tuple[int, int], ...]:
    """``TOTAL_EVENTS`` (key, amount) pairs from a seeded generator."""
    rng = random.Random(SEED)
    return tuple((rng.randrange(NUM_KEYS), rng.randrange(1, 100)) for _ in range(TOTAL_EVENTS))


def count_key(key: int, amount: int) -> str:
    return f"c{(key * 7 + amount) % 13}"


@dataclass
class Model:
    """What the states hold, per operator and key (absent keys hold nothing)."""

    total: dict[int, int] = field(default_factory=dict)
    amounts: dict[int, list[int]] = field(default_factory=dict)
    last: dict[int, dict[str, int]] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    seen: dict[str, dict[str, int]] = field(default_factory=dict)


def model(n: int) -> Model:
    """The state after the first ``n`` events."""
    m = Model()
    for i, (key, amount) in enumerate(events()[:n]):
        if amount % 17 == 0:
            m.total.pop(key, None)
        else:
            m.total[key] = m.total.get(key, 0) + amount
        if amount % 23 == 0:
            m.amounts.pop(key, None)
        else:
            m.amounts.setdefault(key, []).append(amount)
        m.last.setdefault(key, {})[f"m{amount % 5}"] = i
        if amount % 7 == 0:
            m.last[key].pop(f"m{(amount + 1) % 5}", None)
        ck = count_key(key, amount)
        m.count[ck] = m.count.get(ck, 0) + 1
        m.seen.setdefault(ck, {})[f"k{key}"] = amount
    return m


def apply(job: LocalJob, start: int, end: int) -> None:
    """Process events ``start..end-1`` (the same changes as ``model``)."""
    for i in range(start, end):
        key, amount = events()[i]
        b = job.backend_for(TOTALS, key)
        total, amounts, last = b.get_state(TOTAL), b.get_state(AMOUNTS), b.get_state(LAST)
        if amount % 17 == 0:
            total.clear()
        else:
            total.update((total.value() or 0) + amount)
        if amount % 23 == 0:
            amounts.clear()
        else:
            amounts.add(amount)
        last.put(f"m{amount % 5}", i)
        if amount % 7 == 0:
            last.remove(f"m{(amount + 1) % 5}")
        ck = count_key(key, amount)
        b = job.backend_for(COUNTS, ck)
        count, seen = b.get_state(COUNT), b.get_state(SEEN)
        count.update((count.value() or 0) + 1)
        seen.put(f"k{key}", amount)


def read_state(job: LocalJob) -> Model:
    """Everything the job's states hold for every key the stream can produce."""
    m = Model()
    for key in range(NUM_KEYS):
        b = job.backend_for(TOTALS, key)
        total = b.get_state(TOTAL).value()
        if total is not None:
            m.total[key] = total
        amounts = b.get_state(AMOUNTS).get()
        if amounts:
            m.amounts[key] = list(amounts)
        last = dict(b.get_state(LAST).items())
        if last:
            m.last[key] = last
    for ck in sorted({count_key(k, a) for k in range(NUM_KEYS) for a in range(1, 100)}):
        b = job.backend_for(COUNTS, ck)
        count = b.get_state(COUNT).value()
        if count is not None:
            m.count[ck] = count
        seen = dict(b.get_state(SEEN).items())
        if seen:
            m.seen[ck] = seen
    return m


# -- the job ---------------------------------------------------------------------------------------


def operators(parallelism: int = PARALLELISM) -> list[OperatorSpec]:
    return [OperatorSpec(uid, parallelism, MAX_PARALLELISM) for uid in (TOTALS, COUNTS)]


def open_job(root: Path, local: Path, parallelism: int = PARALLELISM, num_retained: int = 1, **kwargs: Any) -> LocalJob:
    """The job as every run (child or parent) opens it: small triggers, so that log files and chunks
    are uploaded between checkpoints."""
    config = ChangelogConfig(
        base_path=str(root / JOB_ID), preemptive_persist_threshold=PREEMPTIVE_BYTES, prefix_count=8
    )
    options = JobOptions(
        changelog=config,
        num_retained=num_retained,
        materialization=MaterializationOptions(size_trigger_bytes=6_000, chunk_key_groups=2),
    )
    job = LocalJob(root, JOB_ID, operators(parallelism), local, options, **kwargs)
    for subtask in job.all_subtasks():  # LocalJob has no cache_limit: spill (and log) between checkpoints
        b = subtask.backend
        b.cache_limit = b.flush_threshold = CACHE_LIMIT
        b.kg_flush_threshold = max(1, CACHE_LIMIT // len(b.key_group_range))
    return job


def force_materialization(job: LocalJob, wait: bool) -> None:
    for subtask in job.all_subtasks():
        subtask.materializer.wait(WAIT_S)
        subtask.materializer.trigger()
        if wait:
            subtask.materializer.wait(WAIT_S)


class CrashingUploader:
    """``FsspecUploader`` on the job directory that dies (or fails once) at the ``k``-th matching
    put or delete, as ``crash`` says."""

    def __init__(self, job_dir: str, crash: str, k: int) -> None:
        self.inner = FsspecUploader(job_dir)
        self.job_dir = job_dir
        self.crash = crash
        self.k = k
        self.puts: Counter[str] = Counter()
        self.deletes = 0
        #: the fault of a ``FAULTS`` crash, armed by the child for one checkpoint
        self.fault: str | None = None

    @staticmethod
    def _kind(path: str) -> str:
        if path.endswith("_metadata"):
            return "metadata"
        if is_ownership_file(path):
            return "claim"
        return {"dstl": "dstl", "shared": "chunk"}.get(path.split("/", 1)[0], "other")

    def _write_partial(self, path: str, data: bytes) -> None:
        """What a local write killed half-way leaves: a temporary file with part of the bytes."""
        full = f"{self.job_dir}/{path}"
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(temporary_path(full), "wb") as f:
            f.write(data[: len(data) // 2])

    async def put(self, path: str, data: bytes) -> None:
        kind = self._kind(path)
        self.puts[kind] += 1
        prefix = f"{kind}-put-"
        when = self.crash.removeprefix(prefix) if self.crash.startswith(prefix) and self.puts[kind] == self.k else None
        if when == "partial":
            self._write_partial(path, data)
            die()
        if when == "before":
            die()
        await self.inner.put(path, data)
        if when == "after":
            die()
        if self.fault == "metadata-put-lost" and kind == "metadata":
            self.fault = None
            raise OSError(f"injected: the response to the put of {path} was lost")

    async def get(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return await self.inner.get(path, offset, length)

    async def delete(self, path: str) -> None:
        if not is_ownership_file(path):  # counted: the orphans recovery deletes, not older claims
            self.deletes += 1
        if self.crash == "recover-delete" and self.deletes == self.k:
            die()
        if self.fault == "subsume-delete-error" and self._kind(path) == "metadata":
            self.fault = None
            raise OSError(f"injected: deleting {path} failed")
        await self.inner.delete(path)

    async def list(self, prefix: str = "") -> list[str]:
        return await self.inner.list(prefix)

    def remove_empty_directory(self, path: str) -> bool:
        return self.inner.remove_empty_directory(path)

    async def close(self) -> None:
        await self.inner.close()


def fault_then_crash(job: LocalJob, uploader: CrashingUploader, fault: str, events: int) -> None:
    """Checkpoint ``events`` names chunks no completed checkpoint named yet; its completion meets
    ``fault`` after the commit point; the job goes on, materializes again and is killed."""
    force_materialization(job, wait=True)
    uploader.fault = fault
    try:
        job.checkpoint({"events": events})
    except CheckpointError as exc:  # a failed _metadata put is a failed checkpoint, its cause chained
        print(f"checkpoint of {events} events failed: {exc}", file=sys.stderr)
    apply(job, events, events + CHECKPOINT_EVERY // 2)
    force_materialization(job, wait=True)
    die()


def main(argv: list[str]) -> None:
    root, local, crash = Path(argv[0]), Path(argv[1]), argv[2]
    k = int(argv[3]) if len(argv) > 3 else 1
    num_retained = int(argv[4]) if len(argv) > 4 else 1
    parallelism = int(argv[5]) if len(argv) > 5 else PARALLELISM
    if crash not in CRASHES:
        raise SystemExit(f"unknown crash step {crash!r}; one of {sorted(CRASHES)}")

    steps: Counter[str] = Counter()
    armed = {"before-metadata": False}

    def on_step(step: str) -> None:
        steps[step] += 1
        if step == crash and steps[step] == k:
            die()
        if step == "before-metadata" and armed["before-metadata"]:
            die()

    uploader = CrashingUploader(str(root / JOB_ID), crash, k)
    job = open_job(root, local, parallelism, num_retained, uploader=uploader, on_step=on_step)
    if crash == "recover-delete":
        job.close()
        print(f"recovery made {uploader.deletes} deletions, fewer than {k}", file=sys.stderr)
        raise SystemExit(NOT_REACHED)
    latest = job.coordinator.latest()  # a job crashed before resumes from its latest checkpoint
    start = int(latest.properties["events"]) if latest is not None else 0
    forced = 0
    for i in range(start, start + CHILD_EVENTS):
        if crash == "append" and i == k:
            die()
        apply(job, i, i + 1)
        if (i + 1) % CHECKPOINT_EVERY:
            continue
        if crash in FAULTS and (i + 1) // CHECKPOINT_EVERY == k:
            fault_then_crash(job, uploader, crash, i + 1)
        job.checkpoint({"events": i + 1})
        if (i + 1) % (CHECKPOINT_EVERY * MATERIALIZE_EVERY):
            continue
        forced += 1
        last = crash.startswith("materialized") and forced == k
        force_materialization(job, wait=last)
        if last and crash == "materialized":
            die()
        if last:  # materialized-checkpoint: the next checkpoint references the new chunks
            armed["before-metadata"] = True
    job.close()
    print(f"crash step {crash} #{k} never came: steps {dict(steps)}, puts {dict(uploader.puts)}", file=sys.stderr)
    raise SystemExit(NOT_REACHED)


if __name__ == "__main__":
    main(sys.argv[1:])
