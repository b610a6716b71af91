"""Map state iterates in Spark's order: the order of the user keys' UnsafeRow bytes.

The unit tests hold the orders Spark 4.3's own operator (RocksDB) gives for keys put in the order
listed (observed with the processor of the Spark test below); the Spark test compares the two
operators on several key types directly.
"""

from __future__ import annotations

import datetime
import decimal
from pathlib import Path
from typing import Any

import pytest

from backend.spark.codecs import struct_codec
from backend.spark.unsafe_row import map_key_order
from tests.backend.spark.side_by_side import OUT, assert_same, both_sides, describe

D, Dec = datetime.datetime, decimal.Decimal

#: key schema -> (keys in insertion order, the order Spark iterates them)
SPARK_ORDERS: dict[str, tuple[list[Any], list[Any]]] = {
    "k long": ([3, 1024, 256, -1, 1025, 0, -256, 2**40], [0, 2**40, 256, 1024, -256, 1025, 3, -1]),
    "k int": ([3, 1024, 256, -1, 1025, 0], [0, 256, 1024, 1025, 3, -1]),
    "k smallint": ([3, 256, -1, 0], [0, 256, 3, -1]),
    "k tinyint": ([3, -1, 0, 1], [0, 1, 3, -1]),
    "k string": (
        ["b", "aa", "c", "ab", "x" * 9, "y" * 240, "z" * 300, "", "a" * 8, "é"],
        ["y" * 240, "", "b", "c", "aa", "ab", "é", "a" * 8, "x" * 9, "z" * 300],
    ),
    "k double": ([1.5, -1.5, 0.0, 2.0, 1e300, -0.5], [0.0, 2.0, -0.5, 1.5, -1.5, 1e300]),
    "k float": ([1.5, -1.5, 0.0, 2.0], [0.0, 2.0, 1.5, -1.5]),
    "k boolean": ([True, False], [False, True]),
    "k binary": ([b"b", b"aa", b"\x00", b"\xff\x01"], [b"\x00", b"b", b"aa", b"\xff\x01"]),
    "k timestamp": (
        [D(2024, 1, 1), D(2023, 1, 1), D(1969, 1, 1), D(2024, 1, 1, 0, 0, 1)],
        [D(2024, 1, 1), D(1969, 1, 1), D(2023, 1, 1), D(2024, 1, 1, 0, 0, 1)],
    ),
    "k date": (
        [datetime.date(2024, 1, 1), datetime.date(2023, 1, 1), datetime.date(1969, 1, 1)],
        [datetime.date(2024, 1, 1), datetime.date(1969, 1, 1), datetime.date(2023, 1, 1)],
    ),
    "k decimal(10,2)": (
        [Dec("1.5"), Dec("-1.5"), Dec("256"), Dec("0")],
        [Dec("0"), Dec("256"), Dec("-1.5"), Dec("1.5")],
    ),
    "k decimal(30,2)": (
        [Dec("1.5"), Dec("-1.5"), Dec("256"), Dec("0"), Dec("1e20")],
        [Dec("0"), Dec("1.5"), Dec("256"), Dec("-1.5"), Dec("1e20")],
    ),
    "a string, b long": (
        [("b", 1), ("aa", 2), ("b", 256), ("a", 3), ("b", -1)],
        [("b", 256), ("b", 1), ("a", 3), ("b", -1), ("aa", 2)],
    ),
    "a long, b string": ([(1, "b"), (1, "aa"), (256, "a"), (1, "a")], [(256, "a"), (1, "a"), (1, "b"), (1, "aa")]),
    # nulls (the trailing space makes it another entry)
    "a string, b long ": ([("b", None), ("b", 1), (None, 1)], [(None, 1), ("b", 1), ("b", None)]),
    "s struct<x:long,y:string>": (
        [((1, "b"),), ((1, "aa"),), ((256, "a"),)],
        [((256, "a"),), ((1, "b"),), ((1, "aa"),)],
    ),
}


