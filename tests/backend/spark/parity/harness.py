"""Run one scenario through two engines side by side and compare their outputs round by round.

Both queries read one input directory in one SparkSession; the harness publishes one file per
round and waits until each side has done everything the round causes, then attributes output
rows to rounds by batch id (a ``foreachBatch`` sink keeps each batch's rows): the rows of batches
after the previous round's last batch, up to this round's, form this round's multiset.

Waiting is on conditions, never on sleeps. The drop-in's ``processAllAvailable()`` returns once
no batch is due. So does Spark's, except where its own operator runs a no-data batch at every
trigger (processing-time timers or timeouts with no-data batches on): there the harness follows
the query's progress (a listener) until a batch completed that started after the previous side
finished the round
(its trigger timestamp is later) and that lies ``Scenario.settle_batches`` batches after the one
that read the round's file, so every timer the round made due has fired. A scenario's pauses let
time pass between rounds; they are input, not synchronization.

On a Spark Connect session the ``foreachBatch`` function runs in a process of the server's,
without the harness's variables: it leaves each batch's rows in a file the harness reads
(``file_sink``).
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyspark.cloudpickle

from tests.backend.spark.parity import processors
from tests.backend.spark.parity.processors import (
    GROUP_STATE_SCHEMA,
    INITIAL_SCHEMA,
    INPUT_SCHEMA,
    OUTPUT_SCHEMA,
    WATERMARK_DELAY,
    group_function,
    processor,
)
from tests.backend.spark.parity.scenarios import Scenario

# Spark's Python workers cannot import the tests package: ship the processors by value
pyspark.cloudpickle.register_pickle_by_value(processors)  # type: ignore[no-untyped-call]

#: the session conf by which pyspark's worker cuts a key's rows into the chunks (DataFrames) a
#: pandas handler iterates over (counting initial-state rows too, for transformWithStateInPandas)
ARROW_BATCH_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"
#: how long one side may take to finish one round before the run is declared hung, seconds
ROUND_DEADLINE_S = 180.0
#: how often a wait for progress also checks that the query is still running, seconds
_LIVENESS_S = 1.0
#: Spark's error when a Python worker it started did not connect back in time, and what it means
CONNECT_BACK_FAILURE = "Python worker failed to connect back"
CONNECT_BACK_CAUSE = (
    "not a difference between the engines: Spark's fixed 10 s wait for a Python worker to connect back "
    "expired: the machine is overloaded, or the worker died before connecting (its stderr is in the "
    "captured output)"
)

Rows = Counter[tuple[Any, ...]]


class HarnessError(AssertionError):
    """A side failed or hung (the message names the scenario)."""


@dataclass
class Side:
    """One engine's query and what its sink saw."""

    engine: str  # "ours" (the drop-in) or "spark" (Spark's own operator)
    continuous: bool  # Spark runs a batch at every trigger: wait on progress, not processAllAvailable
    query: Any = None
    batches: dict[int, Rows] = field(default_factory=dict)
    bounds: list[int] = field(default_factory=list)  # the last batch id of each round
    #: on a Connect session: where the sink (on the server) writes each batch's rows
    batch_dir: Path | None = None

    def read_batches(self) -> None:
        """Take the batches the Connect sink wrote (a ``foreachBatch`` function runs on the
        server there, in a process of its own: it cannot add to ``batches`` itself)."""
        if self.batch_dir is not None:
            for path in self.batch_dir.glob("*.json"):
                rows = json.loads(path.read_text())
                self.batches[int(path.stem)] = Counter(_hashable(row) for row in rows)

    def round_rows(self) -> list[Rows]:
        out: list[Rows] = []
        previous = -1
        for last in self.bounds:
            rows: Rows = Counter()
            for batch in range(previous + 1, last + 1):
                rows.update(self.batches.get(batch, Counter()))
            out.append(rows)
            previous = max(previous, last)
        return out


