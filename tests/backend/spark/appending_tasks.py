"""Tasks of ``backend.spark`` run without a Spark session, as a Spark task would run them: an
operator config on a local directory, a task body that appends to the list state of every key its
subtask owns, every task of a batch, a change of Python worker, and the state read back as a fresh
worker restores it. The ``clean_workers`` fixture (``conftest.py``) starts and ends a test with no
worker state."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

from backend.core.descriptors import ListStateDescriptor
from backend.core.keygroups import assign_key_group
from backend.core.serializers import Int64Serializer
from backend.core.serializers.keys import serialize_key
from backend.spark import tasks
from backend.spark.config import OperatorConfig
from backend.spark.tasks import run_subtask
from dstl import ChangelogConfig
from materializer.options import MaterializationOptions

SEEN = ListStateDescriptor("seen", Int64Serializer())
KEYS = [(f"k{i}",) for i in range(60)]


def config(
    root: Path, parallelism: int, uid: str = "op", host: str = "a",
    size_trigger_bytes: int | None = MaterializationOptions.size_trigger_bytes, **kw: Any,
) -> OperatorConfig:  # fmt: skip
    """One task per subtask, each worker with a storage of its own (no changelog service), no
    materialization by time."""
    job = str(root / "state")
    kw.setdefault("tasks", parallelism)
    kw.setdefault("changelog_service", False)
    return OperatorConfig(
        job_dir=job, uid=uid, parallelism=parallelism, max_parallelism=128, local_root=str(root / host),
        changelog=ChangelogConfig(base_path=job),
        materialization=MaterializationOptions(interval_ms=10**12, size_trigger_bytes=size_trigger_bytes), **kw,
    )  # fmt: skip


def appender(value: int) -> Any:
    """A task body: append ``value`` to the list state of every key the subtask owns."""

    def process(backend: Any, now: int, watermark: Any) -> list[Any]:
        for key in KEYS:
            if backend.key_group_of(key) in backend.key_group_range:
                backend.set_current_key(key)
                backend.get_state(SEEN).add(value)
        return []

    return process


def other_worker(finish_uploads: bool = True) -> None:
    """The next task of every subtask runs in another Python worker of the host. A materialization
    this worker still uploads finishes first (as in a worker that lives on, or exits normally: the
    interpreter waits for the upload thread); with ``finish_uploads=False`` the worker drops its
    backends at once, as a worker that runs the subtask again after another one did: the upload
    fails at its next read of the closed tables, or finishes if it read them all."""
    for kept in tasks._KEPT.values():
        running = kept.materializer.in_flight
        if finish_uploads and running is not None:
            concurrent.futures.wait([running])
        tasks._discard(kept)
    tasks._KEPT.clear()


def collector(seen: dict[tuple[str], list[int]]) -> Any:
    """A task body: reads the list state of every key the subtask owns into ``seen``."""

    def collect(backend: Any, now: int, watermark: Any) -> list[Any]:
        for key in KEYS:
            if backend.key_group_of(key) in backend.key_group_range:
                backend.set_current_key(key)
                seen[key] = backend.get_state(SEEN).get()
        return []

    return collect


def read_all(cfg: OperatorConfig, batch: int) -> dict[tuple[str], list[int]]:
    """The state after ``batch`` as a fresh worker would restore it."""
    other_worker()
    seen: dict[tuple[str], list[int]] = {}

    collect = collector(seen)

    probe = config(Path(cfg.job_dir).parent, cfg.parallelism, cfg.uid, host="probe")
    for i in range(cfg.parallelism):
        run_subtask(probe, i, batch + 1, "q", 1, collect)
    other_worker()
    return seen


def run_tasks(cfg: OperatorConfig, batch: int, value: int) -> list[dict[str, Any]]:
    """Every Spark task of ``batch`` as ``backend.spark.plan`` runs it: its subtasks in one call."""
    stats: list[dict[str, Any]] = []
    for task in range(cfg.task_count):
        subtasks = cfg.subtasks_of_task(task)
        stats += tasks.run_subtasks(cfg, subtasks, batch, "q", 1, lambda _, *a: appender(value)(*a))[1]
    return stats


def key_group(key: tuple[str]) -> int:
    """The key group of ``key`` at the configs' max parallelism (128)."""
    return assign_key_group(serialize_key(key), 128)
