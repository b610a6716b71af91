"""A restart under a changed state schema, side by side: the same processors and input files
through Spark's own operator (RocksDB, ``encodingFormat=avro``, its checkpoint) and through the
drop-in (``backend.spark.api``, its checkpoint), one run after another.

A processor is data: a tuple of ``Var``s (name, kind, schema, map key schema, TTL), so a change
between runs is two tuples. For each input key and batch it reads every state variable, writes one
value per input row built from the row's ``v`` and the schema (ints ``v``, floats ``v + 0.5``,
strings ``<field><v>``, ...), and reads it again; each read is emitted as ``describe`` text (types
and values), so an old value read through a changed schema shows exactly what user code got.
Both APIs (``pandas``: ``transformWithStateInPandas``, ``row``: ``transformWithState``) run the
same body. TTLs are an hour: nothing expires within a test, the TTL changes only how the state is
stored. The module is pickled by value (Spark's Python workers need not import the tests).
"""

from __future__ import annotations

import datetime
import decimal
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyspark.cloudpickle

from tests.backend.spark import side_by_side
from tests.backend.spark.queries import publish
from tests.backend.spark.side_by_side import describe

OUTPUT_SCHEMA = "user string, state string, at string, seen string"
#: the session confs of these runs: Avro-encoded state (Spark's schema evolution), batches only when
#: a file arrives (processAllAvailable returns in ProcessingTime mode), one shuffle partition
CONFS = {
    "spark.sql.streaming.stateStore.encodingFormat": "avro",
    "spark.sql.streaming.noDataMicroBatches.enabled": "false",
    "spark.sql.shuffle.partitions": "1",
}
HOUR_MS = 3_600_000
ENGINES = ("spark", "ours")


@dataclass(frozen=True)
class Var:
    """One state variable of a processor: ``kind`` value, list or map; ``schema`` the value's (a
    list's element, a map's value) DDL; ``key`` a map's user key DDL; ``ttl_ms`` its TTL."""

    name: str
    kind: str
    schema: str
    key: str = ""
    ttl_ms: int | None = None


def _make(dtype: Any, v: int, name: str) -> Any:
    """The value of a field of Spark type ``dtype`` built from the input's ``v``."""
    kind = dtype.name
    if kind in ("long", "int", "short", "byte"):
        return v
    if kind in ("double", "float"):
        return v + 0.5
    if kind == "string":
        return f"{name}{v}"
    if kind == "binary":
        return f"{name}{v}".encode()
    if kind == "boolean":
        return v % 2 == 0
    if kind == "date":
        return datetime.date(2024, 1, 1) + datetime.timedelta(days=v)
    if kind in ("timestamp", "timestamp_ntz"):
        return datetime.datetime(2024, 1, 1) + datetime.timedelta(seconds=v)
    if kind == "decimal":
        return decimal.Decimal(v)
    if kind == "array":
        return [_make(dtype.element, v, name)]
    assert kind == "struct", kind
    return tuple(_make(f.type, v, f.name) for f in dtype.fields)


