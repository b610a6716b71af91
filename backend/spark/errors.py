"""The errors the PySpark drop-in adds to the project's hierarchy (root ``dstl.errors.ChangelogError``).

Only what is Spark's own lives here: a handle call that Spark's phases or time modes forbid, a
schema the adapter cannot store, and a state value whose type does not fit its schema where the
user asked for strict types. Everything else the drop-in raises (checkpoints, restores,
serialization) is the backend's error from ``backend.core.errors``. Each keeps a builtin base
(``RuntimeError``, ``ValueError`` via ``ConfigurationError``) so that code catching what pyspark
raises in the same situation still catches it.
"""

from __future__ import annotations

from typing import Any

from backend.core.errors import ChangelogError, ConfigurationError, SerializationError

__all__ = ["StateOperationError", "StateValueError", "UnsupportedSchemaError"]


class StateOperationError(ChangelogError, RuntimeError):
    """A handle operation that the current phase or time mode does not allow (Spark: a JVM error
    surfacing as PySparkRuntimeError)."""


class UnsupportedSchemaError(ConfigurationError):
    """A Spark schema (or DDL string) this adapter cannot store; names the field."""


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