@dataclass(repr=False)
class Outcome:
    """Both sides' outputs per round, and the rounds that differ."""

    scenario: Scenario
    sides: list[Side]

    def __repr__(self) -> str:  # pytest prints it under a failed assertion; report() has the detail
        return f"Outcome({' vs '.join(side.engine for side in self.sides)}, {len(self.scenario.rounds)} rounds)"

    def rounds(self) -> list[tuple[Rows, Rows]]:
        a, b = (side.round_rows() for side in self.sides)
        return list(zip(a, b, strict=True))

    def differing(self) -> list[int]:
        return [i for i, (a, b) in enumerate(self.rounds()) if a != b]

    def report(self) -> str:
        a, b = (side.engine for side in self.sides)
        names = (f"{a} (1st)", f"{b} (2nd)") if a == b else (a, b)
        lines = [f"{len(self.differing())} of {len(self.scenario.rounds)} rounds differ; scenario (for @example):",
                 f"    {self.scenario!r}"]  # fmt: skip
        for index, (x, y) in enumerate(self.rounds()):
            mark = "DIFF" if x != y else "same"
            lines.append(f"  round {index} {mark}: {names[0]} batches<= {self.sides[0].bounds[index]}, "
                         f"{names[1]} batches<= {self.sides[1].bounds[index]}")  # fmt: skip
            if x != y:
                lines.append(f"    only {names[0]}: {sorted((x - y).elements())}")
                lines.append(f"    only {names[1]}: {sorted((y - x).elements())}")
            lines.append(f"    both: {sorted((x & y).elements())}")
        return "\n".join(lines)


def publish(path: Path, text: str) -> None:
    """Write an input file atomically under a name Spark's file source ignores until the rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _now_ms() -> int:
    return int(time.time() * 1000)


def let_time_pass(ms: int) -> None:
    """A scenario's pause: return once the clock has moved on by ``ms``."""
    until = time.monotonic() + ms / 1000
    while (left := until - time.monotonic()) > 0:
        time.sleep(left)


def _dataframe(spark: Any, scenario: Scenario, engine: str, source: Path, work: Path, parallelism: int) -> Any:
    """The scenario's stateful query on ``engine`` (the drop-in at ``parallelism``), before its sink."""
    from backend.spark import api

    stream = spark.readStream.schema(INPUT_SCHEMA).json(str(source))
    if scenario.watermark:
        stream = stream.withWatermark("ts", WATERMARK_DELAY)
    grouped = stream.groupBy("key", "v") if scenario.composite_key else stream.groupBy("key")
    options: dict[str, Any] = {
        "checkpoint_location": str(work / "state"), "operator_uid": "parity",
        "parallelism": parallelism, "local_dir": str(work / "local"),
    }  # fmt: skip
    b, mode, output_mode = scenario.behaviour, scenario.mode, scenario.output_mode
    if scenario.api == "gs":
        func = group_function(b, mode)
        if engine == "spark":
            return grouped.applyInPandasWithState(func, OUTPUT_SCHEMA, GROUP_STATE_SCHEMA, output_mode, mode)
        return api.apply_in_pandas_with_state(
            grouped, func, OUTPUT_SCHEMA, GROUP_STATE_SCHEMA, output_mode, mode, **options
        )
    initial = None
    if scenario.initial is not None:
        initial = spark.createDataFrame(list(scenario.initial), INITIAL_SCHEMA).groupBy("key")
    proc = processor(scenario.api, b, mode)
    if engine == "spark":
        method = grouped.transformWithStateInPandas if scenario.api == "pandas" else grouped.transformWithState
        return method(proc, OUTPUT_SCHEMA, output_mode, mode, initialState=initial)
    ours = api.transform_with_state_in_pandas if scenario.api == "pandas" else api.transform_with_state
    return ours(grouped, proc, OUTPUT_SCHEMA, output_mode, mode, initialState=initial, **options)


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _start(side: Side, df: Any, scenario: Scenario, checkpoint: Path) -> None:
    from backend.spark.connect import is_connect

    def collect(batch_df: Any, batch_id: int) -> None:
        side.batches[batch_id] = Counter(tuple(row) for row in batch_df.collect())

    sink = collect
    if is_connect(df.sparkSession):  # the function runs on the server: it leaves the rows in files
        side.batch_dir = checkpoint.parent / "batches"
        side.batch_dir.mkdir(parents=True, exist_ok=True)
        sink = file_sink(str(side.batch_dir))
    side.query = (
        df.writeStream.outputMode(scenario.output_mode.lower())
        .foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )


