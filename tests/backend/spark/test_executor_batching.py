"""The tasks an executor runs at once share one log file per batch (issue 18), without a Spark
session: Spark tasks are ``run_subtasks`` calls on threads of one process, as the tasks of one
executor's Python workers would run, through the process's own storage or the host's changelog
service (``dstl.service``)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from backend.spark import tasks
from backend.spark.config import OperatorConfig
from backend.spark.driver import DriverCoordinator
from tests.backend.spark.appending_tasks import KEYS, appender, config, read_all

pytestmark = pytest.mark.usefixtures("clean_workers")  # every test starts and ends with no worker state

WAIT_S = 60


def run_concurrently(cfg: OperatorConfig, batch: int, value: int) -> None:
    """Every task of ``batch`` on a thread of its own; each waits in its body until all have
    started, so every task's subtasks expect to persist before any task persists."""
    started = threading.Barrier(cfg.task_count, timeout=WAIT_S)
    errors: list[BaseException] = []

    def body(subtask: int, backend: Any, now: int, watermarks: Any) -> list[Any]:
        if subtask == cfg.subtasks_of_task(cfg.task_of_subtask(subtask))[0]:
            started.wait()
        return list(appender(value)(backend, now, watermarks))

    def run(task: int) -> None:
        try:
            tasks.run_subtasks(cfg, cfg.subtasks_of_task(task), batch, "q", 1, body)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(cfg.task_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not errors, errors


def log_files_of_batch(root: Path, batch: int) -> set[str]:
    """The files holding the changes of ``batch``: those under ``pending/<batch>`` (the subtasks'
    records ride in them as notes) and any other log file written meanwhile."""
    files = {p.name for p in (root / "state" / "pending" / str(batch) / "op").iterdir()}
    return files | {p.name for p in (root / "state").glob("dstl/*/*")}


@pytest.mark.parametrize("service", [False, True], ids=["own storage", "changelog service"])
def test_the_tasks_an_executor_runs_at_once_share_one_log_file_per_batch(tmp_path: Path, service: bool) -> None:
    # a zero persist delay: without waiting for the other task, each task would flush alone
    cfg = config(tmp_path, 8, tasks=2, changelog_service=service)
    cfg = _with_changelog(cfg, persist_delay_ms=0.0, expected_persist_wait_ms=600_000)
    for batch in range(3):
        run_concurrently(cfg, batch, batch)
        assert len(log_files_of_batch(tmp_path, batch)) == 1
    assert read_all(cfg, 2) == {k: [0, 1, 2] for k in KEYS}


def test_a_killed_changelog_service_costs_the_kept_backends_not_the_state(tmp_path: Path) -> None:
    """The service dies between batches: the kept backends' writers are gone, so the next task
    adopts their tables with new writers on a new service; nothing is lost or counted twice."""
    cfg = config(tmp_path, 4, tasks=2, changelog_service=True)
    driver = DriverCoordinator(cfg)
    driver.register(cfg)
    run_concurrently(cfg, 0, 0)
    driver.complete_batch(0, "q")
    storage = next(iter(tasks._STORAGES.values()))
    first_pid = storage.service_pid  # type: ignore[attr-defined]
    os.kill(first_pid, signal.SIGKILL)
    if storage.service_process is not None:  # type: ignore[attr-defined]
        storage.service_process.wait(WAIT_S)  # type: ignore[attr-defined]  # started by this process: reap it
    stats = [s for t in range(cfg.task_count) for s in _run_task(cfg, t, 1, 1)]
    assert {s["source"] for s in stats} == {"local"}
    assert storage.service_pid != first_pid  # type: ignore[attr-defined]
    driver.complete_batch(1, "q")
    assert read_all(cfg, 1) == {k: [0, 1] for k in KEYS}
    driver.close()


def _run_task(cfg: OperatorConfig, task: int, batch: int, value: int) -> list[dict[str, Any]]:
    body = lambda _, *a: appender(value)(*a)  # noqa: E731
    return tasks.run_subtasks(cfg, cfg.subtasks_of_task(task), batch, "q", 1, body)[1]


def _with_changelog(cfg: OperatorConfig, **overrides: Any) -> OperatorConfig:
    from dataclasses import replace

    return replace(cfg, changelog=replace(cfg.changelog, **overrides))