def as_key(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


@pytest.mark.parametrize("schema", list(SPARK_ORDERS))
def test_the_order_key_gives_sparks_iteration_order(schema: str) -> None:
    inserted, spark_order = SPARK_ORDERS[schema]
    codec = struct_codec(schema, "m", prefix="key")
    order = map_key_order(codec.dtype)
    assert order is not None
    stored = sorted((codec.to_store(as_key(k)) for k in inserted), key=order)
    assert [codec.values(s) for s in stored] == [codec.values(codec.to_store(as_key(k))) for k in spark_order]


def test_map_state_iterators_follow_sparks_order(tmp_path: Path) -> None:
    """keys(), values() and iterator() of the drop-in's map state, on its LMDB store."""
    from backend.spark.handle import SparkStateHandle
    from backend.state.keyed_backend import ChangelogKeyedStateBackend
    from dstl import KeyGroupRange

    backend = ChangelogKeyedStateBackend("op", KeyGroupRange(0, 127), tmp_path, storage=None, log_enabled=False)
    try:
        handle = SparkStateHandle(backend, "None")
        maps = {schema: handle.getMapState(f"m{i}", schema, "v long") for i, schema in enumerate(SPARK_ORDERS)}
        handle.set_implicit_key(("k",))
        for schema, (inserted, spark_order) in SPARK_ORDERS.items():
            state = maps[schema]
            for i, key in enumerate(inserted):
                state.updateValue(as_key(key), (i,))
            codec = struct_codec(schema, "m", prefix="key")
            expected = [codec.values(codec.to_store(as_key(k))) for k in spark_order]
            assert list(state.keys()) == expected, schema
            assert [k for k, _ in state.iterator()] == expected, schema
            assert list(state.values()) == [(inserted.index(k),) for k in spark_order], schema
    finally:
        backend.close()


def test_a_user_key_with_an_array_keeps_the_drop_ins_order() -> None:
    assert map_key_order(struct_codec("k array<int>", "m").dtype) is None


MAP_KEYS = {name: schema.strip() for name, schema in zip(
    ["long", "int", "string", "double", "binary", "timestamp", "decimal", "wide_decimal", "pair", "nullable", "struct"],
    ["k long", "k int", "k string", "k double", "k binary", "k timestamp", "k decimal(10,2)", "k decimal(30,2)",
     "a string, b long", "a string, b long ", "s struct<x:long,y:string>"],
    strict=True,
)}  # fmt: skip


def processor() -> type:
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class FirstEntries(StatefulProcessor):
        """Puts the keys, then reports the map's keys(), values() and iterator() in their order."""

        def init(self, handle: Any) -> None:
            self.maps = {n: handle.getMapState(f"m_{n}", schema, "v long", 3_600_000 if n == "int" else None)
                         for n, schema in MAP_KEYS.items()}  # fmt: skip

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            for _ in rows:
                pass
            out = []
            for name, schema in MAP_KEYS.items():
                state = self.maps[name]
                for i, k in enumerate(SPARK_ORDERS[schema if name != "nullable" else schema + " "][0]):
                    state.updateValue(as_key(k), (i,))
                out.append((f"{name} keys", describe(list(state.keys()))))
                out.append((f"{name} values", describe(list(state.values()))))
                out.append((f"{name} iterator", describe(list(state.iterator()))))
            yield pd.DataFrame({"what": [w for w, _ in out], "item": [i for _, i in out]})

        def close(self) -> None:
            return None

    return FirstEntries


@pytest.mark.spark
def test_map_state_iterates_in_sparks_order(session_conf: Any, tmp_path: Path) -> None:
    from backend.spark import api

    spark = session_conf
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    FirstEntries = processor()
    build = {
        "pandas": (lambda g: g.transformWithStateInPandas(FirstEntries(), OUT, "Update", "ProcessingTime"),
                   lambda g, o: api.transform_with_state_in_pandas(g, FirstEntries(), OUT, "Update", "ProcessingTime",
                                                                   **o)),
    }  # fmt: skip

    def source(directory: Path, _: str) -> Any:
        return spark.readStream.schema("k string").json(str(directory)).groupBy("k")

    outputs = both_sides(tmp_path, build, [[{"k": "a"}], [{"k": "a"}]], source)
    assert_same(outputs, list(build))
    items = dict(outputs["pandas ours"][0])
    assert items["long keys"].startswith("list[tuple[int:0], tuple[int:1099511627776], tuple[int:256]")
