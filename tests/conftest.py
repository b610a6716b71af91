"""Shared test configuration: hypothesis profiles, a local changelog storage, the session's Spark
and moto S3 server fixtures.

``HYPOTHESIS_PROFILE=slow`` (``tox -e slow``) runs thousands of examples per property; the
default ``ci`` profile keeps the suite fast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from benchmarks.support.s3_server import S3Server, s3_server
from dstl import ChangelogConfig, StateChangelogStorage

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "slow",
    max_examples=3000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _end_injected_stalls() -> Iterator[None]:
    """No stall injected by a fault plan outlives its test (a stalled pool thread hangs exit)."""
    yield
    fault_plan = sys.modules.get("benchmarks.support.fault_plan")
    if fault_plan is not None:
        fault_plan.close_all_plans()


@pytest.fixture
def local_storage(tmp_path: Path) -> Iterator[StateChangelogStorage]:
    """A storage whose DFS is the local directory ``tmp_path / "dfs"``; closed after the test."""
    storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs"))
    try:
        yield storage
    finally:
        storage.close()


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One local SparkSession for the whole test session (start-up costs 6-15 s here).

    ``local[2,4]``: two cores, and a failed task is retried (up to 4 attempts), as on a cluster.
    """
    pytest.importorskip("pyspark")
    from backend.spark.session import ROCKSDB_PROVIDER, local_session

    conf = {
        "spark.sql.shuffle.partitions": "4",
        "spark.default.parallelism": "4",
        # Spark's own transformWithState operators (parity tests) need RocksDB
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
    }
    session = local_session("dstl-tests", "local[2,4]", **conf)
    yield session
    from backend.spark import driver

    driver.detach(session)  # no progress callback into this process while it shuts down
    driver.forget_all()
    session.stop()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[S3Server]:
    """The moto S3 server (``tests.support.s3``): started on first use, one for the whole session;
    each test makes its own bucket (``tests.support.s3.new_bucket``)."""
    with s3_server() as server:
        yield server
