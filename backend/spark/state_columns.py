"""The columns of a state as the state data source shows it: Spark's, for each kind of state.

What Spark's ``statestore`` source gives for transformWithState (observed with pyspark 4.3 on
Spark's own operator; its ``StateSchemaUtils``), and what this source gives the same way:

=================  ===========================================  ======================================
state              flattenCollectionTypes = true (default)      false
=================  ===========================================  ======================================
value              ``key, value, partition_id``                  (the same)
list               ``key, list_element, partition_id``           ``key, list_value, partition_id``
                   (a row per element)                           (``array<element>``)
map                ``key, user_map_key, user_map_value,          ``key, map_value, partition_id``
                   partition_id`` (a row per entry)              (``map<user key, value>``)
timers             ``key, expiration_timestamp_ms, partition_id`` (``readRegisteredTimers``)
=================  ===========================================  ======================================

``key`` is a struct of the grouping columns, ``user_map_key`` one of the map's user key fields, the
value a struct of the state's fields; a state with a TTL wraps each value as Spark does,
``struct<value: ..., ttlExpirationMs: bigint>``. ``applyInPandasWithState`` state (no state variable
names) is ``key, value, partition_id`` with Spark's ``value struct<groupState: <stateStructType>,
timeoutTimestamp: bigint>`` (-1: no timeout). The change feed is ``batch_id, change_type, key``,
the flattened value columns, ``partition_id``. ``partition_id`` is the key group here (Spark: the
state store partition).

Types are the Spark types the processor declared, recorded with the state (``state_schemas``:
``declared``), so a read shows the schema the query has. A writer of the same columns (bootstrap)
uses this layout in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.spark.schema import parse_schema
from backend.spark.state_schemas import type_ddl

__all__ = ["GROUPING", "StateColumns"]

#: the kinds of a state's columns: the backend's kinds of state, and the timers
KINDS = ("value", "list", "map", "timers")
#: the change types of the change feed: Spark's (``RecordType.getRecordTypeAsString``)
UPDATE, DELETE, APPEND = "update", "delete", "append"
#: the grouping key's column names and Spark types, in order
GROUPING = tuple[tuple[str, str], ...]


def _name(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


@dataclass(frozen=True)
class StateColumns:
    """The columns of one read: of a state of ``kind`` (its declared ``value_schema`` and, for a map,
    ``user_key_schema``, as DDL), keyed by ``key`` (the grouping columns), with or without a TTL."""

    kind: str
    key: GROUPING
    value_schema: str | None = None
    user_key_schema: str | None = None
    ttl: bool = False
    #: applyInPandasWithState's state: ``value`` is ``struct<groupState, timeoutTimestamp>``
    group_state: bool = False
    flatten: bool = True
    change_feed: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind of state columns {self.kind!r}")

    @property
    def key_type(self) -> str:
        return "struct<" + ", ".join(f"{_name(n)}: {t}" for n, t in self.key) + ">"

    @property
    def value_type(self) -> str:
        """A value's type: the declared struct, wrapped for a TTL or a GroupState."""
        assert self.value_schema is not None
        base = type_ddl(parse_schema(self.value_schema))
        if self.group_state:
            return f"struct<groupState: {base}, timeoutTimestamp: bigint>"
        return f"struct<value: {base}, ttlExpirationMs: bigint>" if self.ttl else base

    @property
    def user_key_type(self) -> str:
        assert self.user_key_schema is not None
        return type_ddl(parse_schema(self.user_key_schema))

    def columns(self) -> list[tuple[str, str]]:
        """(name, Spark type DDL) of each column, in order."""
        head = [("batch_id", "bigint"), ("change_type", "string")] if self.change_feed else []
        key = [("key", self.key_type)]
        flat = self.flatten or self.change_feed
        if self.kind == "timers":
            body = [("expiration_timestamp_ms", "bigint")]
        elif self.kind == "value":
            body = [("value", self.value_type)]
        elif self.kind == "list":
            body = [("list_element", self.value_type)] if flat else [("list_value", f"array<{self.value_type}>")]
        elif flat:
            body = [("user_map_key", self.user_key_type), ("user_map_value", self.value_type)]
        else:
            body = [("map_value", f"map<{self.user_key_type}, {self.value_type}>")]
        return head + key + body + [("partition_id", "int")]

    def ddl(self) -> str:
        """The schema as DDL (what the data source's ``schema()`` returns)."""
        return ", ".join(f"{_name(name)} {dtype}" for name, dtype in self.columns())
