"""The server-side completer of a Spark Connect run (``driver.complete_as_follower``, what the
server's listener process calls on each progress event) when a newer run takes the directory over:
it writes nothing from then on, not even while it is starting, and once it knows, it touches the
state's storage no more on later events (it is kept per run, not rebuilt for each event).

The follower's storage goes through a faulty file system (``benchmarks.support.faulty_fs``) that
logs its calls and holds one of them, so that the newer run claims the directory at a chosen point
of the follower's start."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from backend.spark import driver
from backend.spark.driver import DriverCoordinator
from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig
from tests.backend.spark.timer_tasks import config
from tests.support.threads import in_thread

#: the calls that only read
READS = ("exists", "list", "get")


@pytest.fixture(autouse=True)
def no_followers() -> Iterator[None]:
    driver.forget_all()
    yield
    driver.forget_all()


def test_a_follower_taken_over_while_it_starts_writes_nothing_and_then_stays_idle(tmp_path: Path) -> None:
    """The first run (its client) recorded the grouping key as int; the user restarts with bigint
    (no batch left state, so the new run records bigint). The old run's follower, started just
    before the takeover, must not record its int again, nor do anything on the next events."""
    int_key = replace(config(tmp_path, parallelism=1), grouping_key=(("user", "int"),))
    client = DriverCoordinator(int_key)
    client.register(int_key)
    plan = FaultPlan()
    plan.add(Fault(op="list", path="", action="stall", times=1))  # the follower's first look at the checkpoints
    followed = replace(int_key, changelog=ChangelogConfig(base_path=faulty_base_path(tmp_path / "state", plan)))
    thread, outcome = in_thread(lambda: driver.complete_as_follower([followed], 2, client.ownership.run, 0, "q"))
    assert plan.wait_stalled(1)
    bigint_key = replace(int_key, grouping_key=(("user", "bigint"),))
    restarted = DriverCoordinator(bigint_key)  # the new run takes the directory over
    try:
        restarted.register(bigint_key)
        plan.release()
        thread.join()
        assert "error" not in outcome, outcome
        assert [c for c in plan.calls if c[0] not in READS] == []
        keys = json.loads((tmp_path / "state" / "_keys" / "op.json").read_text())
        assert keys == {"grouping_key": [["user", "bigint"]]}
        seen = len(plan.calls)
        for batch in (1, 2):
            driver.complete_as_follower([followed], 2, client.ownership.run, batch, "q")
        assert plan.calls[seen:] == []
    finally:
        client.close()
        restarted.close()
