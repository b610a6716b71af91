"""Nested types in state: arrays of structs, structs in structs, maps of struct values, arrays of
arrays and of maps, in value, list and map state (with and without TTL), pandas and Row API.

What a state hands back must be what Spark's own operator (RocksDB) hands back: the same Python
types at every level (a struct inside an array or map is a ``Row`` with its field names, a
nested timestamp a naive datetime, binary bytes). Batch 0 writes, batch 1 reads what batch 0
stored (so the values went through storage); the outputs of each batch must be equal.
"""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any

import pytest

from backend.spark.codecs import struct_codec
from tests.backend.spark.side_by_side import OUT, assert_same, both_sides, describe

pd = pytest.importorskip("pandas")

NESTED = (
    "a array<struct<x:bigint,y:string>>, m map<string,struct<x:bigint,t:timestamp>>, aa array<array<bigint>>, "
    "s struct<x:struct<y:bigint>>, sa struct<a:array<struct<z:bigint,b:binary>>>, am array<map<string,bigint>>, "
    "ma map<string,array<struct<d:date,dec:decimal(10,2)>>>, fl array<double>"
)
D = datetime.datetime
VALUE = (
    [(1, "p"), None, {"x": 2, "y": "q"}],
    {"k": (3, D(2024, 1, 2, 3, 4, 5)), "n": None},
    [[1, 2], None, []],
    ((4,),),
    ([(5, b"\x00z"), None],),
    [{"a": 1}, None],
    {"z": [(datetime.date(2024, 1, 2), "1.5"), None]},  # a str in a decimal field: Spark stores null
    [1.5, float("nan"), float("-inf")],
)
EMPTY = ([], {}, [], (None,), (None,), [], {}, [])


def processors() -> tuple[type, type]:
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Probe(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.states = {}
            for ttl in (None, 3_600_000):
                tag = "ttl " if ttl else ""
                self.states[f"{tag}value"] = handle.getValueState(f"{tag}v", NESTED, ttl)
                self.states[f"{tag}list"] = handle.getListState(f"{tag}l", NESTED, ttl)
                self.states[f"{tag}map"] = handle.getMapState(f"{tag}m", "k string", NESTED, ttl)

        def items(self, key: Any) -> list[tuple[str, str]]:
            out = [("calls", "1")]  # never an empty frame (Spark's worker fails converting one)
            for name, state in self.states.items():
                if not state.exists():
                    if name.endswith("value"):
                        state.update(VALUE)
                    elif name.endswith("list"):
                        state.put([VALUE, EMPTY])
                    else:
                        state.updateValue(("full",), VALUE)
                        state.updateValue(("empty",), EMPTY)
                    continue
                if name.endswith("value"):
                    out.append((f"{name}.get", describe(state.get())))
                elif name.endswith("list"):
                    out.append((f"{name}.get", describe(list(state.get()))))
                else:
                    out.append((f"{name}.getValue", describe(state.getValue(("full",)))))
                    out.append((f"{name}.iterator", describe(sorted(state.iterator(), key=repr))))
            return [(f"{key[0]} {what}", item) for what, item in out]

        def close(self) -> None:
            return None

    class ProbePandas(Probe):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            for _ in rows:
                pass
            out = self.items(key)
            yield pd.DataFrame({"what": [w for w, _ in out], "item": [i for _, i in out]})

    class ProbeRows(Probe):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            for _ in rows:
                pass
            for what, item in self.items(key):
                yield Row(what=what, item=item)

    return ProbePandas, ProbeRows


@pytest.mark.spark
def test_nested_state_values_read_back_as_spark_hands_them_back(session_conf: Any, tmp_path: Path) -> None:
    from backend.spark import api

    spark = session_conf
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    ProbePandas, ProbeRows = processors()
    build = {
        "pandas": (lambda g: g.transformWithStateInPandas(ProbePandas(), OUT, "Update", "ProcessingTime"),
                   lambda g, o: api.transform_with_state_in_pandas(g, ProbePandas(), OUT, "Update", "ProcessingTime",
                                                                   **o)),
        "row": (lambda g: g.transformWithState(ProbeRows(), OUT, "Update", "ProcessingTime"),
                lambda g, o: api.transform_with_state(g, ProbeRows(), OUT, "Update", "ProcessingTime", **o)),
    }  # fmt: skip

    def source(directory: Path, _: str) -> Any:
        return spark.readStream.schema("k string").json(str(directory)).groupBy("k")

    outputs = both_sides(tmp_path, build, [[{"k": "a"}], [{"k": "a"}]], source)
    assert_same(outputs, list(build))
    read_back = dict(outputs["row ours"][1])
    assert "list[Row(x=int:1, y=str:'p'), NoneType:None, Row(x=int:2, y=str:'q')]" in read_back["a ttl value.get"]


def test_nested_values_round_trip_through_the_stored_bytes() -> None:
    """Every nesting Spark's state schemas allow is stored and read back (no Spark needed)."""
    codec = struct_codec(NESTED, "s")
    stored = codec.serializer.deserialize(codec.serializer.serialize(codec.to_store(VALUE)))
    back = codec.from_store(stored)
    assert back.a[2].y == "q" and back.a[1] is None
    assert back.m["k"].t == D(2024, 1, 2, 3, 4, 5) and back.m["n"] is None
    assert back.aa == [[1, 2], None, []]
    assert back.s.x.y == 4
    assert back.sa.a[0].b == b"\x00z" and back.sa.a[1] is None
    assert back.ma["z"][0].d == datetime.date(2024, 1, 2)


def test_a_map_keyed_by_a_struct_reads_back_with_row_keys() -> None:
    """Spark 4.3 fails the query for such a state schema; the drop-in stores it."""
    codec = struct_codec("mk map<struct<k:int>,double>", "s")
    stored = codec.serializer.deserialize(codec.serializer.serialize(codec.to_store(({(1,): 1.5},))))
    assert codec.from_store(stored).mk == {(1,): 1.5}


def test_nan_and_infinities_inside_arrays_and_maps_are_stored_as_spark_stores_them() -> None:
    codec = struct_codec("a array<struct<f:double>>, m map<string,float>, d array<double>", "s")
    value = ([(math.nan,), (math.inf,)], {"x": -math.inf}, [1.5, math.nan])
    back = codec.values(codec.serializer.deserialize(codec.serializer.serialize(codec.to_store(value))))
    assert math.isnan(back[0][0].f) and back[0][1].f == math.inf
    assert back[1] == {"x": -math.inf}
    assert back[2][0] == 1.5 and math.isnan(back[2][1])
    assert codec.serializer.serialize(codec.to_store(([], {}, [1.5, 2.0]))).endswith(b"[1.5,2.0]")  # as before
