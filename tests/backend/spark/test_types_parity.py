"""Parity of Python types: what user code sees on this backend is what Spark's own operators hand it.

A probe processor (pandas API, Row API) and a probe function (``applyInPandasWithState``) record,
for every value they see, its type and repr as a string: the input rows (a column of every Spark
SQL type, nested ones, and nulls of each), the grouping key (handleInputRows', handleExpiredTimer's
Row, a timed-out key of applyInPandasWithState), and state read back in a later call (value, list
and map state, GroupState), for state schemas of every type. The same probes run through Spark's
own operators (RocksDB state store) and through this backend on one input, in the UTC and in the
America/Los_Angeles session time zone; the outputs of each batch must be equal as multisets. A
second test writes values of the wrong Python type into every field type and compares what is
stored (or raised) with what Spark stores.
"""

from __future__ import annotations

import datetime
import decimal
from pathlib import Path
from typing import Any

import pytest

from tests.backend.spark.side_by_side import OUT, assert_same, both_sides, describe

pytestmark = pytest.mark.spark

pd = pytest.importorskip("pandas")
np = pytest.importorskip("numpy")
pytest.importorskip("pyspark")

RAW = (
    "ks string, ki long, kb boolean, kbin string, kf double, t string, dd string, dec string, bin string, bo boolean, "
    "n long, x double, s string"
)
KEYS = ["ks", "ki", "kb", "kbin", "kf"]
SELECT = [
    "ks", "CAST(ki AS INT) ki", "kb", "unhex(kbin) kbin", "kf", "CAST(t AS TIMESTAMP) ts",
    "CAST(t AS TIMESTAMP_NTZ) tsn", "CAST(dd AS DATE) d", "CAST(dec AS DECIMAL(10,2)) dec", "unhex(bin) bin", "bo",
    "CAST(n AS TINYINT) i8", "CAST(n AS SMALLINT) i16", "CAST(n AS INT) i32", "CAST(n AS BIGINT) i64",
    "CAST(x AS FLOAT) f32", "CAST(x AS DOUBLE) f64", "s",
    "CASE WHEN n IS NULL THEN NULL ELSE array(n, NULL, n + 1) END arr",
    "CASE WHEN s IS NULL THEN NULL ELSE map(s, n, 'z', CAST(NULL AS BIGINT)) END m",
    "CASE WHEN n IS NULL THEN NULL ELSE named_struct('x', n, 'y', s) END st",
    "CASE WHEN n IS NULL THEN NULL ELSE array(CAST(t AS TIMESTAMP), NULL) END ats",
    "CASE WHEN n IS NULL THEN NULL ELSE named_struct('t', CAST(t AS TIMESTAMP), 'n', CAST(t AS TIMESTAMP_NTZ)) END sts",
    "CASE WHEN n IS NULL THEN NULL ELSE map('k', CAST(t AS TIMESTAMP)) END mts",
    "CASE WHEN n IS NULL THEN NULL ELSE array(named_struct('x', n)) END ast",
]  # fmt: skip
#: a state schema of every type a state can hold (applyInPandasWithState: Spark 4.3 refuses
#: arrays and maps in its state schema, so those fields are left out there)
STATE = (
    "ts timestamp, tsa timestamp, tsn timestamp_ntz, d date, dec decimal(10,2), bin binary, bo boolean, i8 tinyint, "
    "i16 smallint, i32 int, i64 bigint, f32 float, f64 double, s string, arr array<bigint>, m map<string,bigint>, "
    "st struct<x:bigint,y:string>"
)
PLUS2 = datetime.timezone(datetime.timedelta(hours=2))
VALUES = (
    datetime.datetime(2024, 1, 2, 3, 4, 5, 6), datetime.datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=PLUS2),
    datetime.datetime(2024, 1, 2, 3, 4, 5, 6), datetime.date(2024, 1, 2), decimal.Decimal("1.5"), b"ab", True, 1, 2, 3,
    4, 0.1, 0.1, "x", [1, None, 3], {"a": 1, "b": None}, (5, "y"),
)  # fmt: skip
NULLS = (None,) * len(VALUES)
NAMES = [f.split()[0] for f in STATE.split(", ")]
GS_STATE = ", ".join(f for f in STATE.split(", ") if f.split()[0] not in ("arr", "m"))
GS_VALUES = tuple(v for n, v in zip(NAMES, VALUES, strict=True) if n not in ("arr", "m"))
MAP_KEY = "mts timestamp, md date, ms string"
MAP_KEYS = [
    (datetime.datetime(2024, 3, 4, 5, 6, 7), datetime.date(2024, 3, 4), "k1"),
    (datetime.datetime(2024, 3, 4, 5, 6, 8), datetime.date(2024, 3, 5), "k2"),
]


