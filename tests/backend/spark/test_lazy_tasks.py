"""Lazy loading in ``backend.spark``'s tasks, without a Spark session (``appending_tasks``): a task
restoring a subtask from the DFS with ``state_loading="lazy"`` serves its batch before the state is
local, loads ``hydration_key_groups`` more key groups after each batch until it is, and ends with
the state an eager restore gives; local tables a lazy restore left partly loaded are not adopted
by another worker, which restores from the DFS instead."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from backend.spark.config import OperatorConfig
from backend.spark.tasks import run_subtask
from tests.backend.spark.appending_tasks import KEYS, config, other_worker, read_all

pytestmark = pytest.mark.usefixtures("clean_workers")

STEP = 16  # key groups per batch: a subtask of 64 is local after 4 batches


def appending(value: int, keys: list[tuple[str]]) -> Any:
    """A task body appending ``value`` to the list state of those of ``keys`` the subtask owns,
    reading them ahead as the runners do (``backend.batch``)."""
    from tests.backend.spark.appending_tasks import SEEN

    def process(backend: Any, now: int, watermark: Any) -> list[Any]:
        mine = [k for k in keys if backend.key_group_of(k) in backend.key_group_range]
        with backend.batch(mine):
            for key in mine:
                backend.set_current_key(key)
                backend.get_state(SEEN).add(value)
        return []

    return process


def run_batch(cfg: OperatorConfig, batch: int, keys: list[tuple[str]] = KEYS) -> list[dict[str, Any]]:
    return [run_subtask(cfg, i, batch, "q", 1, appending(batch, keys))[1] for i in range(cfg.parallelism)]


def materialized_state(tmp_path: Path, batches: int) -> None:
    """``batches`` batches of every key, materialized on the way (chunks and a log after them),
    then the host's local directory and the workers' kept backends gone."""
    cfg = config(tmp_path, 2, size_trigger_bytes=1_000)
    for batch in range(batches):
        run_batch(cfg, batch)
        other_worker()  # the materialization's upload ends, the next worker takes its result
    shutil.rmtree(tmp_path / "a")


def test_a_lazy_restore_serves_the_batch_then_becomes_local_over_a_few_batches(tmp_path: Path) -> None:
    materialized_state(tmp_path, 4)
    cfg = config(tmp_path, 2, size_trigger_bytes=1_000, state_loading="lazy", hydration_key_groups=STEP)
    some = KEYS[::7]
    first = run_batch(cfg, 4, some)
    assert [s["source"] for s in first] == ["dfs", "dfs"]
    assert [(s["hydrated"], s["fully_local"]) for s in first] == [(STEP, False)] * 2
    batches = 1
    while not all(s["fully_local"] for s in run_batch(cfg, 4 + batches, some)):
        batches += 1
    assert batches < 64 // STEP  # at least STEP key groups per batch (those without state are skipped)
    expected = {k: [0, 1, 2, 3] + ([*range(4, 5 + batches)] if k in some else []) for k in KEYS}
    assert read_all(cfg, 4 + batches) == expected


def test_lazy_and_eager_restores_give_the_same_state(tmp_path: Path) -> None:
    seen = {}
    for loading in ("eager", "lazy"):
        root = tmp_path / loading
        materialized_state(root, 3)
        cfg = config(root, 3, state_loading=loading)  # and rescaled from 2 subtasks to 3
        run_batch(cfg, 3, KEYS[:20])
        run_batch(cfg, 4, KEYS[10:])
        seen[loading] = read_all(cfg, 4)
    assert seen["lazy"] == seen["eager"]
    assert seen["lazy"][KEYS[15]] == [0, 1, 2, 3, 4]


def test_tables_a_lazy_restore_left_partly_loaded_are_restored_from_the_dfs(tmp_path: Path) -> None:
    """Another Python worker of the host runs the next batch: the marker says the tables hold the
    state after the previous batch, but only part of it is loaded. Adopting them would lose the
    rest; the task restores from the DFS (lazily again)."""
    materialized_state(tmp_path, 3)
    cfg = config(tmp_path, 2, state_loading="lazy", hydration_key_groups=1)
    assert not any(s["fully_local"] for s in run_batch(cfg, 3, KEYS[:10]))
    other_worker()
    stats = run_batch(cfg, 4, KEYS[:10])
    assert [s["source"] for s in stats] == ["dfs", "dfs"]
    other_worker()
    eager = config(tmp_path, 2)  # its tables are partly loaded too: it restores, eagerly
    stats = run_batch(eager, 5, KEYS[:10])
    assert [(s["source"], s["fully_local"]) for s in stats] == [("dfs", True)] * 2
    assert read_all(eager, 5) == {k: [0, 1, 2, *([3, 4, 5] if k in KEYS[:10] else [])] for k in KEYS}
