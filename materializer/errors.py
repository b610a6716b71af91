"""The errors the materializer raises, under the project's one hierarchy (``dstl.errors``).

``CorruptChunkError`` is a ``CorruptDataError`` (a stored chunk failed a check: the reader names
the file); ``MaterializationError`` is what ``PeriodicMaterializer.poll`` raises once more
materializations failed in a row than allowed (Flink fails the job the same way).
"""

from __future__ import annotations

from dstl.errors import ChangelogError, CorruptDataError

__all__ = ["CorruptChunkError", "MaterializationError"]


class CorruptChunkError(CorruptDataError):
    """A materialized chunk failed a check: magic, version, flags, checksum, truncation, lengths."""

    what = "materialized chunk"


class MaterializationError(ChangelogError):
    """Materialization failed more often in a row than allowed."""
