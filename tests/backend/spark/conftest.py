"""Fixtures of the Spark tests (the session itself, ``spark``, is in ``tests/conftest.py``):
``clean_workers`` for the tests that run ``backend.spark``'s tasks in this process,
``session_conf`` for the side-by-side tests (``side_by_side.py``), ``backend``, a keyed
backend without a log for the tests that run a processor without a SparkSession, and ``connect``,
a Spark Connect session on a server of its own (``connect_server.py``), one for the test session."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
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


#: how long the Connect server may take to start (a JVM and Spark on a loaded two-core machine), seconds
CONNECT_START_S = 240.0


@contextlib.contextmanager
def connect_server(*args: str) -> Iterator[str]:
    """A Spark Connect server in a process of its own (``tests/backend/spark/connect_server.py``,
    given ``args``) while the context lasts; its URL. It stops when its standard input closes."""
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.backend.spark.connect_server", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert server.stdout is not None and server.stdin is not None
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(server.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(CONNECT_START_S)
    try:
        if not ready or not ready[0].strip().isdigit():
            raise RuntimeError(f"the Spark Connect server did not start in {CONNECT_START_S} s (exit {server.poll()})")
        yield f"sc://127.0.0.1:{int(ready[0])}"
    finally:
        server.stdin.close()
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="session")
def connect_url() -> Iterator[str]:
    """The test session's Spark Connect server (``connect_server``); its URL."""
    pytest.importorskip("pyspark")
    pytest.importorskip("grpc")
    with connect_server() as url:
        yield url


def connect_client(url: str) -> Any:
    """A new Spark Connect session (a client, as a user's process starts one) on ``url``."""
    from pyspark.sql.connect.session import SparkSession

    return SparkSession.builder.remote(url).create()


@pytest.fixture(scope="session")
def connect_session(connect_url: str) -> Iterator[Any]:
    session = connect_client(connect_url)
    yield session
    from backend.spark import server_listener

    server_listener.remove_server_listeners(session)
    session.stop()


@pytest.fixture
def connect(connect_session: Any) -> Iterator[Any]:
    """The Connect session for one test, with pyspark in Connect mode meanwhile (its functions
    build Connect columns, as in a process that only has a Connect session; the classic ``spark``
    fixture's tests run without it); the drop-in's client-side coordinators closed after."""
    from backend.spark import driver

    saved = os.environ.get("SPARK_CONNECT_MODE_ENABLED")
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    driver.forget_all()
    try:
        yield connect_session
    finally:
        driver.forget_all()
        if saved is None:
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
        else:
            os.environ["SPARK_CONNECT_MODE_ENABLED"] = saved
