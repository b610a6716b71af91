"""Periodic and size-triggered snapshots of the LMDB tables to the DFS; truncation of the log.

``PeriodicMaterializer`` drives one backend, as its ``MaterializationOptions`` say;
``restore(backend, handles)`` restores handles that reference materialized chunks
(``materializer.chunks`` is their file format, ``materializer.binding`` checks a chunk against the
handle entry naming it).
"""

from materializer.errors import CorruptChunkError, MaterializationError
from materializer.metrics import MaterializationMetrics
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, restore

__all__ = [
    "CorruptChunkError",
    "MaterializationError",
    "MaterializationMetrics",
    "MaterializationOptions",
    "PeriodicMaterializer",
    "restore",
]