def file_sink(directory: str) -> Any:
    """A ``foreachBatch`` function writing each batch's rows to ``<directory>/<batch id>.json``
    (values JSON cannot hold as their ``repr``: both sides go through the same conversion). On a
    Connect session it runs in a process of the server's, without the harness's variables."""

    def write(batch_df: Any, batch_id: int) -> None:
        import json
        import os

        rows = [list(row) for row in batch_df.collect()]
        tmp = os.path.join(directory, f".{batch_id}.tmp")
        with open(tmp, "w") as out:
            json.dump(rows, out, default=repr)
        os.replace(tmp, os.path.join(directory, f"{batch_id}.json"))

    return write


def _failure(side: Side, what: str) -> HarnessError:
    error = side.query.exception() if side.query is not None else None
    detail = ""
    if error is not None:  # the Python traceback's lines, without the JVM's stack frames
        lines = [line for line in str(error).splitlines() if line.strip() and not line.lstrip().startswith("at ")]
        detail = ":\n" + "\n".join(lines[-25:])[-4000:]
        if CONNECT_BACK_FAILURE in str(error):
            detail = f" ({CONNECT_BACK_CAUSE}){detail}"
    return HarnessError(f"the {side.engine} query {what}{detail}")


def _process_all(side: Side) -> None:
    """``processAllAvailable()`` with a deadline (it blocks in the JVM; a hung side fails the run)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            side.query.processAllAvailable()
        except BaseException as error:  # the query failed: reported below
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(ROUND_DEADLINE_S)
    if thread.is_alive():
        raise HarnessError(f"the {side.engine} query's processAllAvailable() did not return in {ROUND_DEADLINE_S} s")
    if errors:
        raise _failure(side, "failed")


def _log_offset(offset: Any) -> int:
    """The file source's log offset in a progress event; -1 before the first file (the event says
    "None")."""
    try:
        value = json.loads(offset) if isinstance(offset, str) else offset
    except ValueError:
        return -1
    return int(value["logOffset"]) if isinstance(value, dict) else -1


@dataclass(frozen=True)
class _Batch:
    """What a progress event says of one completed batch."""

    batch_id: int
    started_ms: int  # the trigger's timestamp
    start_log: int  # the file source's offsets: -1 before the first file
    end_log: int


class ProgressLog:
    """Every completed batch of every query, from a StreamingQueryListener (a query's own
    ``recentProgress`` keeps only the last 100, fewer than a continuously running query makes
    while the other side works), with a condition to wait on."""

    def __init__(self) -> None:
        from pyspark.sql.streaming.listener import StreamingQueryListener

        self.changed = threading.Condition()
        self.batches: dict[str, list[_Batch]] = {}
        log = self

        class _Listener(StreamingQueryListener):
            def onQueryStarted(self, event: Any) -> None:
                return None

            def onQueryProgress(self, event: Any) -> None:
                progress = event.progress
                stamp = datetime.datetime.fromisoformat(str(progress.timestamp).replace("Z", "+00:00"))
                source = progress.sources[0]
                batch = _Batch(int(progress.batchId), int(stamp.timestamp() * 1000),
                               _log_offset(source.startOffset), _log_offset(source.endOffset))  # fmt: skip
                with log.changed:
                    log.batches.setdefault(str(progress.id), []).append(batch)
                    log.changed.notify_all()

            def onQueryIdle(self, event: Any) -> None:
                return None

            def onQueryTerminated(self, event: Any) -> None:
                with log.changed:
                    log.changed.notify_all()

        self.listener = _Listener()

    def wait_settled(self, side: Side, round_index: int, after_ms: int, settle: int) -> int:
        """Wait until a batch of ``side``'s query that started after ``after_ms`` and lies at least
        ``settle`` batches after the one that read round ``round_index``'s file has completed;
        returns the first such batch's id."""
        deadline = time.monotonic() + ROUND_DEADLINE_S
        query_id = str(side.query.id)
        with self.changed:
            while True:
                batches = sorted(self.batches.get(query_id, []), key=lambda b: b.batch_id)
                consumed = next((b.batch_id for b in batches if b.end_log == round_index > b.start_log), None)
                if consumed is not None:
                    for batch in batches:
                        if batch.batch_id >= consumed + settle and batch.started_ms > after_ms:
                            return batch.batch_id
                if not side.query.isActive:
                    raise _failure(side, "stopped")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HarnessError(f"the {side.engine} query did not settle round {round_index} in "
                                       f"{ROUND_DEADLINE_S} s")  # fmt: skip
                self.changed.wait(min(left, _LIVENESS_S))  # woken by each progress event


