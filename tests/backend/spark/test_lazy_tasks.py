"""Lazy loading in ``backend.spark``'s tasks, without a Spark session (``appending_tasks``): a task
restoring a subtask from the DFS with ``state_loading="lazy"`` (the default) serves its batch
before the state is local, loads ``hydration_key_groups`` more key groups after each batch until it
is, and ends with the state an eager restore gives; local tables a lazy restore left partly loaded
are adopted by another worker, which goes on loading them (with ``state_loading="eager"`` it loads
the rest before the batch runs)."""

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
        out = []
        with backend.batch(mine):
            for key in mine:
                backend.set_current_key(key)
                backend.get_state(SEEN).add(value)
                out.append((key, backend.get_state(SEEN).get()))
        return out

    return process


def run_batch(cfg: OperatorConfig, batch: int, keys: list[tuple[str]] = KEYS) -> list[dict[str, Any]]:
    return run_batch_outputs(cfg, batch, keys)[1]


def run_batch_outputs(
    cfg: OperatorConfig, batch: int, keys: list[tuple[str]] = KEYS
) -> tuple[dict[tuple[str], list[int]], list[dict[str, Any]]]:
    """Every subtask's task of ``batch``: the outputs (each key's list after the append) and figures."""
    outputs: dict[tuple[str], list[int]] = {}
    stats = []
    for i in range(cfg.parallelism):
        out, figures = run_subtask(cfg, i, batch, "q", 1, appending(batch, keys))
        outputs.update(out)
        stats.append(figures)
    return outputs, stats


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


def test_another_worker_adopts_tables_a_lazy_restore_left_partly_loaded(tmp_path: Path) -> None:
    """Each next batch runs in another Python worker of the host: the marker says the tables hold
    the state after the previous batch, partly loaded; the worker adopts them (source "local", no
    restore from the DFS) and goes on loading them until they are local."""
    materialized_state(tmp_path, 3)
    cfg = config(tmp_path, 2, hydration_key_groups=STEP)
    assert cfg.state_loading == "lazy"
    some = KEYS[:10]
    outputs, stats = run_batch_outputs(cfg, 3, some)
    assert [(s["source"], s["fully_local"]) for s in stats] == [("dfs", False)] * 2
    assert outputs == {k: [0, 1, 2, 3] for k in some}
    batch = 3
    while not all(s["fully_local"] for s in stats):
        other_worker()
        batch += 1
        outputs, stats = run_batch_outputs(cfg, batch, some)
        assert [s["source"] for s in stats] == ["local", "local"]
        assert [s["hydrated"] > 0 for s in stats] == [True, True] or all(s["fully_local"] for s in stats)
        assert outputs == {k: [0, 1, 2, *range(3, batch + 1)] for k in some}
    assert batch - 3 < 64 // STEP  # as fast as in one worker: nothing is loaded twice
    assert read_all(cfg, batch) == {k: [0, 1, 2, *(range(3, batch + 1) if k in some else [])] for k in KEYS}


def test_an_eager_task_adopting_partly_loaded_tables_loads_the_rest_first(tmp_path: Path) -> None:
    materialized_state(tmp_path, 3)
    lazy = config(tmp_path, 2, hydration_key_groups=1)
    assert not any(s["fully_local"] for s in run_batch(lazy, 3, KEYS[:10]))
    other_worker()
    eager = config(tmp_path, 2, state_loading="eager")
    outputs, stats = run_batch_outputs(eager, 4, KEYS[:10])
    assert [(s["source"], s["hydrated"], s["fully_local"]) for s in stats] == [("local", 0, True)] * 2
    assert outputs == {k: [0, 1, 2, 3, 4] for k in KEYS[:10]}
    assert read_all(eager, 4) == {k: [0, 1, 2, *([3, 4] if k in KEYS[:10] else [])] for k in KEYS}
