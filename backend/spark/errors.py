"""The errors the PySpark drop-in adds to the project's hierarchy (root ``dstl.errors.ChangelogError``).

Only what is Spark's own lives here: a handle call that Spark's phases or time modes forbid, a
schema the adapter cannot store, a state value whose type does not fit its schema where the
user asked for strict types, and a read of the state data source it cannot serve. Everything
else the drop-in raises (checkpoints, restores, serialization) is the backend's error from
``backend.core.errors``. Each keeps a builtin base
(``RuntimeError``, ``ValueError`` via ``ConfigurationError``) so that code catching what pyspark
raises in the same situation still catches it.
"""

from __future__ import annotations

from typing import Any

from backend.core.errors import (
    ChangelogError,
    ConfigurationError,
    SchemaEvolutionError,
    SerializationError,
    StateRestoreError,
)

__all__ = [
    "GroupingKeyChangedError",
    "StateOperationError",
    "StateSourceError",
    "StateValueError",
    "UnsupportedSchemaError",
]


class StateOperationError(ChangelogError, RuntimeError):
    """A handle operation that the current phase or time mode does not allow (Spark: a JVM error
    surfacing as PySparkRuntimeError)."""


class GroupingKeyChangedError(SchemaEvolutionError):
    """A query restarted with a grouping column of another Spark type than its checkpoint's: a
    key's key group is Spark's hash of the typed column (an int and a long hash apart), so the
    old state would silently not be found. Spark refuses the change too
    (``STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE``). Names the operator, the column and both types."""

    def __init__(self, operator: str, columns: str, old: str, new: str) -> None:
        StateRestoreError.__init__(
            self,
            f"operator {operator!r}: grouping columns {columns} were checkpointed as {old} and are now {new}: a "
            "key's key group follows its Spark type, so the state of the old keys would not be found (Spark "
            "refuses the change too); cast the column back to its old type, or start from a new checkpoint",
        )
        self.state, self.field, self.old, self.new = "", columns, old, new


class UnsupportedSchemaError(ConfigurationError):
    """A Spark schema (or DDL string) this adapter cannot store; names the field."""


class StateSourceError(ConfigurationError):
    """A read of the state data source (``backend.spark.state_source``) that cannot be served: an
    option Spark's state source would refuse (with Spark's error class first in the message,
    ``STDS_...``), a path that is not a checkpoint location, an unknown operator, state or batch,
    a batch whose checkpoint is not retained; or a write (bootstrap, ``backend.spark.state_writer``)
    it refuses: columns that are not a state's, a schema that does not match, rows a state cannot
    hold, a target that is not a savepoint. Names the option, path, operator, state, field or key."""


class StateValueError(SerializationError, TypeError):
    """A state value whose Python type does not fit the state's schema, raised instead of Spark's
    lenient conversion when ``strict_types`` is on; names the state, the field (empty: the whole
    value), the expected Spark type and the Python type given. A ``TypeError`` too, as Python's
    own type errors are."""

    def __init__(self, state: str, field: str, expected: str, value: Any) -> None:
        self.state, self.field, self.expected = state, field, expected
        self.value_type = type(value).__name__
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        where = f"state {state!r}" + (f" field {field!r}" if field else "")
        super().__init__(f"{where}: expected {expected}, got {self.value_type} {shown}")
