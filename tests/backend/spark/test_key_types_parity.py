"""Grouping keys of every type Spark groups by: user code sees the key Spark hands it, and a key's
state and timers are found again in a later batch.

One query per API groups by a column of each key type (string, int, tinyint, smallint, timestamp,
timestamp_ntz, date, decimal, float, binary, boolean), in a session time zone other than the
machine's, through Spark's own operators (RocksDB) and through this backend; the outputs of each
batch must be equal as multisets. The processors report the key of handleInputRows, of
handleExpiredTimer (a timer registered in batch 0) and of a timed-out applyInPandasWithState key,
and, in batch 1, the state the key stored in batch 0.
"""

from __future__ import annotations

import datetime
import decimal
from pathlib import Path
from typing import Any

import pytest

from backend.spark.keys import backend_key, timer_key
from tests.backend.spark.side_by_side import OUT, assert_same, both_sides, describe

pd = pytest.importorskip("pandas")
pytest.importorskip("pyspark")

RAW = "s string, i long, t string, d string, dec string, x double, h string"
SELECT = [
    "s", "CAST(i AS INT) i", "CAST(i AS TINYINT) i8", "CAST(i AS SMALLINT) i16", "CAST(t AS TIMESTAMP) ts",
    "CAST(t AS TIMESTAMP_NTZ) tn", "CAST(d AS DATE) d", "CAST(dec AS DECIMAL(12,3)) dec", "CAST(x AS FLOAT) f",
    "x", "unhex(h) bin", "i > 1 AS bo",
]  # fmt: skip
KEYS = ["s", "i", "i8", "i16", "ts", "tn", "d", "dec", "f", "x", "bin", "bo"]
ROWS = [
    {"s": "a", "i": 1, "t": "2024-01-02 03:04:05.000006", "d": "2024-01-02", "dec": "1.5", "x": 0.5, "h": "CAFE"},
    {"s": "a", "i": 1, "t": "2024-01-02 03:04:05.000006", "d": "2024-01-02", "dec": "1.5", "x": 0.5, "h": "CAFE"},
    {"s": "b", "i": 2, "t": "2024-11-03 01:30:00", "d": "1969-12-31", "dec": "-2.25", "x": -1.25, "h": "00"},
    {"s": "c", "i": 3, "t": "1960-07-01 12:00:00", "d": "2024-03-10", "dec": "0", "x": 3.0, "h": ""},
]