def run_scenario(spark: Any, scenario: Scenario, engines: tuple[str, str] = ("ours", "spark")) -> Outcome:
    """Run ``scenario`` on both engines (the first waited for first in each round); the session
    confs the scenario sets (no-data batches, time zone, chunk sizes) are restored after."""
    from backend.spark import driver

    confs = {"spark.sql.streaming.noDataMicroBatches.enabled": str(scenario.no_data).lower()}
    if scenario.time_zone is not None:
        confs["spark.sql.session.timeZone"] = scenario.time_zone
    if scenario.max_records is not None:
        confs[ARROW_BATCH_CONF] = str(scenario.max_records)
    saved = {name: spark.conf.get(name, None) for name in confs}  # None: not set
    from backend.spark.connect import is_connect

    sides = [Side(engine, engine == "spark" and scenario.runs_continuously) for engine in engines]
    progress = ProgressLog()
    # only a side Spark runs continuously is followed by progress events; pyspark's Connect client
    # can deadlock removing a listener while an event is delivered, and stops delivering them once
    # a query with a Python data source reports its accumulators: not on Connect
    listening = any(side.continuous for side in sides)
    if listening and is_connect(spark):
        raise HarnessError(f"a side Spark runs continuously is not followed on a Connect session: {scenario!r}")
    if listening:
        spark.streams.addListener(progress.listener)
    driver.forget_all()
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        root = Path(tmp)
        source = root / "in"
        source.mkdir()
        for name, value in confs.items():
            spark.conf.set(name, value)

        def start_all(parallelism: int) -> None:
            for index, side in enumerate(sides):
                work = root / f"side{index}"
                df = _dataframe(spark, scenario, side.engine, source, work, parallelism)
                _start(side, df, scenario, work / "checkpoint")

        try:
            start_all(scenario.parallelism)
            for index, round_ in enumerate(scenario.rounds):
                publish(source / f"{index:04d}.json", round_.text())
                after = _now_ms()
                for side in sides:
                    if side.continuous:
                        side.bounds.append(progress.wait_settled(side, index, after, scenario.settle_batches))
                    else:
                        _process_all(side)
                        side.read_batches()
                        side.bounds.append(max(side.batches, default=-1))
                    after = _now_ms()
                let_time_pass(round_.pause_ms)
                if round_.restart is not None:  # both queries stop and start again from their checkpoints
                    for side in sides:
                        side.query.stop()
                    driver.forget_all()  # as after a driver restart: our coordinators recover too
                    start_all(round_.restart)  # the drop-in rescales its state to this parallelism
        except HarnessError as error:
            raise HarnessError(f"{error}\nscenario: {scenario!r}") from None
        finally:
            for side in sides:
                if side.query is not None:
                    side.query.stop()
            for name, old in saved.items():
                if old is None:
                    spark.conf.unset(name)
                else:
                    spark.conf.set(name, old)
            if listening:
                spark.streams.removeListener(progress.listener)
            driver.forget_all()
            for side in sides:
                side.read_batches()
    return Outcome(scenario, sides)
