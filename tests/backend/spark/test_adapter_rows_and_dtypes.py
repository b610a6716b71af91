"""The per-key execution adapter (``backend.spark``): the Row API of ``transformWithState``, and the
types of the rows and the dtypes of the pandas frames a processor gets, as Spark's operators give
them.

Each test pins one piece of Spark's semantics (pyspark 4.3) without a SparkSession.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from pyspark.sql import Row  # noqa: E402
from pyspark.sql.streaming import StatefulProcessor  # noqa: E402
from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType, TimestampType  # noqa: E402

from backend.spark.apply_in_pandas import run_apply_in_pandas_with_state  # noqa: E402
from backend.spark.group_state import GroupState  # noqa: E402
from backend.spark.transform import run_transform_with_state  # noqa: E402
from backend.state.keyed_backend import ChangelogKeyedStateBackend  # noqa: E402
from tests.backend.spark.adapter_processors import Recorder, frame, run  # noqa: E402

# -- the Row API -----------------------------------------------------------------------------------


def test_row_api_gets_rows_and_yields_rows(backend: ChangelogKeyedStateBackend) -> None:
    class P(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("c", "n long")

        def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
            self.count.update((initialState.seed,))

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            rows = list(rows)
            assert all(isinstance(r, Row) for r in rows)
            old = self.count.get()
            n = (old[0] if old else 0) + len(rows)
            self.count.update((n,))
            yield Row(id=key[0], n=n, vs=",".join(r.v for r in rows))

    rows = [Row(id=1, v="a"), Row(id=2, v="b"), Row(id=1, v="c")]
    out = list(run_transform_with_state(P(), backend, rows, key_columns=["id"], batch_id=0, batch_timestamp_ms=1,
                                        use_pandas=False, initial_state=[frame(id=[2], seed=[10])]))  # fmt: skip
    assert out == [Row(id=1, n=2, vs="a,c"), Row(id=2, n=11, vs="b")]
    out = list(run_transform_with_state(P(), backend, [frame(id=[2], v=["d"])], key_columns=["id"], batch_id=1,
                                        batch_timestamp_ms=1, use_pandas=False))  # fmt: skip
    assert out == [Row(id=2, n=12, vs="d")]


def test_row_api_rows_have_the_types_sparks_row_api_gives(backend: ChangelogKeyedStateBackend) -> None:
    """Spark's transformWithState builds Rows from Arrow scalars: timestamps aware in the session
    time zone (the frames hold its wall-clock times), timestamp_ntz naive, maps lists of pairs,
    structs dicts. The schema tells timestamp from timestamp_ntz and map from struct."""
    from zoneinfo import ZoneInfo

    from pyspark.sql.types import MapType, TimestampNTZType

    class P(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.rows: list[Any] = []

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            self.rows += [(key, r) for r in rows]
            yield Row(id=key[0])

    schema = StructType([
        StructField("id", LongType()), StructField("ts", TimestampType()), StructField("tsn", TimestampNTZType()),
        StructField("m", MapType(StringType(), LongType())), StructField("ats", ArrayType(TimestampType())),
        StructField("st", StructType([StructField("x", LongType()), StructField("t", TimestampType())])),
    ])  # fmt: skip
    wall = datetime.datetime(2024, 1, 2, 3, 4, 5, 6)
    data = frame(id=[1, 2], ts=pd.to_datetime([wall, None]), tsn=pd.to_datetime([wall, None]),
                 m=[{"x": 4, "z": None}, None], ats=[[wall, None], None], st=[{"x": 1, "t": wall}, None])  # fmt: skip
    p = P()
    zone = "America/Los_Angeles"
    list(run_transform_with_state(p, backend, [data], key_columns=["id"], batch_id=0, batch_timestamp_ms=1,
                                  use_pandas=False, input_schema=schema, session_timezone=zone))  # fmt: skip
    la = wall.replace(tzinfo=ZoneInfo(zone))
    assert p.rows[0] == ((1,), Row(id=1, ts=la, tsn=wall, m=[("x", 4), ("z", None)], ats=[la, None],
                                   st={"x": 1, "t": la}))  # fmt: skip
    assert repr(p.rows[0][1].ts) == repr(la) and p.rows[0][1].tsn.tzinfo is None
    assert p.rows[1] == ((2,), Row(id=2, ts=None, tsn=None, m=None, ats=None, st=None))


def test_pandas_frames_have_the_dtypes_sparks_operators_give(backend: ChangelogKeyedStateBackend) -> None:
    """transformWithStateInPandas rebuilds each key's frame from itertuples: ints int64, floats
    float64, a null int NaN, names a namedtuple accepts; applyInPandasWithState keeps Arrow's dtypes,
    converting each key's rows apart (an int column is float64 only for a key with a null)."""
    data = pd.DataFrame({
        "id": pd.array([1, 2], dtype="int32"), "i8": pd.array([1, 2], dtype="int8"),
        "n16": pd.array([1, None], dtype="Int16"), "f32": pd.array([0.5, 1.5], dtype="float32"),
        "b": pd.array([True, None], dtype="boolean"), "a b": [1, 2], "_x": [3, 4],
    })  # fmt: skip
    seen: dict[str, Any] = {}

    class P(Recorder):
        def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
            seen[f"tws {key[0]}"] = {c: str(t) for c, t in frames[0].dtypes.items()}

    def func(key: Any, pdfs: Iterator[Any], state: GroupState) -> Iterator[Any]:
        seen[f"apply {key[0]}"] = {c: str(t) for pdf in pdfs for c, t in pdf.dtypes.items()}
        yield pd.DataFrame({"id": [int(key[0])]})

    run(P(), backend, data)
    list(run_apply_in_pandas_with_state(func, backend, [data], key_columns=["id"], state_schema="n long",
                                        batch_timestamp_ms=1))  # fmt: skip
    tws = {"id": "int64", "i8": "int64", "n16": "float64", "f32": "float64", "b": "bool", "_5": "int64",
           "_6": "int64"}  # fmt: skip
    assert seen["tws 1"] == tws and seen["tws 2"] == {**tws, "b": "object"}  # pandas infers per key
    apply = {"id": "int32", "i8": "int8", "n16": "int16", "f32": "float32", "b": "bool", "a b": "int64",
             "_x": "int64"}  # fmt: skip
    assert seen["apply 1"] == apply and seen["apply 2"] == {**apply, "n16": "float64", "b": "object"}  # per key


def test_outputs_must_be_dataframes(backend: ChangelogKeyedStateBackend) -> None:
    class P(Recorder):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            return pd.DataFrame({"id": [1]})  # returned, not yielded

    with pytest.raises(TypeError, match=r"iterator of pandas\.DataFrame"):
        run(P(), backend, frame(id=[1]))
