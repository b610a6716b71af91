"""Spark's ``GroupState`` for ``applyInPandasWithState``: pyspark's own class, built by the runner.

The object lives for one call of the user's function: the runner (``backend.spark.apply_in_pandas``)
builds it from the stored (timeout, value) pair and reads back what the function did with it
(updated, removed, the new timeout) from the fields pyspark's own serializer reads (``json()``).

``GroupState`` here is a subclass of ``pyspark.sql.streaming.state.GroupState`` that only adds a
keyword constructor: every method is pyspark's, so ``isinstance(state, GroupState)`` holds for
pyspark's class (Spark's own tests check it) and the semantics and errors (pyspark's error classes)
are pyspark's. It is built on first use (PEP 562), so that importing this module never imports
pyspark; ``GroupStateTimeout`` holds the same strings as pyspark's.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

__all__ = ["GroupState", "GroupStateTimeout", "check_timeout_conf", "timeout_of"]


class GroupStateTimeout:
    """pyspark.sql.streaming.state.GroupStateTimeout's values."""

    NoTimeout = "NoTimeout"
    ProcessingTimeTimeout = "ProcessingTimeTimeout"
    EventTimeTimeout = "EventTimeTimeout"


_TIMEOUT_CONFS = (
    GroupStateTimeout.NoTimeout,
    GroupStateTimeout.ProcessingTimeTimeout,
    GroupStateTimeout.EventTimeTimeout,
)

#: pyspark's "no timestamp" (``GroupState.NO_TIMESTAMP``)
NO_TIMESTAMP = -1


def check_timeout_conf(timeout_conf: str) -> None:
    """Refuse a timeout configuration that is not one of ``GroupStateTimeout``'s values."""
    if timeout_conf not in _TIMEOUT_CONFS:
        raise ValueError(f"unknown timeout configuration {timeout_conf!r}")


class _KeywordConstructor:
    """The constructor the runner uses; everything else is pyspark's ``GroupState``."""

    def __init__(
        self,
        value: tuple[Any, ...] | None,
        *,
        batch_processing_time_ms: int,
        event_time_watermark_ms: int,
        timeout_conf: str,
        has_timed_out: bool,
        watermark_present: bool,
        old_timeout_timestamp: int = NO_TIMESTAMP,
    ) -> None:
        """The state of one call: ``value`` (a tuple in schema order, None when there is none);
        the timeout starts unset in every call (the function sets it again or it is cleared), and
        ``oldTimeoutTimestamp`` is what the JVM reported (pyspark reports the old one as unset)."""
        from pyspark.sql import Row

        check_timeout_conf(timeout_conf)
        super().__init__(  # type: ignore[call-arg]
            optionalValue=None if value is None else Row(*value), batchProcessingTimeMs=batch_processing_time_ms,
            eventTimeWatermarkMs=event_time_watermark_ms, timeoutConf=timeout_conf, hasTimedOut=has_timed_out,
            watermarkPresent=watermark_present, defined=value is not None, updated=False, removed=False,
            timeoutTimestamp=NO_TIMESTAMP, keyAsUnsafe=b"", valueSchema=None,
        )  # fmt: skip
        self._old_timeout_timestamp = old_timeout_timestamp


def timeout_of(state: Any) -> int:
    """The timeout a call left (``NO_TIMESTAMP``: none); pyspark keeps a datetime's as float ms."""
    return int(state._timeout_timestamp)


@functools.cache
def _group_state_class() -> type[Any]:
    from pyspark.sql.streaming import state

    names = {"__module__": __name__, "__qualname__": "GroupState", "__doc__": state.GroupState.__doc__}
    return type("GroupState", (_KeywordConstructor, state.GroupState), names)


if TYPE_CHECKING:
    from pyspark.sql.streaming.state import GroupState as _SparkGroupState

    class GroupState(_KeywordConstructor, _SparkGroupState): ...


def __getattr__(name: str) -> Any:
    """``GroupState``: pyspark's class with the runner's constructor, built when first asked for."""
    if name == "GroupState":
        return _group_state_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
