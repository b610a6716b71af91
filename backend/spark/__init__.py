"""Run unchanged PySpark stateful processors on ``ChangelogKeyedStateBackend`` (docs/architecture.md).

The public entry points are in ``backend.spark.api`` (Spark's stateful operators with this
backend's checkpoints). Underneath, by layer:

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
    from backend.spark.apply_in_pandas import run_apply_in_pandas_with_state
    from backend.spark.codecs import serializer_for_schema
    from backend.spark.errors import StateOperationError, UnsupportedSchemaError
    from backend.spark.group_state import GroupState, GroupStateTimeout
    from backend.spark.handle import SparkStateHandle
    from backend.spark.schema import parse_schema
    from backend.spark.transform import run_transform_with_state

__all__ = [
    "GroupState",
    "GroupStateTimeout",
    "SparkStateHandle",
    "StateOperationError",
    "UnsupportedSchemaError",
    "parse_schema",
    "run_apply_in_pandas_with_state",
    "run_transform_with_state",
    "serializer_for_schema",
]

_WHERE = {
    "GroupState": "backend.spark.group_state",
    "GroupStateTimeout": "backend.spark.group_state",
    "SparkStateHandle": "backend.spark.handle",
    "StateOperationError": "backend.spark.errors",
    "UnsupportedSchemaError": "backend.spark.errors",
    "parse_schema": "backend.spark.schema",
    "run_apply_in_pandas_with_state": "backend.spark.apply_in_pandas",
    "run_transform_with_state": "backend.spark.transform",
    "serializer_for_schema": "backend.spark.codecs",
}


def __getattr__(name: str) -> Any:
    """Lazy re-exports (PEP 562): ``from backend.spark import run_transform_with_state`` works
    without importing the runner (and pandas) when only the handle is needed."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'backend.spark' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
