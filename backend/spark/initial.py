"""``initialState`` of ``transformWithState``: handed to the tasks of the query's first batch.

Spark joins the initial state into the first batch by key. Here the driver collects it once (a
batch DataFrame; it must fit in the driver's memory), tags every row with its key group computed
by the same Spark SQL hash as the input's, and writes it as one parquet file to the checkpoint
location; each task of batch 0 reads the file and keeps the rows of its key groups. Its keys are
checked when the operator is built; the file is written when the state directory is known (at
build with ``checkpoint_location``, when the query starts for a routed operator), only while no
checkpoint exists (the initial state only matters before the first batch commits), and is deleted
as an orphan by the next driver start.
"""

from __future__ import annotations

import io
from typing import Any

from backend.checkpointing.metadata import in_checkpoint_dir
from backend.core.errors import CheckpointError
from backend.spark.config import OperatorConfig
from backend.spark.tasks import storage_for
from dstl import ConfigurationError

_KEY_GROUP = "__dstl_key_group"


def initial_state_path(cfg: OperatorConfig) -> str:
    return f"initial/{cfg.uid}.parquet"


def initial_state_keys(grouped: Any, input_df: Any, input_keys: list[str]) -> list[str]:
    """The key columns of the initial state (a ``GroupedData``), checked against the input's when
    the operator is built: as many, of the same types (key groups are hashes of the values)."""
    from backend.spark.plan import grouping_columns

    keys = grouping_columns(grouped)
    if len(keys) != len(input_keys):
        raise ConfigurationError(f"initialState is grouped by {keys}, the input by {input_keys}: the keys must match")
    types = dict(input_df.dtypes)
    init_types = dict(grouped._df.dtypes)
    for key, input_key in zip(keys, input_keys, strict=True):
        if init_types[key] != types[input_key]:
            raise ConfigurationError(
                f"initialState key column {key!r} is {init_types[key]}, the input's {input_key!r} is "
                f"{types[input_key]}: they must have the same type (key groups are hashes of the values)"
            )
    return keys


def write_initial_state(cfg: OperatorConfig, grouped: Any, keys: list[str]) -> bool:
    """Write the initial state for the first batch once the operator's state directory is known
    (its query starts); False when the operator already has checkpoints (Spark ignores the initial
    state then too)."""
    import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]
    import pyarrow.parquet as pq  # type: ignore[import-untyped, unused-ignore]
    from pyspark.sql import functions as F

    storage = storage_for(cfg)
    if any(in_checkpoint_dir(p) for p in storage.files.list("")):
        return False
    df = grouped._df.withColumn(
        _KEY_GROUP, F.pmod(F.hash(*[F.col(k) for k in keys]), F.lit(cfg.max_parallelism)).cast("int")
    )
    table = pa.Table.from_pandas(df.toPandas(), preserve_index=False)
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    storage.files.put(initial_state_path(cfg), buffer.getvalue())
    return True


def read_initial_state(cfg: OperatorConfig, subtask: int) -> Any:
    """The rows of the initial state in ``subtask``'s key groups (a pandas DataFrame)."""
    import pyarrow.parquet as pq

    rng = cfg.key_group_range(subtask)
    try:
        data = storage_for(cfg).files.get(initial_state_path(cfg))
    except FileNotFoundError:
        raise CheckpointError(
            f"{cfg.job_dir}/{initial_state_path(cfg)} is missing: the initial state of the first batch is gone"
        ) from None
    frame = pq.read_table(io.BytesIO(data)).to_pandas()
    groups = frame[_KEY_GROUP]
    return frame[(groups >= rng.start) & (groups <= rng.end)].reset_index(drop=True)