def evolving(api: str, variables: tuple[Var, ...]) -> Any:
    """A processor of ``api`` ("pandas" or "row") over ``variables`` (see the module docstring)."""
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    from backend.spark.schema import parse_schema

    types = {var.name: (parse_schema(var.schema), parse_schema(var.key) if var.key else None) for var in variables}

    def read(var: Var, state: Any) -> str:
        if var.kind == "value":
            return describe(state.get())
        if var.kind == "list":
            return describe(list(state.get()))
        return describe(sorted((describe(k), describe(v)) for k, v in state.iterator()))

    def write(var: Var, state: Any, v: int) -> None:
        value_type, key_type = types[var.name]
        value = _make(value_type, v, var.name)
        if var.kind == "value":
            state.update(value)
        elif var.kind == "list":
            state.appendValue(value)
        else:
            state.updateValue(_make(key_type, v % 3, var.name), value)

    class Evolving(StatefulProcessor):  # type: ignore[misc, unused-ignore]
        def init(self, handle: Any) -> None:
            self.states = []
            for var in variables:
                ttl = (var.ttl_ms,) if var.ttl_ms else ()
                if var.kind == "value":
                    self.states.append(handle.getValueState(var.name, var.schema, *ttl))
                elif var.kind == "list":
                    self.states.append(handle.getListState(var.name, var.schema, *ttl))
                else:
                    self.states.append(handle.getMapState(var.name, var.key, var.schema, *ttl))

        def visit(self, values: list[int]) -> list[tuple[str, str, str]]:
            out = []
            for var, state in zip(variables, self.states, strict=True):
                out.append((var.name, "before", read(var, state)))
                for v in values:
                    write(var, state, v)
                out.append((var.name, "after", read(var, state)))
            return out

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            user = str(key[0])
            if api == "pandas":
                import pandas as pd  # type: ignore[import-untyped, unused-ignore]

                seen = self.visit([int(v) for frame in rows for v in frame["v"]])
                yield pd.DataFrame([(user, *s) for s in seen], columns=["user", "state", "at", "seen"])
            else:
                for name, at, what in self.visit([int(r["v"]) for r in rows]):
                    yield Row(user=user, state=name, at=at, seen=what)

        def close(self) -> None:
            return None

    return Evolving()


@dataclass
class Outcome:
    """One engine's run: its output rows (sorted) or the error that stopped it."""

    rows: list[tuple[Any, ...]] = field(default_factory=list)
    error: str | None = None


def time_mode(*versions: tuple[Var, ...]) -> str:
    """ProcessingTime when any version has a TTL (Spark refuses a TTL in mode None), for every run
    of a case: the time mode is not what changes."""
    return "ProcessingTime" if any(var.ttl_ms for vs in versions for var in vs) else "None"


def run(
    spark: Any,
    root: Path,
    api: str,
    variables: tuple[Var, ...],
    files: list[list[dict[str, Any]]],
    mode: str,
    key_type: str = "string",
) -> dict[str, Outcome]:
    """One run of both engines' queries under their checkpoints in ``root``: each file is published
    to both input directories and processed (``processAllAvailable``) before the next; returns
    each engine's output or error. The drop-in's coordinators are forgotten after, as after a
    driver restart."""
    from backend.spark import api as ours
    from backend.spark import driver

    outcomes = {engine: Outcome() for engine in ENGINES}
    queries = {}
    try:
        for engine in ENGINES:
            work = root / engine
            (work / "in").mkdir(parents=True, exist_ok=True)
            grouped = spark.readStream.schema(f"user {key_type}, v long").json(str(work / "in")).groupBy("user")
            proc = evolving(api, variables)
            if engine == "spark":
                method = grouped.transformWithStateInPandas if api == "pandas" else grouped.transformWithState
                df = method(proc, OUTPUT_SCHEMA, "Update", mode)
            else:
                build = ours.transform_with_state_in_pandas if api == "pandas" else ours.transform_with_state
                df = build(grouped, proc, OUTPUT_SCHEMA, "Update", mode, checkpoint_location=str(work / "state"),
                           operator_uid="evolution", local_dir=str(work / "local"))  # fmt: skip
            seen = outcomes[engine].rows
            queries[engine] = (
                df.writeStream.outputMode("update")
                .foreachBatch(lambda batch, _, seen=seen: seen.extend(tuple(r) for r in batch.collect()))
                .option("checkpointLocation", str(work / "checkpoint"))
                .start()
            )
        for rows in files:
            for engine, query in queries.items():
                directory = root / engine / "in"
                publish(directory / f"{len(list(directory.iterdir())):04d}.json",
                        "".join(json.dumps(r) + "\n" for r in rows))  # fmt: skip
                if outcomes[engine].error is None:
                    try:
                        query.processAllAvailable()
                    except Exception as error:  # the query failed: its error is the outcome
                        outcomes[engine].error = str(error)
    finally:
        for query in queries.values():
            query.stop()
        driver.forget_all()
    for outcome in outcomes.values():
        outcome.rows.sort()
    return outcomes


# Spark's Python workers need not import the tests package: ship the processors by value
pyspark.cloudpickle.register_pickle_by_value(side_by_side)  # type: ignore[no-untyped-call]
pyspark.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
