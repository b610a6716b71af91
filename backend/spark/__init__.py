"""Run unchanged PySpark stateful processors on ``ChangelogKeyedStateBackend`` (DESIGN.md section 7).

What runs inside one partition of one micro-batch, with no SparkSession: ``backend.spark.handle``
implements Spark's ``StatefulProcessorHandle`` (value, list and map state with TTL, timers,
``deleteIfExists``) over the keyed backend, and maps Spark schemas onto its serializers;
``backend.spark.runner`` drives a ``StatefulProcessor`` (pandas or Row API) or an
``applyInPandasWithState`` function over a partition's rows the way Spark's Python worker does.
The Spark plumbing (repartitioning by key group, checkpoints on the driver) lives elsewhere.

Nothing here imports pyspark at import time: the plumbing imports this package on the driver and
in every Python worker, and pyspark's own classes (``Row``, ``TimerValues``) are only needed once a
processor runs, where pyspark is already loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backend.spark.handle import SparkStateHandle, parse_schema, serializer_for_schema
    from backend.spark.runner import GroupState, run_apply_in_pandas_with_state, run_transform_with_state

__all__ = [
    "GroupState",
    "SparkStateHandle",
    "parse_schema",
    "run_apply_in_pandas_with_state",
    "run_transform_with_state",
    "serializer_for_schema",
]

_WHERE = {
    "SparkStateHandle": "backend.spark.handle",
    "parse_schema": "backend.spark.handle",
    "serializer_for_schema": "backend.spark.handle",
    "GroupState": "backend.spark.runner",
    "run_apply_in_pandas_with_state": "backend.spark.runner",
    "run_transform_with_state": "backend.spark.runner",
}


def __getattr__(name: str) -> Any:
    """Lazy re-exports (PEP 562): ``from backend.spark import run_transform_with_state`` works
    without importing the runner (and pandas) when only the handle is needed."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'backend.spark' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
