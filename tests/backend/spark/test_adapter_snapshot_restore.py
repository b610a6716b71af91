"""The per-key execution adapter (``backend.spark``): state, timers and group state surviving a
snapshot and restore.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from backend.core.handles import KeyedStateHandle  # noqa: E402
from backend.spark.group_state import GroupStateTimeout  # noqa: E402
from backend.state.keyed_backend import ChangelogKeyedStateBackend  # noqa: E402
from dstl import StateChangelogStorage  # noqa: E402
from tests.backend.spark.adapter_processors import (  # noqa: E402
    FULL,
    AllTypes,
    Timers,
    WithTtl,
    apply,
    check_all_types,
    frame,
    run,
)

# -- state survives a snapshot and a restore -----------------------------------------------------------


def test_state_timers_and_group_state_survive_snapshot_and_restore(
    tmp_path: Path, local_storage: StateChangelogStorage
) -> None:
    def reopen(b: ChangelogKeyedStateBackend, checkpoint_id: int) -> ChangelogKeyedStateBackend:
        """Checkpoint ``b``, close it, restore a fresh backend (another local directory) from the handle."""
        handle = KeyedStateHandle.loads(b.snapshot(checkpoint_id).result(timeout=30).dumps())
        b.notify_checkpoint_complete(checkpoint_id)
        b.close()
        fresh = ChangelogKeyedStateBackend(b.operator_id, FULL, tmp_path / f"{b.operator_id}-{checkpoint_id}",
                                           storage=local_storage)  # fmt: skip
        fresh.restore([handle])
        return fresh

    tws = ChangelogKeyedStateBackend("tws", FULL, tmp_path / "tws-0", storage=local_storage)
    groups = ChangelogKeyedStateBackend("groups", FULL, tmp_path / "groups-0", storage=local_storage)
    p, timers, ttl = AllTypes(), Timers(), WithTtl()
    run(p, tws, frame(id=[1], v=["a"]))
    run(timers, tws, frame(id=[5], timers=[[1_500, 9_000]]), time_mode="ProcessingTime")
    run(ttl, tws, frame(id=[6], write=[4]), time_mode="ProcessingTime")  # expires at 1500
    apply(groups, frame(id=[9], v=["a"]), 1_000, GroupStateTimeout.ProcessingTimeTimeout)  # times out at 1100
    tws, groups = reopen(tws, 1), reopen(groups, 1)

    run(p, tws, frame(id=[1], v=["b"]), batch_id=1)
    check_all_types(p.read)
    out = run(timers, tws, frame(id=[5], timers=[[]]), time_mode="ProcessingTime", batch_id=1,
              batch_timestamp_ms=2_000)  # fmt: skip
    assert out == [(5, "rows"), (5, "timer 1500")]
    run(ttl, tws, frame(id=[6], write=[0]), time_mode="ProcessingTime", batch_id=1, batch_timestamp_ms=1_499)
    assert ttl.log[-2][1:] == ((4,), [(4,)], [((4,), (4,))])
    assert apply(groups, frame(id=[], v=[]), 1_100, GroupStateTimeout.ProcessingTimeTimeout) == []
    tws, groups = reopen(tws, 2), reopen(groups, 2)  # a second generation: the log since the start

    run(ttl, tws, frame(id=[6], write=[0]), time_mode="ProcessingTime", batch_id=2, batch_timestamp_ms=1_500)
    assert ttl.log[-2][1:] == (None, [], [])
    out = run(timers, tws, frame(id=[5], timers=[[]]), time_mode="ProcessingTime", batch_id=2,
              batch_timestamp_ms=9_001)  # fmt: skip
    assert out == [(5, "rows"), (5, "timer 9000")]  # 1500 fired once, before the restore
    assert apply(groups, frame(id=[], v=[]), 1_101, GroupStateTimeout.ProcessingTimeTimeout) == [(9, 1, True)]
    assert apply(groups, frame(id=[], v=[]), 99_999, GroupStateTimeout.ProcessingTimeTimeout) == []
    tws.close()
    groups.close()
