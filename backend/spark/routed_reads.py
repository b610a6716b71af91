"""``use_for_session``: Spark's own state sources' names reading a routed operator's state.

Spark's state sources, ``format("statestore")`` and
``format("state-metadata")``, read Spark's state store; a routed operator's state is in the drop-in's
layout, so while routing is on a read by either name whose path holds that layout
(``state_plan.drop_in_location``: the query's ``checkpointLocation`` with its ``dstl/``, or with a
``checkpoint_root`` the directory under it that location names, or an operator's own checkpoint
location) is served by this project's sources (``dstl-state``, ``dstl-state-metadata``) with the same
options; any other path goes to Spark's source unchanged. pyspark keeps a ``DataFrameReader``'s format
and options in the JVM only, so they are recorded as they are set (``format``, ``option``,
``options``), and ``load`` chooses. Spark's source reads, by default, the last batch in the query's
commit log; the driver completes a batch's checkpoint when the batch's progress event reaches its
listener, which may come later (also while the next batch runs, so inside a ``foreachBatch`` function).
Before such a read, the driver does at once what its listener will do for the batches the query has
reported (``StreamingQuery.recentProgress``) and are not yet checkpoints, so the read sees the state
of the last committed batch, as Spark's does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from backend.spark.routing import _LOCK, _OPERATORS, _operators_dir
from dstl.paths import local_path

__all__ = ["route_reads"]

#: where a DataFrameReader's format and options are recorded
_READ = "_dstl_read"
#: Spark's state sources' names (``_serve_state_read``: each is read by one of ours)
_SPARK_STATE_SOURCES = ("statestore", "state-metadata")


def route_reads(root: str | None) -> Callable[[], None]:
    """Wrap ``DataFrameReader``'s ``format``, ``option`` and ``options`` (to record them) and its
    ``load`` (to serve Spark's state sources' names from our sources on the drop-in's layout);
    returns the function that puts pyspark's methods back."""
    from pyspark.sql.readwriter import DataFrameReader

    saved = {name: DataFrameReader.__dict__[name] for name in ("format", "option", "options", "load")}
    format_, option, options, load = saved["format"], saved["option"], saved["options"], saved["load"]

    def hooked_format(self: Any, source: str) -> Any:
        self.__dict__.setdefault(_READ, {})["format"] = source
        return format_(self, source)

    def hooked_option(self: Any, key: str, value: Any) -> Any:
        _record_read(self, {key: value})
        return option(self, key, value)

    def hooked_options(self: Any, **given: Any) -> Any:
        _record_read(self, given)
        return options(self, **given)

    def hooked_load(self: Any, path: Any = None, format: Any = None, schema: Any = None, **given: Any) -> Any:
        if format is not None:
            self.format(format)
        self.options(**given)
        served = _serve_state_read(self, path, schema, root)
        return served if served is not None else load(self, path, None, schema)

    for name, hooked in (
        ("format", hooked_format), ("option", hooked_option), ("options", hooked_options), ("load", hooked_load),
    ):  # fmt: skip
        hooked.__doc__, hooked.__name__ = saved[name].__doc__, saved[name].__name__
        setattr(DataFrameReader, name, hooked)

    def restore() -> None:
        for name, method in saved.items():
            setattr(DataFrameReader, name, method)

    return restore


def _record_read(reader: Any, given: dict[str, Any]) -> None:
    """Record options as pyspark sets them: text (``to_str``), a None value not set."""
    from pyspark.sql.utils import to_str

    recorded = reader.__dict__.setdefault(_READ, {}).setdefault("options", {})
    for key, value in given.items():
        if value is not None:
            recorded[key.lower()] = to_str(value)


def _serve_state_read(reader: Any, path: Any, schema: Any, root: str | None) -> Any:
    """The DataFrame our source reads when ``reader`` names one of Spark's state sources and its
    path holds the drop-in's checkpoints (module docstring); else None."""
    recorded = reader.__dict__.get(_READ, {})
    source = str(recorded.get("format", "")).lower()
    options = dict(recorded.get("options", {}))
    location = path if isinstance(path, str) else options.get("path") if path is None else None
    if source not in _SPARK_STATE_SOURCES or not location:
        return None
    from backend.spark.state_plan import drop_in_location
    from backend.spark.state_source import METADATA_FORMAT, STATE_FORMAT, register

    candidates = [location] if root is None else [_operators_dir(root, location), location]
    directory = drop_in_location(candidates, options)
    if directory is None:
        return None
    _catch_up(directory)
    spark = reader._spark
    register(spark)  # a foreachBatch function's session may not have it yet
    options.pop("path", None)
    served = spark.read.format(STATE_FORMAT if source == "statestore" else METADATA_FORMAT).options(**options)
    if schema is not None:
        served = served.schema(schema)
    return served.load(directory)


def _catch_up(directory: str) -> None:
    """Complete the checkpoints of the batches the routed queries with operators in ``directory``
    reported and the driver's listener has not completed yet (module docstring)."""
    from backend.spark.driver import complete_committed, coordinator_at

    with _LOCK:
        ops = [
            op for op in _OPERATORS.values()
            if op.query is not None and op.job_dir and _same_directory(op.job_dir.rsplit("/", 1)[0], directory)
        ]  # fmt: skip
    for op in ops:
        coordinator = coordinator_at(str(op.job_dir))
        if coordinator is None:
            continue
        latest = coordinator.latest()
        done = -1 if latest is None else latest.checkpoint_id
        query_id = str(op.query.id)
        for batch in sorted({int(p.batchId) for p in op.query.recentProgress}):
            if batch > done:
                complete_committed(batch, query_id)


def _same_directory(a: str, b: str) -> bool:
    """Whether two spellings name one directory (a local one: the same absolute path)."""
    local_a, local_b = local_path(a), local_path(b)
    if local_a is not None and local_b is not None:
        return os.path.abspath(local_a) == os.path.abspath(local_b)
    return a.rstrip("/") == b.rstrip("/")
