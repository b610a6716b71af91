"""``MaterializationOptions``: when and how a ``PeriodicMaterializer`` snapshots its backend's tables.

Why one frozen class: the standalone job (``backend.job.JobOptions.materialization``),
the Spark operator (``backend.spark.config.OperatorConfig.materialization``) and a bare
``PeriodicMaterializer`` take the same settings, so their defaults (Flink's 10 minutes, a 64 MiB
size trigger, 16 MiB chunk files) and their checks live here once. A value out of range raises
``ConfigurationError`` (a ``ValueError``) naming the field when the options are made, before any
materializer runs. It holds only plain values: Spark ships it, pickled, to every task.
"""

from __future__ import annotations

from dataclasses import dataclass

from dstl.errors import ConfigurationError

__all__ = ["MaterializationOptions"]


@dataclass(frozen=True)
class MaterializationOptions:
    """When each subtask's ``PeriodicMaterializer`` snapshots its tables (Flink's
    ``state.backend.changelog.periodic-materialize.interval`` and friends)."""

    #: time between materializations, milliseconds (the first one jittered to 50-100% of it)
    interval_ms: int = 600_000
    #: also materialize once the log since the last materialization holds this many bytes (None: never)
    size_trigger_bytes: int | None = 64 << 20
    #: key groups per chunk (aligned to multiples of it, so subtasks of any parallelism share chunks)
    chunk_key_groups: int = 1
    #: the largest file of chunks one materialization writes (its chunks are packed back to back;
    #: under Spark, the chunks left below it share one file with the other materializations the
    #: task started)
    pack_bytes: int = 16 << 20
    #: consecutive failed materializations tolerated before ``poll()`` raises ``MaterializationError``
    max_failures_allowed: int = 3
    #: zstd level of the chunks
    compression_level: int = 1

    def __post_init__(self) -> None:
        if self.interval_ms <= 0:
            raise ConfigurationError(f"interval_ms must be positive, got {self.interval_ms}")
        if self.size_trigger_bytes is not None and self.size_trigger_bytes <= 0:
            raise ConfigurationError(f"size_trigger_bytes must be positive or None, got {self.size_trigger_bytes}")
        if self.chunk_key_groups < 1:
            raise ConfigurationError(f"chunk_key_groups must be >= 1, got {self.chunk_key_groups}")
        if self.pack_bytes < 1:
            raise ConfigurationError(f"pack_bytes must be >= 1, got {self.pack_bytes}")
        if self.max_failures_allowed < 0:
            raise ConfigurationError(f"max_failures_allowed must be >= 0, got {self.max_failures_allowed}")
