"""The state data source: a checkpoint's state, its change feed and its metadata as DataFrames.

``spark.read.format("dstl-state").option("stateVarName", "counts").load(checkpoint_location)``
reads the state of the drop-in's checkpoints with the options and columns of Spark's own
``statestore`` source (``state_options``, ``state_columns``), and
``spark.read.format("dstl-state-metadata").load(checkpoint_location)`` lists the operators, their
states and retained batches after Spark's ``state-metadata``. Both are pyspark Python data sources
(``pyspark.sql.datasource``), registered on a session by ``register`` (``backend.spark.api``:
``register_state_source(spark)``, and ``use_for_session``).

Where each part runs: ``schema()`` and the reader's ``partitions()`` run on the driver's side and
read ``_metadata`` files only (``state_plan``); each partition's ``read`` runs in a Python worker
of an executor and reads its key groups' chunk ranges and log segments (``state_scan``), so a
large state is read by every executor. A read never writes: the storages it opens never delete,
nothing is put, and the checkpoints' own recovery (which cleans up) is not run. An option, a path,
an operator, a state or a batch the source cannot serve raises ``StateSourceError`` naming it,
before any partition runs.

The same ``format("dstl-state")`` writes: ``df.write.format("dstl-state")...save(savepoint)`` turns a
DataFrame of one state, in the columns a read gives, into a savepoint a query starts from
(``DataSource.writer``: ``backend.spark.state_writer``, ``backend.spark.bootstrap``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceWriter, InputPartition

from backend.spark.errors import StateSourceError
from backend.spark.state_columns import GROUPING
from backend.spark.state_metadata import recorded_operator, spark_columns
from backend.spark.state_options import SourceOptions, parse_options
from backend.spark.state_plan import (
    ChangePart,
    ScanPlan,
    StatePart,
    completed_checkpoints,
    grouping_key,
    locate,
    open_storage,
    plan_read,
    read_checkpoint,
    states_of,
)
from backend.spark.state_scan import arrow_batches, scan_changes, scan_state

__all__ = ["METADATA_FORMAT", "STATE_FORMAT", "StateDataSource", "StateMetadataDataSource", "register"]

STATE_FORMAT = "dstl-state"
METADATA_FORMAT = "dstl-state-metadata"
#: Spark's ``state-metadata`` columns, then ours
METADATA_COLUMNS = (
    "operatorId bigint, operatorName string, stateStoreName string, numPartitions int, minBatchId bigint, "
    "maxBatchId bigint, operatorProperties string, operatorUid string, maxParallelism int, "
    "retainedBatchIds array<bigint>, keySchema string, states array<struct<name: string, kind: string, "
    "ttlDurationMs: bigint, valueSchema: string, userKeySchema: string>>"
)


class StateDataSource(DataSource):
    """``format("dstl-state")``: the state of one state variable (or the timers) of one operator at
    one retained checkpoint, or the change feed between two (module docstring); written, one state
    of a savepoint."""

    @classmethod
    def name(cls) -> str:
        return STATE_FORMAT

    def _planned(self) -> tuple[ScanPlan, Sequence[StatePart] | Sequence[ChangePart]]:
        planned: tuple[ScanPlan, Sequence[StatePart] | Sequence[ChangePart]] | None = getattr(self, "_plan", None)
        if planned is None:
            planned = self._plan = plan_read(parse_options(self.options))
        return planned

    def schema(self) -> str:
        return self._planned()[0].columns.ddl()

    def reader(self, schema: Any) -> DataSourceReader:
        plan, parts = self._planned()
        return _StateReader(plan, parts, schema)

    def writer(self, schema: Any, overwrite: bool) -> DataSourceWriter:
        """A bootstrap write of one state into a savepoint (``backend.spark.state_writer``)."""
        from backend.spark.state_writer import StateWriter, plan_write

        return StateWriter(plan_write(self.options, schema, overwrite))


class _StateReader(DataSourceReader):
    """One partition per key-group range; each restores and reads only its own key groups. Its rows
    go to Spark as Arrow batches of the read's ``schema`` where they can (``state_scan.arrow_batches``)."""

    def __init__(self, plan: ScanPlan, parts: Sequence[StatePart] | Sequence[ChangePart], schema: Any) -> None:
        self.plan, self.parts, self.schema = plan, list(parts), schema

    def partitions(self) -> Sequence[InputPartition]:
        return [InputPartition(part) for part in self.parts]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        part = partition.value
        rows = scan_changes(self.plan, part) if isinstance(part, ChangePart) else scan_state(self.plan, part)
        return arrow_batches(rows, self.schema)


class StateMetadataDataSource(DataSource):
    """``format("dstl-state-metadata")``: a row per operator at the path, after Spark's
    ``state-metadata`` (``operatorId, operatorName, stateStoreName, numPartitions, minBatchId,
    maxBatchId, operatorProperties``), then ours: the uid, the max parallelism, every retained
    batch id, the grouping key's schema and each state's kind, TTL and declared schemas."""

    @classmethod
    def name(cls) -> str:
        return METADATA_FORMAT

    def schema(self) -> str:
        return METADATA_COLUMNS

    def reader(self, schema: Any) -> DataSourceReader:
        return _MetadataReader(metadata_rows(parse_options(self.options)))


class _MetadataReader(DataSourceReader):
    """The rows, read on the driver's side (a few ``_metadata`` files), in one partition."""

    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows = rows

    def partitions(self) -> Sequence[InputPartition]:
        return [InputPartition(0)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        return iter(self.rows)


def metadata_rows(options: SourceOptions) -> list[tuple[Any, ...]]:
    """A row per operator at the options' path with a completed checkpoint (``METADATA_COLUMNS``)."""
    rows = []
    for op in locate(options):
        with open_storage(options.storage, op.job_dir) as storage:
            retained = completed_checkpoints(storage.files)
            if not retained:
                continue
            meta = read_checkpoint(storage.files, op.job_dir, retained[-1])
            if op.uid not in meta.operators:
                continue
            handles = meta.handles(op.uid)
            states = states_of(handles)
            try:
                key: GROUPING | None = grouping_key(storage.files, op.job_dir, op.uid)
            except StateSourceError:
                key = None
        operator_name, properties = spark_columns(recorded_operator(meta, op.uid), handles)
        described = [
            (name, str(m.get("kind")), m.get("ttl_ms") or None, *_declared(m)) for name, m in sorted(states.items())
        ]
        rows.append((
            op.place, operator_name, "default", len(handles), retained[0], retained[-1], properties, op.uid,
            handles[0].max_parallelism if handles else None, retained,
            None if key is None else ", ".join(f"`{n}` {t}" for n, t in key), described,
        ))  # fmt: skip
    return rows


def _declared(meta: dict[str, Any]) -> tuple[str | None, str | None]:
    declared = list(meta.get("declared") or ())
    return (str(declared[0]) if declared else None, str(declared[1]) if len(declared) > 1 else None)


def register(spark: Any) -> None:
    """Register ``dstl-state`` and ``dstl-state-metadata`` on ``spark`` (a SparkSession); a name
    the session has already is left as it is (Spark refuses to register a name twice)."""
    from pyspark.errors import AnalysisException

    for source in (StateDataSource, StateMetadataDataSource):
        try:
            spark.dataSource.register(source)
        except AnalysisException as exc:
            if exc.getCondition() != "DATA_SOURCE_ALREADY_EXISTS":
                raise