def processors() -> tuple[type, type]:
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Probe(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.handle = handle
            self.value = handle.getValueState("seen", "key string")

        def seen(self, key: Any, rows: int) -> list[tuple[str, str]]:
            out = [("key", describe(key)), (f"{key[0]} rows", str(rows))]
            stored = self.value.get()
            if stored is None:
                self.value.update((describe(key),))
                self.handle.registerTimer(1)  # in the past: fires in this batch, after the rows
            else:
                out.append((f"{key[0]} stored", stored[0]))
            return out

        def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
            return self.emit([("timer key", describe(key)), ("timer state", describe(self.value.get()))])

        def emit(self, out: list[tuple[str, str]]) -> Any:
            raise NotImplementedError

        def close(self) -> None:
            return None

    class ProbePandas(Probe):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            return self.emit(self.seen(key, sum(len(frame) for frame in rows)))

        def emit(self, out: list[tuple[str, str]]) -> Any:
            yield pd.DataFrame({"what": [w for w, _ in out], "item": [i for _, i in out]})

    class ProbeRows(Probe):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            return self.emit(self.seen(key, sum(1 for _ in rows)))

        def emit(self, out: list[tuple[str, str]]) -> Any:
            for what, item in out:
                yield Row(what=what, item=item)

    return ProbePandas, ProbeRows


def probe_group(key: Any, frames: Any, state: Any) -> Any:
    rows = sum(len(frame) for frame in frames)
    out = [("key", describe(key)), ("timed out", str(state.hasTimedOut)), ("rows", str(rows))]
    if state.exists:
        out.append(("stored", state.get[0]))
    if not state.hasTimedOut:
        state.update((describe(key),))
        state.setTimeoutDuration(1)  # times out in batch 1 unless the key has rows then
    yield pd.DataFrame({"what": [w for w, _ in out], "item": [i for _, i in out]})


@pytest.mark.spark
def test_every_key_type_is_handed_out_and_finds_its_state_as_in_spark(session_conf: Any, tmp_path: Path) -> None:
    from pyspark.sql.streaming.state import GroupStateTimeout

    from backend.spark import api

    spark = session_conf
    spark.conf.set("spark.sql.session.timeZone", "America/Los_Angeles")  # not the machine's zone
    ProbePandas, ProbeRows = processors()
    build = {
        "pandas": (lambda g: g.transformWithStateInPandas(ProbePandas(), OUT, "Update", "ProcessingTime"),
                   lambda g, o: api.transform_with_state_in_pandas(g, ProbePandas(), OUT, "Update", "ProcessingTime",
                                                                   **o)),
        "row": (lambda g: g.transformWithState(ProbeRows(), OUT, "Update", "ProcessingTime"),
                lambda g, o: api.transform_with_state(g, ProbeRows(), OUT, "Update", "ProcessingTime", **o)),
        "apply": (lambda g: g.applyInPandasWithState(probe_group, OUT, "key string", "Update",
                                                     GroupStateTimeout.ProcessingTimeTimeout),
                  lambda g, o: api.apply_in_pandas_with_state(g, probe_group, OUT, "key string", "Update",
                                                              "ProcessingTimeTimeout", **o)),
    }  # fmt: skip

    def source(directory: Path, _: str) -> Any:
        return spark.readStream.schema(RAW).json(str(directory)).selectExpr(*SELECT).groupBy(*KEYS)

    outputs = both_sides(tmp_path, build, [ROWS, ROWS[:1]], source)
    assert_same(outputs, list(build))
    pandas_items = [item for rows in outputs["pandas ours"].values() for _, item in rows]
    assert any("Timestamp('2024-01-02 03:04:05.000006')" in item for item in pandas_items)
    assert any(what == "a stored" for what, _ in outputs["row ours"][1]), "batch 1 finds batch 0's state"
    assert any(what == "timed out" and item == "True" for what, item in outputs["apply ours"][1])


@pytest.mark.parametrize("use_pandas", [True, False])
@pytest.mark.parametrize(("column", "kind"), [([{"x": 1}, {"x": 2}], "dict"), ([[1], [2]], "list")])
def test_a_struct_or_array_grouping_column_is_refused_naming_it(use_pandas: bool, column: list[Any], kind: str) -> None:
    from backend.spark.batch import Partition

    with pytest.raises(TypeError, match=rf"grouping column 'st': a value of type {kind}"):
        Partition([pd.DataFrame({"st": column, "v": [1, 2]})], ["st"], use_pandas, None)


def test_a_key_of_a_type_that_cannot_be_a_grouping_key_is_refused_naming_its_column() -> None:
    with pytest.raises(TypeError, match=r"grouping column 'st': a value of type dict"):
        backend_key(["a", {"x": 1}], ["s", "st"])
    with pytest.raises(TypeError, match=r"grouping column 'gap': a value of type Timedelta"):
        backend_key([pd.Timedelta(1)], ["gap"])


def test_time_and_decimal_keys_are_backend_keys_and_come_back_as_sparks_timer_keys() -> None:
    """A pandas Timestamp key (a wall time) and a Row API aware datetime key (an instant) are
    backend keys; a timer hands back what pyspark's toInternal/fromInternal round trip gives."""
    la = datetime.timezone(datetime.timedelta(hours=-8))
    wall = pd.Timestamp("2024-01-02 03:04:05.000006")
    instant = datetime.datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=la)
    bkey = backend_key(["a", wall, instant, datetime.date(2024, 1, 2), decimal.Decimal("1.50"), pd.NaT])
    assert bkey == ("a", datetime.datetime(2024, 1, 2, 3, 4, 5, 6), instant, datetime.date(2024, 1, 2),
                    decimal.Decimal("1.50"), None)  # fmt: skip
    assert backend_key(bkey) == bkey  # timers set the key again from the backend key
    micros = int(instant.timestamp()) * 1_000_000 + 6
    local = datetime.datetime.fromtimestamp(micros // 1_000_000).replace(microsecond=6)  # pyspark's fromInternal
    assert timer_key(bkey) == (bkey[0], bkey[1], local, *bkey[3:])
