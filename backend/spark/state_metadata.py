"""Spark's ``state-metadata`` columns for an operator of the drop-in: ``operatorName`` and
``operatorProperties`` as Spark's ``StateMetadataSource`` gives them for the operator the drop-in
stands in for, so that code reading Spark's metadata reads ours the same way.

Spark's shapes (its ``TransformWithStateOperatorProperties``, serialized as compact JSON):

- ``operatorName``: its physical operator, ``transformWithStateInPandasExec`` (the pandas API),
  ``transformWithStateInPySparkExec`` (the Row API) or ``applyInPandasWithState``;
- ``operatorProperties`` of a transformWithState operator:
  ``{"timeMode": "NoTime" | "ProcessingTime" | "EventTime", "outputMode": "Update" | "Append",
  "stateVariables": [{"stateName", "stateVariableType", "ttlEnabled"}, ...]}`` with one entry per
  state variable (``ValueState``, ``ListState``, ``MapState``; ``ttlEnabled`` when it has a TTL)
  and, in the ProcessingTime and EventTime modes, one for the timers
  (``$procTimers_keyToTimestamp`` / ``$eventTimers_keyToTimestamp``, ``TimerState``, no TTL);
  of an applyInPandasWithState operator: null.

Spark lists the state variables the processor declares, in the order of a hash map; here they
are the states the checkpoint knows, also one ``deleteIfExists`` dropped (Spark lists one a
processor declares and deletes in ``init``), in name order, the timers last. The name and the
modes are what the driver recorded in the checkpoint (``driver.SPARK_OPERATORS``); a checkpoint
written before they were recorded gives the API's family (``transformWithState`` or
``applyInPandasWithState``) and the state variables alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from backend.checkpointing.metadata import SnapshotMetadata
from backend.core.handles import KeyedStateHandle
from backend.spark.apply_in_pandas import GROUP_STATE_NAME
from backend.spark.driver import SPARK_OPERATORS
from backend.spark.state_plan import APPLY_IN_PANDAS, SPARK_TIMER_STATES, TRANSFORM_WITH_STATE
from backend.state.restore import merge_metadata

__all__ = ["recorded_operator", "spark_columns"]

_SPARK_KINDS = {"value": "ValueState", "list": "ListState", "map": "MapState"}
#: the timers' state variable in each time mode that has timers
_TIMERS = dict(zip(("ProcessingTime", "EventTime"), SPARK_TIMER_STATES, strict=True))


def recorded_operator(meta: SnapshotMetadata, uid: str) -> Mapping[str, Any] | None:
    """What checkpoint ``meta`` records of operator ``uid``'s Spark operator (``config.SparkOperator``
    as a dict), or None (a checkpoint of an earlier release)."""
    recorded = meta.properties.get(SPARK_OPERATORS)
    described = recorded.get(uid) if isinstance(recorded, dict) else None
    return described if isinstance(described, dict) else None


def spark_columns(recorded: Mapping[str, Any] | None, handles: Sequence[KeyedStateHandle]) -> tuple[str, str | None]:
    """``operatorName`` and ``operatorProperties`` of the operator of ``handles`` (one checkpoint's)
    with ``recorded`` (``recorded_operator``). A state ``deleteIfExists`` dropped is listed: Spark
    lists the state variables the processor declares, also one it declares and deletes in ``init``."""
    states: dict[str, dict[str, Any]] = {}
    for handle in handles:
        merge_metadata(states, handle.states)
    group_state = GROUP_STATE_NAME in states
    family = APPLY_IN_PANDAS if group_state else TRANSFORM_WITH_STATE
    name = family if recorded is None else str(recorded.get("name"))
    if group_state:
        return name, None
    variables = [
        {"stateName": state, "stateVariableType": _SPARK_KINDS.get(str(m.get("kind")), str(m.get("kind"))),
         "ttlEnabled": bool(m.get("ttl_ms"))}
        for state, m in sorted(states.items())
    ]  # fmt: skip
    properties: dict[str, Any] = {"stateVariables": variables}
    if recorded is not None:
        time_mode = recorded.get("time_mode")
        timers = _TIMERS.get(str(time_mode))
        if timers is not None:
            variables.append({"stateName": timers, "stateVariableType": "TimerState", "ttlEnabled": False})
        properties = {"timeMode": time_mode, "outputMode": recorded.get("output_mode"), "stateVariables": variables}
    return name, json.dumps(properties, separators=(",", ":"))
