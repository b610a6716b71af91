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

With ``spark.sql.execution.arrow.maxBytesPerBatch`` set, transformWithStateInPandas's worker also
ends a DataFrame by its rows' average Arrow size (observed with 64, 200 and 1000 bytes, below).

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
from backend.spark.batch import Partition, byte_chunks  # noqa: E402
from backend.spark.group_state import GroupState, GroupStateTimeout  # noqa: E402
from backend.spark.transform import run_transform_with_state  # noqa: E402
from backend.state.keyed_backend import ChangelogKeyedStateBackend  # noqa: E402
from tests.backend.spark.side_by_side import assert_same, both_sides  # noqa: E402

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


# -- spark.sql.execution.arrow.maxBytesPerBatch ------------------------------------------------------------------------

#: the input of the observation below: key "a" has 30 rows of about 80 Arrow bytes, key "b" one
WIDE = pd.DataFrame(
    {
        "s": ["a"] * 30 + ["b"],
        "i": [1] * 30 + [2],
        "t": ["2024-01-02 03:04:05.000006"] * 30 + ["2024-03-10 10:30:00"],
        "d": ["2024-01-02"] * 30 + ["2024-01-03"],
        "dec": ["1.5"] * 30 + ["2.25"],
        "n": [*range(30), 1],
        "x": [i * 1.5 for i in range(30)] + [0.5],
    }
)


class FrameSizes(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.sizes: dict[str, list[int]] = {}

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        self.sizes[key[0]] = [len(frame) for frame in rows]
        yield pd.DataFrame({"k": [key[0]]})

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("max_bytes", "max_records", "chunks"),
    [(64, 10_000, [1] * 30), (200, 10_000, [3] * 10), (1000, 10_000, [13, 13, 4]), (1000, 5, [5] * 6),
     (2**31 - 1, 10_000, [30])],
)  # fmt: skip
def test_pandas_chunks_end_where_their_arrow_size_reaches_max_bytes_per_batch(
    backend: ChangelogKeyedStateBackend, max_bytes: int, max_records: int, chunks: list[int]
) -> None:
    """What Spark 4.3's transformWithStateInPandas hands over for ``WIDE`` (one partition) with
    maxBytesPerBatch 64, 200 and 1000: its worker ends a DataFrame at the row where rows times
    the average Arrow row size reaches the limit, or at maxRecordsPerBatch rows."""
    processor = FrameSizes()
    list(run_transform_with_state(processor, backend, [WIDE], key_columns=["s"], batch_id=0, batch_timestamp_ms=1,
                                  max_records_per_batch=max_records, max_bytes_per_batch=max_bytes))  # fmt: skip
    assert processor.sizes == {"a": chunks, "b": [1]}


def test_byte_chunks_replay_sparks_batches_and_running_average() -> None:
    """Rows of "a" of 29 bytes (a 1-byte string, a long, a 12-byte string, with their offsets)
    and 7 of "b" of 18: with 200 bytes Spark's JVM ends a batch at 7 rows of "a" (3 bitmaps, 2
    more offsets: 214 bytes), so the worker's average is 30.6 and "a" comes in 7, 7, 6 (what
    Spark 4.3 hands over; an average over the whole partition, 26.1, would give 8, 8, 4)."""
    frame = pd.DataFrame({"s": ["a"] * 20 + ["b"] * 7, "n": range(27), "t": ["x" * 12] * 20 + ["y"] * 7})
    part = Partition([frame], ["s"], True, None, measure_arrow=True)
    assert part.row_bytes.tolist() == [29.0] * 20 + [18.0] * 7
    assert (part.bitmaps, part.variable) == (3, 2)
    byte_chunks(10_000, 200, part)
    assert part.groups[("a",)].chunks == [7, 7, 6]
    assert part.groups[("b",)].chunks == [7]
    byte_chunks(5, 200, part)
    assert part.groups[("a",)].chunks == [5, 5, 5, 5]


def test_a_key_in_both_inputs_shares_chunks_under_the_byte_limit() -> None:
    """The last initial-state key and the first input key are one run of rows in Spark's worker."""
    init = Partition([pd.DataFrame({"s": ["a"] * 5, "n": range(5)})], ["s"], True, None, measure_arrow=True)
    data = Partition([pd.DataFrame({"s": ["a"] * 6, "n": range(6)})], ["s"], True, None, measure_arrow=True)
    byte_chunks(4, 2**31 - 2, init, data)
    assert init.groups[("a",)].chunks == [4, 1]
    assert data.groups[("a",)].chunks == [3, 3]


def sizes_processor() -> type:
    class ChunkSizes(StatefulProcessor):
        def init(self, handle: Any) -> None:
            pass

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            yield pd.DataFrame({"what": [key[0]], "item": [str([len(frame) for frame in rows])]})

        def close(self) -> None:
            pass

    return ChunkSizes


@pytest.mark.spark
def test_max_bytes_per_batch_cuts_pandas_chunks_as_spark_does(session_conf: Any, tmp_path: Path) -> None:
    from backend.spark import api

    spark = session_conf
    spark.conf.set("spark.sql.execution.arrow.maxBytesPerBatch", "200")
    ChunkSizes = sizes_processor()
    out = "what string, item string"
    build = {
        "pandas": (lambda g: g.transformWithStateInPandas(ChunkSizes(), out, "Update", "None"),
                   lambda g, o: api.transform_with_state_in_pandas(g, ChunkSizes(), out, "Update", "None", **o)),
    }  # fmt: skip

    def source(directory: Path, _: str) -> Any:
        return spark.readStream.schema("s string, n long, t string").json(str(directory)).groupBy("s")

    rows = [{"s": "a", "n": i, "t": "x" * 12} for i in range(20)] + [{"s": "b", "n": 1, "t": "y"}] * 7
    try:
        outputs = both_sides(tmp_path, build, [rows], source)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxBytesPerBatch")
    assert_same(outputs, list(build))
    assert dict(outputs["pandas ours"][0])["a"] != "[20]", "the byte limit cut the chunks"
