"""How the rows of a micro-batch reach the user's code under ``spark.sql.execution.arrow.maxRecordsPerBatch``.

A processor that works per DataFrame (or per ``handleInputRows`` call) sees Spark's chunks, so the
drop-in must cut them where Spark's Python worker does. The expected chunks below are what Spark 4.3
hands over with ``maxRecordsPerBatch=2`` (observed on Spark's own operators, one partition):

- ``transformWithStateInPandas``: every key's initial state first (DataFrames of at most 2 rows),
  then per key one ``handleInputRows`` call with DataFrames of at most 2 rows;
- ``transformWithState`` (Row API) in the first batch of a query with an initial state: one
  ``handleInitialState`` per row, then one ``handleInputRows`` call per 2 rows of a key; otherwise a
  single call per key;
- in both, the partition's last initial-state key and first input key, if the same, share chunks;
- ``applyInPandasWithState``: the keys of a partition are packed into Arrow batches of 2 rows and a
  key is split where a batch ends, so a key's first chunk fills what the previous key left.

The differential suite (``tests/backend/spark/parity``) checks the same against Spark itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from pyspark.sql.streaming import StatefulProcessor  # noqa: E402

from backend.spark.apply_in_pandas import run_apply_in_pandas_with_state  # noqa: E402
from backend.spark.group_state import GroupState, GroupStateTimeout  # noqa: E402
from backend.spark.transform import run_transform_with_state  # noqa: E402
from backend.state.keyed_backend import ChangelogKeyedStateBackend  # noqa: E402
from dstl import KeyGroupRange  # noqa: E402


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[ChangelogKeyedStateBackend]:
    b = ChangelogKeyedStateBackend("op", KeyGroupRange(0, 127), tmp_path / "local", storage=None, log_enabled=False)
    yield b
    b.close()


DATA = pd.DataFrame({"k": ["a", "a", "a", "b", "b", "b", "d"], "v": [1, 2, 3, 4, 5, 6, 7]})
INITIAL = pd.DataFrame({"k": ["a", "b", "b", "b", "c"], "v": [10, 20, 21, 22, 30]})


class ChunkLog(StatefulProcessor):
    """Records every call with the values of each chunk it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def init(self, handle: Any) -> None:
        pass

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        values = list(initialState["v"]) if hasattr(initialState, "iloc") else [initialState.v]
        self.calls.append(("init", key[0], values))

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        chunks = [list(r["v"]) if hasattr(r, "iloc") else [r.v] for r in rows]
        self.calls.append(("data", key[0], chunks))
        return iter(())

    def close(self) -> None:
        pass


def transform(backend: ChangelogKeyedStateBackend, use_pandas: bool, batch_id: int = 0, **kwargs: Any) -> ChunkLog:
    processor = ChunkLog()
    list(run_transform_with_state(processor, backend, [DATA], key_columns=["k"], batch_id=batch_id,
                                  batch_timestamp_ms=1_000, use_pandas=use_pandas, max_records_per_batch=2,
                                  **kwargs))  # fmt: skip
    return processor


def test_pandas_initial_state_first_then_each_keys_rows_in_chunks(backend: ChangelogKeyedStateBackend) -> None:
    calls = transform(backend, True, initial_state=[INITIAL]).calls
    assert calls == [
        ("init", "a", [10]), ("init", "b", [20, 21]), ("init", "b", [22]), ("init", "c", [30]),
        ("data", "a", [[1, 2], [3]]), ("data", "b", [[4, 5], [6]]), ("data", "d", [[7]]),
    ]  # fmt: skip


def test_row_api_with_initial_state_calls_once_per_chunk_in_the_first_batch(
    backend: ChangelogKeyedStateBackend,
) -> None:
    calls = transform(backend, False, initial_state=[INITIAL]).calls
    assert calls == [
        ("init", "a", [10]), ("init", "b", [20]), ("init", "b", [21]), ("init", "b", [22]), ("init", "c", [30]),
        ("data", "a", [[1], [2]]), ("data", "a", [[3]]), ("data", "b", [[4], [5]]), ("data", "b", [[6]]),
        ("data", "d", [[7]]),
    ]  # fmt: skip
    later = transform(backend, False, batch_id=1).calls  # Spark's worker without initial state: a call per key
    assert later == [("data", "a", [[1], [2], [3]]), ("data", "b", [[4], [5], [6]]), ("data", "d", [[7]])]


def test_the_last_initial_key_and_the_first_input_key_share_chunks(backend: ChangelogKeyedStateBackend) -> None:
    """Spark's worker regroups a partition's rows (all initial state, then all input) by consecutive
    key, so when a partition's last initial-state key is also its first input key, their rows run
    into the same chunks (observed: a partition holding key b alone)."""
    data = pd.DataFrame({"k": ["b", "b", "b"], "v": [4, 5, 6]})
    initial = pd.DataFrame({"k": ["b", "b", "b"], "v": [20, 21, 22]})
    for use_pandas, expected in (
        (True, [("init", "b", [20, 21]), ("init", "b", [22]), ("data", "b", [[4], [5, 6]])]),
        (False, [("init", "b", [20]), ("init", "b", [21]), ("init", "b", [22]), ("data", "b", [[4]]),
                 ("data", "b", [[5], [6]])]),
    ):  # fmt: skip
        processor = ChunkLog()
        list(run_transform_with_state(processor, backend, [data], key_columns=["k"], batch_id=0,
                                      batch_timestamp_ms=1_000, use_pandas=use_pandas, max_records_per_batch=2,
                                      initial_state=[initial]))  # fmt: skip
        assert processor.calls == expected


def test_row_api_without_initial_state_calls_once_per_key(backend: ChangelogKeyedStateBackend) -> None:
    assert transform(backend, False).calls == [
        ("data", "a", [[1], [2], [3]]), ("data", "b", [[4], [5], [6]]), ("data", "d", [[7]]),
    ]  # fmt: skip


def test_apply_in_pandas_with_state_packs_keys_into_batches(backend: ChangelogKeyedStateBackend) -> None:
    seen: list[tuple[str, list[list[int]]]] = []

    def func(key: tuple[Any, ...], pdfs: Iterator[Any], state: GroupState) -> Iterator[Any]:
        seen.append((str(key[0]), [list(p["v"]) for p in pdfs]))
        return iter(())

    data = pd.DataFrame({"k": ["a", "b", "b", "b", "c", "c", "d"], "v": [1, 2, 3, 4, 5, 6, 7]})
    list(run_apply_in_pandas_with_state(func, backend, [data], key_columns=["k"], state_schema="n long",
                                        timeout_conf=GroupStateTimeout.NoTimeout, batch_timestamp_ms=1_000,
                                        max_records_per_batch=2))  # fmt: skip
    # batches [a1 b2] [b3 b4] [c5 c6] [d7]: b's first chunk is what a left of the first batch
    assert seen == [("a", [[1]]), ("b", [[2], [3, 4]]), ("c", [[5, 6]]), ("d", [[7]])]
