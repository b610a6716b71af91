"""Spark's ``GroupState`` for ``applyInPandasWithState``, with pyspark's semantics and errors.

The object lives for one call of the user's function: the runner (``backend.spark.apply_in_pandas``)
builds it from the stored (timeout, value) pair and reads back what the function did with it
(updated, removed, the new timeout). Errors are pyspark's own classes with pyspark's error
classes, so user code that catches them keeps working.
"""

from __future__ import annotations

import datetime
from typing import Any

from backend.spark.codecs import codec_for, plain_value
from backend.spark.schema import SparkType

__all__ = ["GroupState", "GroupStateTimeout", "check_timeout_conf"]


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


def check_timeout_conf(timeout_conf: str) -> None:
    """Refuse a timeout configuration that is not one of ``GroupStateTimeout``'s values."""
    if timeout_conf not in _TIMEOUT_CONFS:
        raise ValueError(f"unknown timeout configuration {timeout_conf!r}")


#: a datetime timeout as pyspark converts it: as a TimestampType value (local time unless aware)
_TIMESTAMP = codec_for(SparkType("timestamp"), "timeout")


def _error(base: type[Exception], error_class: str, parameters: dict[str, str], message: str) -> Exception:
    """pyspark's own error (same class and errorClass as pyspark's GroupState raises), or ``base``."""
    try:
        from pyspark import errors
    except ImportError:  # pragma: no cover - pyspark is installed wherever processors run
        return base(message)
    cls = {ValueError: errors.PySparkValueError, TypeError: errors.PySparkTypeError}.get(
        base, errors.PySparkRuntimeError
    )
    return cls(errorClass=error_class, messageParameters=parameters)


class GroupState:
    """Spark's GroupState for ``applyInPandasWithState`` (pyspark/sql/streaming/state.py), with its
    semantics: ``exists``/``get``/``getOption``/``hasTimedOut`` are properties; the timeout starts
    unset in every call (set it again or it is cleared); ``get`` returns a tuple."""

    NO_TIMESTAMP: int = -1

    def __init__(
        self,
        value: tuple[Any, ...] | None,
        *,
        batch_processing_time_ms: int,
        event_time_watermark_ms: int,
        timeout_conf: str,
        has_timed_out: bool,
        watermark_present: bool,
        old_timeout_timestamp: int = -1,
    ) -> None:
        check_timeout_conf(timeout_conf)
        self._value = value
        self._defined = value is not None
        self._updated = self._removed = False
        self._batch_processing_time_ms = batch_processing_time_ms
        self._event_time_watermark_ms = event_time_watermark_ms
        self._timeout_conf = timeout_conf
        self._has_timed_out = has_timed_out
        self._watermark_present = watermark_present
        self._timeout_timestamp = GroupState.NO_TIMESTAMP
        self._old_timeout_timestamp = old_timeout_timestamp

    @property
    def exists(self) -> bool:
        return self._defined

    @property
    def get(self) -> tuple[Any, ...]:
        if not self._defined:
            raise _error(ValueError, "STATE_NOT_EXISTS", {}, "state does not exist")
        return tuple(self._value or ())

    @property
    def getOption(self) -> tuple[Any, ...] | None:
        return tuple(self._value or ()) if self._defined else None

    @property
    def hasTimedOut(self) -> bool:
        return self._has_timed_out

    @property
    def oldTimeoutTimestamp(self) -> int:
        return self._old_timeout_timestamp

    def update(self, newValue: Any) -> None:
        if newValue is None:
            raise _error(TypeError, "CANNOT_BE_NONE", {"arg_name": "newValue"}, "newValue cannot be None")
        self._value = tuple(plain_value(v) for v in newValue)
        self._defined, self._updated, self._removed = True, True, False

    def remove(self) -> None:
        self._defined, self._updated, self._removed = False, False, True

    def _need(self, conf: str, what: str) -> None:
        if self._timeout_conf != conf:
            raise _error(RuntimeError, "CANNOT_WITHOUT",
                         {"condition1": what, "condition2": f"enabling {conf} in applyInPandasWithState"},
                         f"cannot {what} without {conf}")  # fmt: skip

    def setTimeoutDuration(self, durationMs: int) -> None:
        if isinstance(durationMs, str):
            raise _error(TypeError, "NOT_EXPECTED_TYPE",
                         {"expected_type": "int", "arg_name": "durationMs", "arg_type": "str"},
                         "durationMs must be an int")  # fmt: skip
        self._need(GroupStateTimeout.ProcessingTimeTimeout, "set timeout duration")
        if durationMs <= 0:
            raise _error(ValueError, "VALUE_NOT_POSITIVE", {"arg_name": "durationMs", "arg_value": str(durationMs)},
                         f"durationMs must be positive, got {durationMs}")  # fmt: skip
        self._timeout_timestamp = int(durationMs) + self._batch_processing_time_ms

    def setTimeoutTimestamp(self, timestampMs: Any) -> None:
        self._need(GroupStateTimeout.EventTimeTimeout, "set timeout timestamp")
        if isinstance(timestampMs, datetime.datetime):
            timestampMs = _TIMESTAMP.to_store(timestampMs) // 1000  # microseconds -> ms
        if timestampMs <= 0:
            raise _error(ValueError, "VALUE_NOT_POSITIVE", {"arg_name": "timestampMs", "arg_value": str(timestampMs)},
                         f"timestampMs must be positive, got {timestampMs}")  # fmt: skip
        watermark = self._event_time_watermark_ms
        if watermark != GroupState.NO_TIMESTAMP and timestampMs < watermark:
            raise _error(ValueError, "INVALID_TIMEOUT_TIMESTAMP",
                         {"timestamp": str(timestampMs), "watermark": str(watermark)},
                         f"timeout timestamp {timestampMs} is before the watermark {watermark}")  # fmt: skip
        self._timeout_timestamp = int(timestampMs)

    def getCurrentWatermarkMs(self) -> int:
        if not self._watermark_present:
            raise _error(RuntimeError, "CANNOT_WITHOUT",
                         {"condition1": "get event time watermark timestamp",
                          "condition2": "setting watermark before applyInPandasWithState"},
                         "no watermark: set one before applyInPandasWithState")  # fmt: skip
        return self._event_time_watermark_ms

    def getCurrentProcessingTimeMs(self) -> int:
        return self._batch_processing_time_ms

    def __str__(self) -> str:
        return f"GroupState({self.get})" if self.exists else "GroupState(<undefined>)"
