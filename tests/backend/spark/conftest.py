"""Fixtures of the Spark tests (the session itself, ``spark``, is in ``tests/conftest.py``):
``clean_workers`` for the tests that run ``backend.spark``'s tasks in this process,
``session_conf`` for the side-by-side tests (``side_by_side.py``), and ``backend``, a keyed
backend without a log for the tests that run a processor without a SparkSession."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.spark import committed, tasks
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import KeyGroupRange
from tests.backend.spark.appending_tasks import other_worker


@pytest.fixture
def clean_workers() -> Iterator[None]:
    """No worker state before and after the test: no kept backends (``other_worker``), no open
    storages (``backend.spark.tasks``' per-process caches), no claimed job directories."""
    other_worker()
    yield
    other_worker()
    for storage in tasks._STORAGES.values():
        storage.close()
    tasks._STORAGES.clear()
    committed._CLAIMED.clear()


@pytest.fixture
def session_conf(spark: Any) -> Iterator[Any]:
    """Batches only when a file arrives (Spark's ProcessingTime timers would otherwise run batches
    without input and processAllAvailable would not return); one partition, so that a batch's rows
    meet in one Arrow batch on both sides (transformWithStateInPandas takes an int column with a
    null as float for a whole Arrow batch) and each batch is one task; the session's conf restored
    after."""
    keys = ("spark.sql.session.timeZone", "spark.sql.streaming.noDataMicroBatches.enabled",
            "spark.sql.shuffle.partitions")  # fmt: skip
    saved = {k: spark.conf.get(k) for k in keys}
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    spark.conf.set("spark.sql.shuffle.partitions", "1")
    try:
        yield spark
    finally:
        for key, value in saved.items():
            spark.conf.set(key, value)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[ChangelogKeyedStateBackend]:
    b = ChangelogKeyedStateBackend("op", KeyGroupRange(0, 127), tmp_path / "local", storage=None, log_enabled=False)
    yield b
    b.close()
