"""The per-key execution adapter (``backend.spark``): ``applyInPandasWithState``'s ``GroupState``,
its timeouts and its errors.

Each test pins one piece of Spark's semantics (pyspark 4.3) without a SparkSession.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from backend.spark.apply_in_pandas import run_apply_in_pandas_with_state  # noqa: E402
from backend.spark.group_state import GroupState, GroupStateTimeout  # noqa: E402
from backend.state.keyed_backend import ChangelogKeyedStateBackend  # noqa: E402
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage  # noqa: E402
from tests.backend.spark.adapter_processors import apply, count_with_timeout, frame  # noqa: E402

# -- applyInPandasWithState --------------------------------------------------------------------------


def test_group_state_processing_time_timeouts(backend: ChangelogKeyedStateBackend) -> None:
    conf = GroupStateTimeout.ProcessingTimeTimeout
    assert apply(backend, frame(id=[1, 2, 1, 3, 4], v=["a", "b", "c", "keep", "d"]), 1_000, conf) == [
        (1, 2, False),
        (2, 1, False),
        (3, 1, False),  # no timeout set
        (4, 1, False),
    ]
    # 1100 is not before 1100 (Spark's bound is strict); key 2 got data: its timeout moved on
    assert apply(backend, frame(id=[2, 4], v=["e", "stop"]), 1_100, conf) == [(2, 2, False), (4, 2, False)]
    # keys without data time out once; key 3 never does; key 4 was removed
    assert apply(backend, frame(id=[], v=[]), 1_101, conf) == [(1, 2, True)]
    assert apply(backend, frame(id=[], v=[]), 5_000, conf) == [(2, 2, True)]
    assert apply(backend, frame(id=[3], v=["x"]), 5_001, conf) == [(3, 2, False)]


def test_group_state_event_time_timeouts_and_key_types(backend: ChangelogKeyedStateBackend) -> None:
    conf = GroupStateTimeout.EventTimeTimeout
    assert apply(backend, frame(id=[7], v=["a"]), 10**9, conf, watermark_ms=50) == [(7, 1, False)]  # times out at 150
    assert apply(backend, frame(id=[], v=[]), 10**9, conf, watermark_ms=150) == []
    seen: list[Any] = []

    def spy(key: tuple[Any, ...], pdfs: Iterator[Any], state: GroupState) -> Iterator[Any]:
        seen.append((key, [type(k) for k in key], state.hasTimedOut, state.getCurrentWatermarkMs()))
        return count_with_timeout(key, pdfs, state)

    out = list(run_apply_in_pandas_with_state(spy, backend, [frame(id=[8], v=["b"])], key_columns=["id"],
                                              state_schema="count long", timeout_conf=conf, batch_timestamp_ms=10**9,
                                              watermark_ms=151, data_columns=["id", "v"]))  # fmt: skip
    assert len(out) == 2
    import numpy as np

    assert seen == [((8,), [np.int64], False, 151), ((7,), [np.int64], True, 151)]  # numpy keys, as Spark


def test_group_state_semantics_and_errors() -> None:
    from pyspark.errors import PySparkRuntimeError, PySparkTypeError, PySparkValueError

    def state(conf: str, watermark: int = -1) -> GroupState:
        return GroupState(None, batch_processing_time_ms=1_000, event_time_watermark_ms=watermark, timeout_conf=conf,
                          has_timed_out=False, watermark_present=watermark != -1)  # fmt: skip

    s = state(GroupStateTimeout.NoTimeout)
    assert (s.exists, s.getOption, str(s)) == (False, None, "GroupState(<undefined>)")
    with pytest.raises(PySparkValueError, match="STATE_NOT_EXISTS"):
        _ = s.get
    with pytest.raises(PySparkTypeError, match="CANNOT_BE_NONE"):
        s.update(None)
    s.update([pd.Series([5]).iloc[0], "x"])
    assert s.get == (5, "x") and type(s.get[0]) is int and s.exists
    s.remove()
    assert not s.exists
    with pytest.raises(PySparkRuntimeError, match="CANNOT_WITHOUT"):
        s.setTimeoutDuration(10)
    with pytest.raises(PySparkRuntimeError, match="CANNOT_WITHOUT"):
        s.getCurrentWatermarkMs()
    p = state(GroupStateTimeout.ProcessingTimeTimeout)
    with pytest.raises(PySparkValueError, match="VALUE_NOT_POSITIVE"):
        p.setTimeoutDuration(0)
    with pytest.raises(PySparkTypeError, match="NOT_EXPECTED_TYPE"):
        p.setTimeoutDuration("10 seconds")  # type: ignore[arg-type]
    e = state(GroupStateTimeout.EventTimeTimeout, watermark=500)
    with pytest.raises(PySparkValueError, match="INVALID_TIMEOUT_TIMESTAMP"):
        e.setTimeoutTimestamp(499)
    e.setTimeoutTimestamp(500)
    assert e._timeout_timestamp == 500 and e.getCurrentProcessingTimeMs() == 1_000


def _running_total(key: Any, frames: Iterator[Any], state: GroupState) -> Iterator[Any]:
    """Per key, the running total of ``v`` in a state of one field (``total long``) or, after the
    schema changed, of two (``total double, n long``: ``n`` counts the batches since the change)."""
    old = state.get if state.exists else None
    total = (old[0] if old else 0) + sum(int(f["v"].sum()) for f in frames)
    if len(state_fields) == 1:
        state.update((total,))
    else:
        state.update((float(total), ((old[1] if len(old or ()) > 1 else None) or 0) + 1))
    yield pd.DataFrame({"id": [key[0]], "v": [float(total)]})


state_fields: list[str] = []


def test_a_restart_under_a_changed_state_schema_reads_the_old_values_converted(tmp_path: Path) -> None:
    """Beyond Spark (which refuses any change of an applyInPandasWithState state schema): the
    evolution rules of transformWithState apply here too."""

    def batch(b: ChangelogKeyedStateBackend, schema: str, v: int, now: int) -> list[tuple[Any, ...]]:
        state_fields[:] = schema.split(",")
        out = run_apply_in_pandas_with_state(
            _running_total, b, [pd.DataFrame({"id": ["a"], "v": [v]})], key_columns=["id"], state_schema=schema,
            timeout_conf="NoTimeout", batch_timestamp_ms=now, data_columns=["id", "v"],
        )  # fmt: skip
        return [tuple(r) for df in out for r in df.itertuples(index=False)]

    with StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs")) as storage:
        first = ChangelogKeyedStateBackend("op", KeyGroupRange(0, 127), tmp_path / "first", storage=storage)
        assert batch(first, "total long", 2, 1_000) == [("a", 2.0)]
        handle = first.snapshot(1).result(30)
        first.notify_checkpoint_complete(1)
        first.close()
        restored = ChangelogKeyedStateBackend("op", KeyGroupRange(0, 127), tmp_path / "restored", storage=storage)
        restored.restore([handle])
        assert batch(restored, "total double, n long", 3, 2_000) == [("a", 5.0)]
        assert batch(restored, "total double, n long", 1, 3_000) == [("a", 6.0)]
        restored.close()
