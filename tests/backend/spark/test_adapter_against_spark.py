"""The per-key execution adapter (``backend.spark``) against Spark itself: one processor runs
through Spark's own ``transformWithStateInPandas``/``transformWithState``/``applyInPandasWithState``
and through the runner, and the outputs are compared (marked ``spark``: it starts a JVM).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from pyspark.sql import Row  # noqa: E402
from pyspark.sql.streaming import StatefulProcessor  # noqa: E402
from pyspark.sql.types import StringType, StructField, StructType  # noqa: E402

from backend.spark.apply_in_pandas import run_apply_in_pandas_with_state  # noqa: E402
from backend.spark.group_state import GroupState  # noqa: E402
from backend.spark.transform import run_transform_with_state  # noqa: E402
from backend.state.keyed_backend import ChangelogKeyedStateBackend  # noqa: E402
from tests.backend.spark.adapter_processors import FULL  # noqa: E402

# -- against Spark itself --------------------------------------------------------------------------------


def count_rows(key: Any, values: list[str], count: Any, seen: Any, last: Any) -> tuple[int, str, str]:
    """The logic shared by the three Spark APIs below: a count, a list of values, a map value -> position."""
    old = count.get()
    n = old[0] if old else 0
    for v in values:
        seen.appendValue((v,))
        last.updateValue((v,), (n,))
        n += 1
    count.update((n,))
    return n, ",".join(sorted(x[0] for x in seen.get())), ",".join(f"{k[0]}:{v[0]}" for k, v in sorted(last.iterator()))


class PandasProcessor(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.count = handle.getValueState("count", "n long")
        self.seen = handle.getListState("seen", StructType([StructField("v", StringType())]))
        self.last = handle.getMapState("last", "v string", "n long")

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        self.count.update((int(initialState["seed"].sum()),))

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        values = [v for pdf in rows for v in pdf["v"]]
        n, seen, last = count_rows(key, values, self.count, self.seen, self.last)
        yield pd.DataFrame({"id": [key[0]], "n": [n], "seen": [seen], "last": [last]})


class RowProcessor(PandasProcessor):
    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        self.count.update((initialState.seed,))

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        n, seen, last = count_rows(key, [r.v for r in rows], self.count, self.seen, self.last)
        yield Row(id=key[0], n=n, seen=seen, last=last)


def group_count(key: tuple[Any, ...], pdfs: Iterator[Any], state: GroupState) -> Iterator[Any]:
    values = sorted(v for pdf in pdfs for v in pdf["v"])
    n = (state.getOption or (0,))[0] + len(values)
    state.update((n,))
    yield pd.DataFrame({"id": [int(key[0])], "n": [n], "seen": [",".join(values)], "last": [""]})


BATCHES = [[(1, "a"), (2, "b"), (1, "c"), (3, "d")], [(1, "e"), (2, "f"), (4, "g")]]
INITIAL = [(1, 100), (4, 40), (4, 2)]
OUTPUT = "id long, n long, seen string, last string"


def run_in_spark(spark: Any, work: Path, build: Any, mode: str) -> list[list[tuple[Any, ...]]]:
    """Each of BATCHES as one micro-batch of a file-source streaming query (availableNow)."""
    source = work / "source"
    source.mkdir(parents=True)
    outputs: list[list[tuple[Any, ...]]] = []
    for n, rows in enumerate(BATCHES):
        pd.DataFrame(rows, columns=["id", "v"]).to_json(source / f"{n}.json", orient="records", lines=True)
        collected: list[tuple[Any, ...]] = []

        def collect(df: Any, _: int, collected: list[tuple[Any, ...]] = collected) -> None:
            collected.extend(tuple(r) for r in df.collect())

        query = (
            build(spark.readStream.schema("id long, v string").json(str(source)))
            .writeStream.outputMode(mode)
            .trigger(availableNow=True)
            .option("checkpointLocation", str(work / "checkpoint"))
            .foreachBatch(collect)
            .start()
        )
        assert query.awaitTermination(300), "the streaming query did not finish"
        assert query.exception() is None, query.exception()
        outputs.append(sorted(collected))
    return outputs


def run_with_runner(tmp_path: Path, api: str) -> list[list[tuple[Any, ...]]]:
    b = ChangelogKeyedStateBackend("op", FULL, tmp_path / "local", storage=None, log_enabled=False)
    outputs = []
    processor: Any = PandasProcessor() if api == "pandas" else RowProcessor()
    for batch_id, rows in enumerate(BATCHES):
        data = pd.DataFrame(rows, columns=["id", "v"])
        initial = [pd.DataFrame(INITIAL, columns=["id", "seed"])]
        if api == "applyInPandasWithState":
            out = run_apply_in_pandas_with_state(group_count, b, [data], key_columns=["id"], state_schema="n long",
                                                 batch_timestamp_ms=1)  # fmt: skip
        else:
            out = run_transform_with_state(
                processor, b, [data], key_columns=["id"], batch_id=batch_id, batch_timestamp_ms=1,
                initial_state=initial, use_pandas=api == "pandas",
            )  # fmt: skip
        items = list(out)
        if api == "row":
            outputs.append(sorted(tuple(r) for r in items))
        else:
            outputs.append(sorted(tuple(r) for df in items for r in df.itertuples(index=False)))
    b.close()
    return outputs


@pytest.mark.spark
@pytest.mark.parametrize("api", ["pandas", "row", "applyInPandasWithState"])
def test_same_outputs_as_spark_itself(spark: Any, tmp_path: Path, api: str) -> None:
    from pyspark.sql.streaming.state import GroupStateTimeout as SparkTimeout

    initial = spark.createDataFrame(INITIAL, "id long, seed long").groupBy("id")
    if api == "pandas":
        build = lambda df: df.groupBy("id").transformWithStateInPandas(  # noqa: E731
            PandasProcessor(), OUTPUT, "Update", "None", initialState=initial
        )
    elif api == "row":
        build = lambda df: df.groupBy("id").transformWithState(  # noqa: E731
            RowProcessor(), OUTPUT, "Update", "None", initialState=initial
        )
    else:
        build = lambda df: df.groupBy("id").applyInPandasWithState(  # noqa: E731
            group_count, OUTPUT, "n long", "Update", SparkTimeout.NoTimeout
        )
    expected = run_in_spark(spark, tmp_path / "spark", build, "update")
    assert expected[0], "Spark produced no output"
    assert run_with_runner(tmp_path, api) == expected