def raw(ks: str, full: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"ks": ks, "ki": 7, "kb": True, "kbin": "CAFE", "kf": 0.5}
    if full:
        row.update(t="2024-01-02 03:04:05.000006", dd="2024-01-02", dec="1.5", bin="6162", bo=True, n=4, x=0.1, s="x")
    return row


#: "full" twice, so that batch 1 reads what batch 0 stored; "null" times out in batch 1
BATCHES = [[raw("full", True), raw("null", False)], [raw("full", True)]]


def frame_items(frame: Any, where: str) -> list[tuple[str, str]]:
    out = [(f"{where} columns", repr(list(frame.columns)))]
    for i, c in enumerate(frame.columns):
        out.append((f"{where} dtype {c}", str(frame.dtypes.iloc[i])))
        out += [(f"{where} {c}[{j}]", describe(frame.iloc[j, i])) for j in range(len(frame))]
    return out


def processors() -> tuple[type, type]:
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Probe(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.handle = handle
            self.value = handle.getValueState("v", STATE)
            self.list = handle.getListState("l", STATE)
            self.map = handle.getMapState("m", MAP_KEY, STATE)

        def state_items(self, where: str) -> list[tuple[str, str]]:
            out = [(f"{where} value.get", describe(self.value.get()))]
            out.append((f"{where} list.get", describe(list(self.list.get()))))
            out += [(f"{where} map.getValue {k[2]}", describe(self.map.getValue(k))) for k in MAP_KEYS]
            for name in ("keys", "values", "iterator"):
                out.append((f"{where} map.{name}", describe(sorted(getattr(self.map, name)(), key=repr))))
            return out

        def seen(self, key: Any, items: list[tuple[str, str]]) -> list[tuple[str, str]]:
            out = [("key", describe(key)), *items]
            if self.value.exists():  # stored in an earlier batch
                out += self.state_items(f"{key[0]} state")
            else:
                self.value.update(VALUES if key[0] == "full" else NULLS)
                self.list.put([VALUES, NULLS])
                self.map.updateValue(MAP_KEYS[0], VALUES)
                self.map.updateValue(MAP_KEYS[1], NULLS)
                self.handle.registerTimer(1)  # in the past: fires in this batch, after the rows
            return out

        def emit(self, out: list[tuple[str, str]]) -> Any:
            raise NotImplementedError

        def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
            return self.emit([("timer key", describe(key)), *self.state_items(f"{key[0]} timer state")])

        def close(self) -> None:
            return None

    class ProbePandas(Probe):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            items = [item for frame in rows for item in frame_items(frame, f"{key[0]} rows")]
            return self.emit(self.seen(key, items))

        def emit(self, out: list[tuple[str, str]]) -> Any:
            yield pd.DataFrame({"what": [w for w, _ in out], "item": [i for _, i in out]})

    class ProbeRows(Probe):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            return self.emit(self.seen(key, [(f"{key[0]} row", describe(r)) for r in rows]))

        def emit(self, out: list[tuple[str, str]]) -> Any:
            for what, item in out:
                yield Row(what=what, item=item)

    return ProbePandas, ProbeRows


def probe_group(key: Any, frames: Any, state: Any) -> Any:
    out = [("key", describe(key)), ("timed out", str(state.hasTimedOut))]
    for frame in frames:
        out += frame_items(frame, f"{key[0]} rows")
    if state.exists:
        out.append((f"{key[0]} state.get", describe(state.get)))
    else:
        state.update(GS_VALUES if key[0] == "full" else NULLS[: len(GS_VALUES)])
    if not state.hasTimedOut:
        state.setTimeoutDuration(1)  # "full" times out in batch 1, when only "null" has rows
    yield pd.DataFrame({"what": [w for w, _ in out], "item": [i for _, i in out]})


@pytest.mark.parametrize("zone", ["UTC", "America/Los_Angeles"])
def test_user_code_sees_the_types_sparks_operators_hand_it(session_conf: Any, tmp_path: Path, zone: str) -> None:
    from pyspark.sql.streaming.state import GroupStateTimeout

    from backend.spark import api

    spark = session_conf
    spark.conf.set("spark.sql.session.timeZone", zone)
    ProbePandas, ProbeRows = processors()
    build = {
        "pandas": (lambda g: g.transformWithStateInPandas(ProbePandas(), OUT, "Update", "ProcessingTime"),
                   lambda g, o: api.transform_with_state_in_pandas(g, ProbePandas(), OUT, "Update", "ProcessingTime",
                                                                   **o)),
        "row": (lambda g: g.transformWithState(ProbeRows(), OUT, "Update", "ProcessingTime"),
                lambda g, o: api.transform_with_state(g, ProbeRows(), OUT, "Update", "ProcessingTime", **o)),
        "apply": (lambda g: g.applyInPandasWithState(probe_group, OUT, GS_STATE, "Update",
                                                     GroupStateTimeout.ProcessingTimeTimeout),
                  lambda g, o: api.apply_in_pandas_with_state(g, probe_group, OUT, GS_STATE, "Update",
                                                              "ProcessingTimeTimeout", **o)),
    }  # fmt: skip

    def source(directory: Path, _: str) -> Any:
        return spark.readStream.schema(RAW).json(str(directory)).selectExpr(*SELECT).groupBy(*KEYS)

    outputs = both_sides(tmp_path, build, BATCHES, source)
    assert_same(outputs, list(build))
    seen = {item for rows in outputs["row spark"].values() for _, item in rows}
    assert any(f"ZoneInfo(key='{zone}')" in item for item in seen), "the Row API's timestamps carry the zone"
    assert any(what == "timer key" for rows in outputs["pandas ours"].values() for what, _ in rows)
    assert any(what == "timed out" and item == "True" for rows in outputs["apply ours"].values() for what, item in rows)


# -- values of the wrong type ---------------------------------------------------------------------------------------

FIELD_TYPES = [
    "bigint", "int", "smallint", "tinyint", "double", "float", "string", "date", "timestamp", "timestamp_ntz",
    "decimal(10,2)", "binary", "boolean", "array<bigint>", "map<string,bigint>", "struct<x:bigint>",
]  # fmt: skip
WRONG: list[tuple[str, Any]] = [
    ("int", 1), ("int300", 300), ("int2^40", 2**40), ("int2^63", 2**63), ("int2^70", 2**70), ("neg", -129),
    ("str", "x"), ("numeric str", "12"), ("float", 1.5), ("nan", float("nan")), ("bool", True), ("bytes", b"ab"),
    ("list", [1]), ("tuple", (1,)), ("dict", {"a": 1}), ("date", datetime.date(2024, 1, 2)),
    ("datetime", datetime.datetime(2024, 1, 2, 3, 4, 5)), ("decimal", decimal.Decimal("1.5")),
    ("pairs", [("a", 1)]), ("bad dict", {"a": "x"}), ("strings", ["x"]), ("numpy int", np.int64(5)),
    ("numpy float", np.float64(2.5)),
]  # fmt: skip
#: Spark stores a JVM identity string for these in a string field ("[B@1b2c3d"): no value can match
_IDENTITY = {"bytes", "tuple", "date", "datetime", "pairs"}
#: the whole value in the wrong shape
SHAPES: list[tuple[str, Any]] = [
    ("list", [1, "y"]), ("dict", {"a": 1, "b": "y"}), ("string", "ab"), ("set", {1, 2}), ("scalar", 5), ("none", None),
    ("null field", (None, "y")),
]  # fmt: skip


def cases() -> list[tuple[str, Any]]:
    return [(f"{t} <- {n}", (t, v)) for t in FIELD_TYPES for n, v in WRONG if not (t == "string" and n in _IDENTITY)]


def wrong_type_processors() -> tuple[type, type]:
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Probe(StatefulProcessor):
        def init(self, handle: Any) -> None:
            def schema(t: str) -> str:
                return f"a {t}, b string"

            self.value = {t: handle.getValueState(f"v{i}", schema(t)) for i, t in enumerate(FIELD_TYPES)}
            self.list = {t: handle.getListState(f"l{i}", schema(t)) for i, t in enumerate(FIELD_TYPES)}
            self.map = {t: handle.getMapState(f"m{i}", "k string", schema(t)) for i, t in enumerate(FIELD_TYPES)}
            self.shape = handle.getValueState("shape", "a bigint, b string")

        def write_and_read(self, what: str, field_type: str, value: Any) -> Any:
            if what == "value":
                self.value[field_type].update(value)
                return self.value[field_type].get()
            if what == "list":
                self.list[field_type].put([value])
                return list(self.list[field_type].get())
            self.map[field_type].updateValue(("k",), value)
            return self.map[field_type].getValue(("k",))

        def results(self) -> list[tuple[str, str]]:
            out = []
            for label, (t, wrong) in cases():
                for what in ("value", "list", "map"):
                    try:
                        out.append((f"{what} {label}", describe(self.write_and_read(what, t, (wrong, "y")))))
                    except Exception as exc:  # what Spark raises, we raise
                        out.append((f"{what} {label}", describe(exc)))
            for name, value in SHAPES:
                try:
                    self.shape.update(value)
                    out.append((f"shape {name}", describe(self.shape.get())))
                except Exception as exc:  # what Spark raises, we raise
                    out.append((f"shape {name}", describe(exc)))
            return out

        def close(self) -> None:
            return None

    class ProbePandas(Probe):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            out = self.results()
            yield pd.DataFrame({"what": [w for w, _ in out], "item": [i for _, i in out]})

    class ProbeRows(Probe):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            for what, item in self.results():
                yield Row(what=what, item=item)

    return ProbePandas, ProbeRows


#: GroupState: the state is written after the function returns, and what pyspark refuses fails the
#: query there, so only what Spark stores is compared (one key per case, read back in batch 1)
GS_TYPES = [t for t in FIELD_TYPES if not t.startswith(("array", "map"))]
GS_RAISING = {"date", "timestamp", "timestamp_ntz", "struct<x:bigint>"}


def gs_cases() -> list[tuple[str, str, Any]]:
    return [
        (f"{t} <- {n}", t, v) for t in GS_TYPES for n, v in WRONG
        if t not in GS_RAISING and not (t == "string" and n in _IDENTITY)
    ]  # fmt: skip


def wrong_type_group(key: Any, frames: Any, state: Any) -> Any:
    for _ in frames:
        pass
    label, field_type, wrong = gs_cases()[int(key[1])]
    if state.exists:
        yield pd.DataFrame({"what": [label], "item": [describe(state.get)]})
        return
    value: list[Any] = [None] * (len(GS_TYPES) + 1)
    value[GS_TYPES.index(field_type)], value[-1] = wrong, "y"
    state.update(value)
    yield pd.DataFrame({"what": [label], "item": ["written"]})


def test_wrongly_typed_state_values_are_stored_as_spark_stores_them(session_conf: Any, tmp_path: Path) -> None:
    from pyspark.sql.streaming.state import GroupStateTimeout

    from backend.spark import api

    spark = session_conf
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    ProbePandas, ProbeRows = wrong_type_processors()
    gs_schema = ", ".join(f"f{i} {t}" for i, t in enumerate(GS_TYPES)) + ", b string"

    def source(directory: Path, api_name: str) -> Any:  # one key for the processors, a key per case for GroupState
        rows = spark.readStream.schema("ks string, ki long").json(str(directory))
        return rows.where("ks = 'gs'" if api_name == "apply" else "ks = 'a'").groupBy("ks", "ki")

    build = {
        "pandas": (lambda g: g.transformWithStateInPandas(ProbePandas(), OUT, "Update", "None"),
                   lambda g, o: api.transform_with_state_in_pandas(g, ProbePandas(), OUT, "Update", "None", **o)),
        "row": (lambda g: g.transformWithState(ProbeRows(), OUT, "Update", "None"),
                lambda g, o: api.transform_with_state(g, ProbeRows(), OUT, "Update", "None", **o)),
        "apply": (lambda g: g.applyInPandasWithState(wrong_type_group, OUT, gs_schema, "Update",
                                                     GroupStateTimeout.NoTimeout),
                  lambda g, o: api.apply_in_pandas_with_state(g, wrong_type_group, OUT, gs_schema, "Update",
                                                              "NoTimeout", **o)),
    }  # fmt: skip
    keys = [{"ks": "a", "ki": 0}] + [{"ks": "gs", "ki": i} for i in range(len(gs_cases()))]
    outputs = both_sides(tmp_path, build, [keys, keys], source)
    assert_same(outputs, ["pandas", "row", "apply"])
    items = dict(outputs["pandas ours"][0])
    assert items["value bigint <- str"] == "tuple[NoneType:None, str:'y']"  # the example
    assert items["value tinyint <- int300"] == "tuple[int:44, str:'y']"
    assert items["value timestamp <- int"] == "raises AttributeError None"
