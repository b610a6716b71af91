"""Run unchanged PySpark stateful processors on ``ChangelogKeyedStateBackend`` (docs/architecture.md).

What users call is exported here (``__all__``), from ``backend.spark.api``: Spark's stateful
operators with this backend's checkpoints (``transform_with_state_in_pandas``,
``transform_with_state``, ``apply_in_pandas_with_state``), ``use_for_session``, which routes
``GroupedData``'s own methods here, and ``register_state_source``, which lets ``spark.read`` read
the checkpoints' state (and ``df.write`` write a savepoint's); with the two errors that are
Spark's own, which a user may catch.
Everything else is an internal of its module, imported from there. Underneath, by layer:

- inside one partition of one micro-batch, with no SparkSession: ``handle`` implements Spark's
  ``StatefulProcessorHandle`` (value, list and map state with TTL, timers, ``deleteIfExists``)
  over the keyed backend; ``schema`` parses Spark schemas and ``codecs`` maps them onto the
  backend's serializers; ``keys`` turns grouping keys into backend keys; ``transform`` drives a
  ``StatefulProcessor`` (pandas or Row API) and ``apply_in_pandas`` an ``applyInPandasWithState``
  function (with ``group_state``'s ``GroupState``) over a partition's rows (``batch``) the way
  Spark's Python worker does;
- the Spark plumbing: ``plan`` builds the streaming DataFrame (repartitioning by key group),
  ``tasks`` runs one subtask of one micro-batch, ``driver`` completes checkpoints on the driver,
  ``initial`` carries the initial state, ``routing`` routes ``GroupedData``'s own methods here
  (``use_for_session``) and binds each routed operator's state to the query that starts it;
- reading state back: ``state_source`` is the data source (``format("dstl-state")``), planned on
  the driver by ``state_plan`` (with ``state_options`` and ``state_columns``) and read on the
  executors by ``state_scan``;
- writing state (bootstrap): the same data source's writer, ``state_writer``, checks a write on
  the driver; ``bootstrap_chunks`` turns a task's rows into chunks, each key in the key group
  ``spark_hash`` computes as Spark's ``hash`` does; ``bootstrap`` commits the savepoint and starts
  an operator from one (``restore_from``);
- ``errors`` holds the two errors that are Spark's own; ``session`` and ``demo`` are for running it
  locally.

Nothing here imports pyspark at import time: the plumbing imports this package on the driver and
in every Python worker, and pyspark's own classes (``Row``, ``TimerValues``, and those the handle,
the state objects and ``GroupState`` subclass, built on first use) are only needed once a processor
runs, where pyspark is already loaded (``tests/backend/spark/test_pyspark_objects.py`` checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backend.spark.api import (
        apply_in_pandas_with_state,
        register_state_source,
        transform_with_state,
        transform_with_state_in_pandas,
        use_for_session,
    )
    from backend.spark.errors import StateOperationError, UnsupportedSchemaError

__all__ = [
    "StateOperationError",
    "UnsupportedSchemaError",
    "apply_in_pandas_with_state",
    "register_state_source",
    "transform_with_state",
    "transform_with_state_in_pandas",
    "use_for_session",
]

_WHERE = {
    "StateOperationError": "backend.spark.errors",
    "UnsupportedSchemaError": "backend.spark.errors",
    "apply_in_pandas_with_state": "backend.spark.api",
    "register_state_source": "backend.spark.api",
    "transform_with_state": "backend.spark.api",
    "transform_with_state_in_pandas": "backend.spark.api",
    "use_for_session": "backend.spark.api",
}


def __getattr__(name: str) -> Any:
    """Lazy re-exports (PEP 562): ``import backend.spark`` (which every Python worker does) does
    not import the entry points' modules (and pandas) until one is used."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'backend.spark' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
