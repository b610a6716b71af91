"""One owner per state directory under Spark (issue 25, defect 1), by the rule of
``backend.checkpointing.ownership``: a state directory serves one streaming query, even when two
start at once on one ``checkpoint_location``, and one driver at a time completes its checkpoints.

Before, the first task of a query wrote ``_query.json`` and read it back: two queries starting at
once could both read back their own id (the later write landing between the other's write and
read), and run on one directory; and a second driver on a location recovered it and both drivers
went on completing checkpoints. What a user relies on: the query that binds the directory first
keeps it, the other is refused naming it; a driver started later takes the location over and the
earlier one completes no checkpoint from then on, naming the newcomer.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from backend.checkpointing.errors import DirectoryOwnedError, OwnershipLostError
from backend.core.errors import CheckpointError
from backend.spark import committed, driver
from backend.spark.driver import DriverCoordinator
from backend.spark.tasks import run_subtask
from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig
from tests.backend.spark.queries import count_rows, publish
from tests.backend.spark.timer_tasks import config, timers_at
from tests.support.threads import in_thread

NOW = 1_000


pytestmark = pytest.mark.usefixtures("clean_workers")  # every test starts and ends with no worker state


def test_a_query_binding_the_directory_while_another_does_is_refused_naming_it(tmp_path: Path) -> None:
    """The first write of query-2's task is held until query-1's task has bound the directory."""
    cfg = config(tmp_path, parallelism=1)
    plan = FaultPlan()
    plan.add(Fault(op="put", path="*", action="stall", times=1))
    held = replace(cfg, changelog=ChangelogConfig(base_path=faulty_base_path(tmp_path / "state", plan)))
    thread, outcome = in_thread(lambda: run_subtask(held, 0, 0, "query-2", NOW, timers_at(None)))
    assert plan.wait_stalled(1)
    run_subtask(cfg, 0, 0, "query-1", NOW, timers_at(None))
    plan.release()
    thread.join()
    error = outcome.get("error")
    assert isinstance(error, DirectoryOwnedError), outcome
    assert "belongs to another streaming query (id query-1), not to this one (id query-2)" in str(error)
    committed._CLAIMED.clear()  # a task of query-1 in another process finds the directory its own
    run_subtask(cfg, 0, 1, "query-1", NOW, timers_at(None))
    with pytest.raises(CheckpointError, match=r"belongs to another streaming query \(id query-1\)"):
        run_subtask(cfg, 0, 1, "query-2", NOW, timers_at(None))


def test_a_second_driver_on_the_location_takes_it_over(tmp_path: Path) -> None:
    cfg = config(tmp_path, parallelism=1)
    first = DriverCoordinator(cfg)
    first.register(cfg)
    run_subtask(cfg, 0, 0, "q", NOW, timers_at(None))
    assert first.complete_batch(0, "q") is not None
    run_subtask(cfg, 0, 1, "q", NOW, timers_at(None))
    second = DriverCoordinator(cfg)  # a driver started while the first still runs
    second.register(cfg)
    try:
        with pytest.raises(OwnershipLostError, match=r"taken over by a newer run \(epoch 2, host"):
            first.complete_batch(1, "q")
        meta = second.complete_batch(1, "q")
        assert meta is not None and meta.checkpoint_id == 1
        run_subtask(cfg, 0, 2, "q", NOW, timers_at(None))  # the query's directory still (the binding carried on)
    finally:
        first.close()
        second.close()


def test_a_follower_completes_under_the_runs_claim_deletes_nothing_at_start_and_is_fenced_with_it(
    tmp_path: Path,
) -> None:
    """Under Spark Connect the client makes the run's start-up and the server's listener completes
    the checkpoints, following the client's claim (``backend.spark.server_listener``): it
    completes and subsumes as the driver would, deletes nothing when it starts (a materialization
    may be uploading), and is fenced when a new run (a restarted client) claims the directory."""
    cfg = config(tmp_path, parallelism=1)
    client = DriverCoordinator(cfg)  # the run's start-up: claim and recovery
    client.register(cfg)
    stray = tmp_path / "state" / "stray-chunk"
    stray.write_bytes(b"uploading")  # a file no checkpoint names yet
    follower = DriverCoordinator(cfg, follow=client.ownership.run)
    follower.register(cfg)
    try:
        assert stray.exists()
        assert follower.ownership.epoch == client.ownership.epoch
        for batch in range(3):
            run_subtask(cfg, 0, batch, "q", NOW, timers_at(None))
            meta = follower.complete_batch(batch, "q")
            assert meta is not None and meta.checkpoint_id == batch
        assert [m.checkpoint_id for m in follower.coordinator.completed] == [1, 2]  # chk-0 subsumed
        restarted = DriverCoordinator(cfg)  # a new client's run
        run_subtask(cfg, 0, 3, "q", NOW, timers_at(None))
        with pytest.raises(OwnershipLostError, match="taken over by a newer run"):
            follower.complete_batch(3, "q")
        driver.complete_as_follower([cfg], 2, client.ownership.run, 3, "q")  # logs, completes nothing
        assert not (tmp_path / "state" / "chk-3").exists()
        restarted.register(cfg)
        assert restarted.complete_batch(3, "q") is not None
        restarted.close()
    finally:
        client.close()
        follower.close()


def test_a_follower_of_a_run_that_never_claimed_is_refused(tmp_path: Path) -> None:
    cfg = config(tmp_path, parallelism=1)
    DriverCoordinator(cfg).close()
    with pytest.raises(CheckpointError, match="no claim of run"):
        DriverCoordinator(cfg, follow="not-a-run")


@pytest.mark.spark
def test_two_queries_started_at_once_on_one_checkpoint_location(spark: Any, tmp_path: Path) -> None:
    """Both queries have input before they start, so their first batches run at the same time."""
    from backend.spark.api import apply_in_pandas_with_state

    driver.forget_all()
    seen: dict[str, Counter[tuple[Any, ...]]] = {}
    queries: dict[str, Any] = {}
    for name in ("a", "b"):
        (tmp_path / f"in-{name}").mkdir()
        publish(tmp_path / f"in-{name}" / "0000.json", '{"user": "x", "v": 1}\n{"user": "x", "v": 2}\n')
    for name in ("a", "b"):
        df = spark.readStream.schema("user string, v long").json(str(tmp_path / f"in-{name}"))
        out = apply_in_pandas_with_state(
            df.groupBy("user"), count_rows, "user string, n long", "n long", "Update", "NoTimeout",
            checkpoint_location=str(tmp_path / "state"), operator_uid="counts", local_dir=str(tmp_path / "local"),
        )  # fmt: skip
        seen[name] = Counter()
        collect = functools.partial(lambda into, df, _: into.update(tuple(r) for r in df.collect()), seen[name])
        queries[name] = (
            out.writeStream.foreachBatch(collect).option("checkpointLocation", str(tmp_path / f"spark-{name}")).start()
        )
    errors: dict[str, str] = {}
    try:
        for name, query in queries.items():
            try:
                query.processAllAvailable()
            except Exception as exc:
                errors[name] = str(exc)
    finally:
        for query in queries.values():
            query.stop()
        driver.forget_all()
    assert len(errors) == 1, errors
    (loser,) = errors
    (winner,) = set(queries) - {loser}
    assert f"belongs to another streaming query (id {queries[winner].id})" in errors[loser]
    assert seen[winner] == Counter({("x", 2): 1})


def test_a_grouping_key_recorded_by_a_first_run_that_left_no_state_may_change(tmp_path: Path) -> None:
    """Spark records its key schema in the first batch; a first run that failed before any batch
    left state keeps nothing, so a restart with a corrected column type is not refused. Once a
    batch left state (pending handles, a checkpoint), the recorded types hold."""
    from backend.checkpointing.metadata import PENDING_DIR
    from backend.spark.config import OperatorConfig
    from backend.spark.errors import GroupingKeyChangedError

    cfg = OperatorConfig(
        job_dir=str(tmp_path / "state"), uid="op", parallelism=1, max_parallelism=128,
        local_root=str(tmp_path / "local"), changelog=ChangelogConfig.local(tmp_path / "state"), tasks=1,
        changelog_service=False, grouping_key=(("user", "int"),),
    )  # fmt: skip
    corrected = replace(cfg, grouping_key=(("user", "bigint"),))
    coordinator = DriverCoordinator(cfg)
    try:
        coordinator.register(cfg)
        coordinator.register(corrected)  # nothing kept yet: recorded again
        coordinator.storage.files.put(f"{PENDING_DIR}/0/op/0-of-1.json", b"[]")  # a batch left state
        with pytest.raises(GroupingKeyChangedError, match="checkpointed as bigint and are now int"):
            coordinator.register(cfg)
    finally:
        coordinator.close()
