"""The errors the PySpark drop-in adds to the project's hierarchy (root ``dstl.errors.ChangelogError``).

Only what is Spark's own lives here: a handle call that Spark's phases or time modes forbid, and a
schema the adapter cannot store. Everything else the drop-in raises (checkpoints, restores,
serialization) is the backend's error from ``backend.core.errors``. Each keeps a builtin base
(``RuntimeError``, ``ValueError`` via ``ConfigurationError``) so that code catching what pyspark
raises in the same situation still catches it.
"""

from __future__ import annotations

from backend.core.errors import ChangelogError, ConfigurationError

__all__ = ["StateOperationError", "UnsupportedSchemaError"]


class StateOperationError(ChangelogError, RuntimeError):
    """A handle operation that the current phase or time mode does not allow (Spark: a JVM error
    surfacing as PySparkRuntimeError)."""


class UnsupportedSchemaError(ConfigurationError):
    """A Spark schema (or DDL string) this adapter cannot store; names the field."""
