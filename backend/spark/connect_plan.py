"""A routed operator in a Spark Connect client's plan: finding it, and binding it there.

Why: on a classic driver, a routed operator learns its state directory when its query starts from
a local property the starting thread sets (its tasks) and a file on the driver's host (its tick
source) (``backend.spark.routing``). A Connect client can do neither: it sets no local property
of the server's threads and may run on another host. But its DataFrame is a tree of Python plan
objects (``pyspark.sql.connect.plan``) that becomes a protobuf plan only when the query starts
(``WriteStreamOperation.command``), so the start binds the operator in the plan itself, where the
server's processes find it without the client:

- the ``MapInPandas`` node's function (a ``PythonUDF``, pickled at the start) becomes the task of
  the bound config (``OperatorConfig.bound``: the state directory in the closure);
- the tick source's read (its format is ``ticks.tick_source_name(route)``) gets the state directory
  as the read option ``ticks.JOB_DIR_OPTION``, which the source's reader takes over its route file.

**A ``foreachBatch`` function** runs in a Python process of the server and evaluates the batch
through a Connect request of its own, outside the query's thread: its jobs carry none of the
query's local properties, so the drop-in's tasks would not know their batch. The hooked start
wraps the user's function (``ForeachBatch``) before the writer's request is sent: before each call
it sets the batch id and the query id (read once from ``<checkpointLocation>/metadata``, which
Spark writes as it creates the query) as confs of the batch's session, a clone per query, which
Spark propagates to the jobs the function runs as local properties
(``SQLExecution.withSQLConfPropagated``); the tasks read them there
(``config.FOREACH_BATCH_ID``). A drop-in operator that is not routed is found by its function's
name (``plan.DROP_IN_TASK``).

The nodes are changed in place: a routed DataFrame runs in one query at a time (``routing``), and
the next start of it binds them again. The walk also finds what the classic one finds in the
analyzed plan: the operators of this driver in the plan (by their function's name) and whether one
feeds a union other than as its first input (a union renumbers the partitions of the others).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from backend.spark.config import FOREACH_BATCH_ID, FOREACH_QUERY_ID
from backend.spark.plan import DROP_IN_TASK, routed_task_name
from backend.spark.ticks import JOB_DIR_OPTION, tick_source_name
from dstl import ChangelogConfig

__all__ = ["ForeachBatch", "bind_in_plan", "holds_drop_in", "routed_routes"]

_TASK_PREFIX = routed_task_name("")


def _children(node: Any) -> Iterator[tuple[str, Any]]:
    """(attribute, child plan) of a Connect plan node: its input, a union's or join's other side,
    the plans of a ``withRelations`` (any attribute holding a plan or a list of plans)."""
    from pyspark.sql.connect.plan import LogicalPlan

    for name, value in vars(node).items():
        if isinstance(value, LogicalPlan):
            yield name, value
        elif isinstance(value, list | tuple):
            yield from ((name, v) for v in value if isinstance(v, LogicalPlan))


def _walk(plan: Any) -> Iterator[tuple[Any, bool]]:
    """Every node of ``plan`` once, with whether a union renumbers its partitions on the way up."""
    seen: set[int] = set()
    pending = [(plan, False)]
    while pending:
        node, renumbered = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node, renumbered
        union = type(node).__name__ == "SetOperation" and getattr(node, "set_op", None) == "union"
        pending.extend((child, renumbered or (union and name != "_child")) for name, child in _children(node))


def _routed_function(node: Any) -> tuple[str, Any] | None:
    """(route, the ``PythonUDF``) of a routed operator's ``MapInPandas`` node, else None."""
    if type(node).__name__ != "MapPartitions":
        return None
    function: Any = getattr(node, "_function", None)
    name = str(getattr(function, "_function_name", ""))
    if not name.startswith(_TASK_PREFIX):
        return None
    return name[len(_TASK_PREFIX) :], function._function


def routed_routes(plan: Any) -> list[tuple[str, bool]]:
    """(route, renumbered by a union) of each routed operator in a Connect plan, in plan order."""
    found: dict[str, bool] = {}
    for node, renumbered in _walk(plan):
        routed = _routed_function(node)
        if routed is not None:
            found[routed[0]] = found.get(routed[0], False) or renumbered
    return list(found.items())


def bind_in_plan(plan: Any, tasks: dict[str, Callable[..., Any]], job_dirs: dict[str, str]) -> None:
    """Put each route's bound task (``tasks``) into its ``MapInPandas`` node and its state
    directory (``job_dirs``) into its tick source's read options."""
    ticks = {tick_source_name(route): route for route in job_dirs}
    for node, _ in _walk(plan):
        routed = _routed_function(node)
        if routed is not None and routed[0] in tasks:
            routed[1]._func = tasks[routed[0]]
        elif type(node).__name__ == "DataSource" and getattr(node, "_format", None) in ticks:
            route = ticks[node._format]
            node._options = {**(node._options or {}), JOB_DIR_OPTION: job_dirs[route]}


def holds_drop_in(plan: Any) -> bool:
    """Whether a Connect plan runs an operator of the drop-in (routed or not)."""
    for node, _ in _walk(plan):
        if type(node).__name__ == "MapPartitions":
            name = str(getattr(getattr(node, "_function", None), "_function_name", ""))
            if name == DROP_IN_TASK or name.startswith(_TASK_PREFIX):
                return True
    return False


class ForeachBatch:
    """A user's ``foreachBatch`` function on a Connect session, with the batch's identity set for
    the drop-in's tasks while it runs (module docstring). Pickled with the writer's request: it
    holds the function, the query's checkpoint location and how to read it."""

    def __init__(
        self,
        func: Callable[[Any, int], Any],
        location: str,
        changelog: ChangelogConfig,
        reads: tuple[str | None] | None = None,
    ) -> None:
        """``reads``: ``(checkpoint_root,)`` when ``use_for_session`` routes the query: the function's
        reads of Spark's state sources are routed too (``routed_reads.routing_in_foreach_batch``)."""
        self.func, self.location, self.changelog, self.reads = func, location, changelog, reads
        self.query_id: str | None = None

    def __call__(self, batch_df: Any, batch_id: int) -> Any:
        from backend.spark.routed_reads import routing_in_foreach_batch

        conf = batch_df.sparkSession.conf
        conf.set(FOREACH_BATCH_ID, str(batch_id))
        conf.set(FOREACH_QUERY_ID, self._query())
        try:
            if self.reads is None:
                return self.func(batch_df, batch_id)
            with routing_in_foreach_batch(self.reads[0], batch_id, self.location):
                return self.func(batch_df, batch_id)
        finally:
            conf.unset(FOREACH_BATCH_ID)
            conf.unset(FOREACH_QUERY_ID)

    def _query(self) -> str:
        """The query's id, from the metadata file Spark keeps in its checkpoint location."""
        if self.query_id is None:
            import json
            from dataclasses import replace

            from dstl import StateChangelogStorage

            storage = StateChangelogStorage(replace(self.changelog, base_path=self.location), owns_files=False)
            try:
                first = storage.files.get("metadata").decode().splitlines()[0]
                self.query_id = str(json.loads(first)["id"])
            except (FileNotFoundError, IndexError, KeyError, ValueError) as exc:
                raise RuntimeError(
                    f"{self.location}/metadata does not name the streaming query ({exc!r}): the drop-in's tasks of "
                    "this foreachBatch query cannot be given their query"
                ) from None
            finally:
                storage.close()
        return self.query_id
