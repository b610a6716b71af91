"""The processors and functions the differential suite runs, one configurable body per API.

A ``Behaviour`` says which of Spark's state APIs a run exercises (value, list and map state, TTL,
timers at now / in the past / soon / far, chained and deleted timers, ``clear``, ``removeKey``,
``deleteIfExists``, ``initialState``, the ``GroupState`` timeouts); one body per API reads it, so
that a generated scenario is data (printable, reproducible with ``@example``), not code.

Every output is a function of the input rounds only, never of the wall clock: the two queries'
batch timestamps differ, so processing times never appear in an output, and processing-time
timers and durations are "now", "in the past", 1 ms or one hour, so that whether one is due never
depends on how long a batch took. Event times and watermarks are deterministic and are output.
Chained timers are bounded by a depth counter in state (a processing-time chain would never end).
The classes are pickled by value (``harness`` registers this module): Spark's Python workers
cannot import the tests package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd  # type: ignore[import-untyped, unused-ignore]
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import StatefulProcessor

#: the input rows: a key of a small alphabet, a value and an event time
INPUT_SCHEMA = "key string, v long, ts timestamp"
#: one row per call of a handler: key, what emitted it, the key's count, the rest as text
OUTPUT_SCHEMA = "key string, kind string, n long, detail string"
INITIAL_SCHEMA = "key string, start long"
GROUP_STATE_SCHEMA = "n long, d long"
#: the input's event times are seconds after this (epoch seconds)
BASE_SECONDS = 1_700_000_000
WATERMARK_DELAY = "10 seconds"

#: processing-time timer offsets from the batch timestamp: due in this batch ("past", "now": Spark
#: fires the timers at or before the batch timestamp after the input), in the next batch ("soon":
#: any batch takes more than a millisecond), or never within a test ("far")
PROCESSING_OFFSETS = {"now": 0, "past": -1_000, "soon": 1, "far": 3_600_000}
#: event-time timer offsets from the key's latest event time in the batch
EVENT_OFFSETS = {"now": 0, "past": -15_000, "soon": 5_000, "far": 3_600_000}
#: the event time of a timer ``handleInitialState`` registers in EventTime mode
INITIAL_EVENT_TIMER_MS = (BASE_SECONDS + 30) * 1000
#: an event-time chain's next timer, after the one that fired
CHAIN_EVENT_STEP_MS = 1_000


@dataclass(frozen=True)
class Behaviour:
    """What a generated processor or function does; each field turns on one API's use."""

    list_state: bool = False  # the key's last three values (appendList, get, put)
    map_state: bool = False  # counts per value bucket (containsKey, getValue, updateValue, removeKey at 2)
    ttl_ms: int | None = None  # TTL of the "seen" value state (1: expired by the next batch; 3600000: never)
    ttl_all: bool = False  # the TTL applies to the list and map state too
    timer: str | None = None  # a timer per key with data: PROCESSING_OFFSETS / EVENT_OFFSETS key
    delete_timers: bool = False  # the key's listed timers are deleted before registering
    chain: int = 0  # a timer's handler registers another, this many times in a row
    #: what a timer's handler does with the key's state: "keep" (nothing), "clear" (clears it; GroupState:
    #: remove), "update" (GroupState: writes the same value, which also ends its timeout)
    on_timer: str = "keep"
    delete_if_exists: bool = False  # init calls deleteIfExists on a state the handler writes
    initial_timer: bool = False  # handleInitialState registers a timer
    echo_types: bool = False  # outputs the Python types of the input and state values
    quiet: bool = False  # a call that brings a key's count to an even number emits nothing
    remove_at: int | None = None  # GroupState: the function removes the state at this count


def key_text(key: Any) -> str:
    """A grouping key (a tuple of one or more values, numpy scalars for applyInPandasWithState) as text."""
    return "/".join(str(part) for part in key)


def _ms(value: Any) -> int:
    """Epoch milliseconds of a pandas Timestamp or a datetime (naive: taken as UTC, as pandas does)."""
    return int(pd.Timestamp(value).timestamp() * 1000)


class _Body:
    """The state logic of the generated StatefulProcessor, shared by the pandas and Row APIs."""

    def __init__(self, behaviour: Behaviour, time_mode: str) -> None:
        self.behaviour = behaviour
        self.time_mode = time_mode.lower()

    def init(self, handle: Any) -> None:
        b = self.behaviour
        self.handle = handle
        if b.delete_if_exists:
            handle.deleteIfExists("scratch")
        self.count = handle.getValueState("count", "n long")
        self.depth = handle.getValueState("depth", "d long")
        self.seen = handle.getValueState("seen", "s boolean", b.ttl_ms) if b.ttl_ms else None
        ttl = b.ttl_ms if b.ttl_all else None
        self.recent = handle.getListState("recent", "v long", ttl) if b.list_state else None
        self.buckets = handle.getMapState("buckets", "b long", "c long", ttl) if b.map_state else None
        self.scratch = handle.getValueState("scratch", "k long") if b.delete_if_exists else None

    def _offset(self, name: str) -> int:
        return (PROCESSING_OFFSETS if self.time_mode == "processingtime" else EVENT_OFFSETS)[name]

    def initial(self, key: Any, starts: list[int], timer_values: Any) -> None:
        old = self.count.get()
        self.count.update(((old[0] if old else 0) + sum(starts),))
        if self.behaviour.initial_timer and self.time_mode != "none":
            at = timer_values.getCurrentProcessingTimeInMs() if self.time_mode == "processingtime" else None
            self.handle.registerTimer(INITIAL_EVENT_TIMER_MS if at is None else at)

    def rows(
        self, key: Any, values: list[int], times: list[int], types: str, timer_values: Any, chunks: int | None = None
    ) -> tuple[Any, ...] | None:
        b = self.behaviour
        old = self.count.get()
        n = (old[0] if old else 0) + len(values)
        self.count.update((n,))
        parts: list[str] = []
        if b.chain:
            self.depth.update((0,))
        if self.recent is not None:
            self.recent.appendList([(v,) for v in values])
            kept = [int(v) for (v,) in self.recent.get()][-3:]
            self.recent.put([(v,) for v in kept])
            parts.append(f"r={kept}")
        if self.buckets is not None:
            for v in values:
                bucket = (v % 3,)
                c = (self.buckets.getValue(bucket)[0] if self.buckets.containsKey(bucket) else 0) + 1
                if c >= 2:
                    self.buckets.removeKey(bucket)
                else:
                    self.buckets.updateValue(bucket, (c,))
            parts.append(f"m={sorted((int(k[0]), int(c[0])) for k, c in self.buckets.iterator())}")
        if self.seen is not None:
            parts.append(f"s={self.seen.exists()}")
            self.seen.update((True,))
        if self.scratch is not None:
            k = (self.scratch.get() or (0,))[0] + 1
            self.scratch.update((k,))
            parts.append(f"k={k}")
        if b.timer is not None and self.time_mode != "none":
            if b.delete_timers:
                for timer in list(self.handle.listTimers()):
                    self.handle.deleteTimer(timer)
            base = timer_values.getCurrentProcessingTimeInMs() if self.time_mode == "processingtime" else max(times)
            self.handle.registerTimer(base + self._offset(b.timer))
            timers = sorted(int(t) for t in self.handle.listTimers())
            # processing-time timers are wall-clock values: only how many there are is deterministic
            parts.append(f"t={timers if self.time_mode == 'eventtime' else len(timers)}")
        if self.time_mode != "none":
            parts.append(f"w={timer_values.getCurrentWatermarkInMs()};e={max(times)}")
        if chunks is not None:  # how many DataFrames the pandas API cut the key's rows into
            parts.append(f"f={chunks}")
        if b.echo_types:
            parts.append(f"y={types},{type(old[0]).__name__ if old else None}")
        if b.quiet and n % 2 == 0:
            return None
        return (key_text(key), "in", n, ";".join(parts))

    def timer(self, key: Any, timer_values: Any, expiry_ms: int) -> tuple[Any, ...]:
        b = self.behaviour
        old = self.count.get()
        n = old[0] if old else 0
        d = (self.depth.get() or (0,))[0]
        parts = [f"d={d}", f"w={timer_values.getCurrentWatermarkInMs()}"]
        if self.time_mode == "eventtime":
            parts.append(f"x={expiry_ms}")
        if self.seen is not None:
            parts.append(f"s={self.seen.exists()}")
        if b.on_timer == "clear":
            self.count.clear()
            for state in (self.recent, self.buckets):
                if state is not None:
                    state.clear()
        if d < b.chain:
            self.depth.update((d + 1,))
            eventtime = self.time_mode == "eventtime"
            self.handle.registerTimer(
                expiry_ms + CHAIN_EVENT_STEP_MS if eventtime else timer_values.getCurrentProcessingTimeInMs()
            )
        return (key_text(key), "timer", n, ";".join(parts))


def _frame(rows: list[tuple[Any, ...]]) -> Any:
    return pd.DataFrame.from_records(rows, columns=["key", "kind", "n", "detail"]).astype({"n": "int64"})


class PandasProcessor(StatefulProcessor):
    """The generated processor on the pandas API (``transformWithStateInPandas``)."""

    def __init__(self, behaviour: Behaviour, time_mode: str) -> None:
        self.body = _Body(behaviour, time_mode)

    def init(self, handle: Any) -> None:
        self.body.init(handle)

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        self.body.initial(key, [int(s) for s in initialState["start"]], timerValues)

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        values: list[int] = []
        times: list[int] = []
        types = ""
        chunks = 0
        for frame in rows:
            values += [int(v) for v in frame["v"]]
            times += [_ms(t) for t in frame["ts"]]
            types = f"{frame['ts'].dtype}/{type(frame['v'].iloc[0]).__name__}"
            chunks += 1
        out = self.body.rows(key, values, times, types, timerValues, chunks)
        yield _frame([] if out is None else [out])  # an empty frame: Spark emits nothing for it

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        yield _frame([self.body.timer(key, timerValues, expiredTimerInfo.getExpiryTimeInMs())])

    def close(self) -> None:
        return None


class RowProcessor(StatefulProcessor):
    """The generated processor on the Row API (``transformWithState``)."""

    def __init__(self, behaviour: Behaviour, time_mode: str) -> None:
        self.body = _Body(behaviour, time_mode)

    def init(self, handle: Any) -> None:
        self.body.init(handle)

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        self.body.initial(key, [int(initialState.start)], timerValues)

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        seen = list(rows)
        ts = seen[0].ts
        types = f"{type(ts).__name__}:{getattr(ts, 'tzinfo', None) is not None}/{type(seen[0].v).__name__}"
        out = self.body.rows(key, [int(r.v) for r in seen], [_ms(r.ts) for r in seen], types, timerValues)
        if out is not None:
            yield Row(key=out[0], kind=out[1], n=out[2], detail=out[3])

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        out = self.body.timer(key, timerValues, expiredTimerInfo.getExpiryTimeInMs())
        yield Row(key=out[0], kind=out[1], n=out[2], detail=out[3])

    def close(self) -> None:
        return None


def processor(api: str, behaviour: Behaviour, time_mode: str) -> Any:
    """A new StatefulProcessor for ``api`` ("pandas" or "row")."""
    return (PandasProcessor if api == "pandas" else RowProcessor)(behaviour, time_mode)


#: GroupState timeout durations (processing time; must be positive)
GROUP_DURATIONS = {"soon": 1, "far": 3_600_000}


def group_function(behaviour: Behaviour, timeout: str) -> Callable[[Any, Iterator[Any], Any], Iterator[Any]]:
    """The generated ``applyInPandasWithState`` function for ``timeout`` (a GroupStateTimeout value)."""
    b = behaviour
    processing = timeout == "ProcessingTimeTimeout"
    event = timeout == "EventTimeTimeout"

    def set_timeout(state: Any, latest_ms: int | None) -> None:
        if processing:
            state.setTimeoutDuration(GROUP_DURATIONS.get(b.timer or "soon", 1))
        elif event:
            watermark = state.getCurrentWatermarkMs()
            at = watermark + CHAIN_EVENT_STEP_MS if latest_ms is None else latest_ms + EVENT_OFFSETS[b.timer or "now"]
            state.setTimeoutTimestamp(max(at, watermark))

    def watermark(state: Any) -> str:
        try:  # without a watermark on the input, pyspark raises CANNOT_WITHOUT
            return str(state.getCurrentWatermarkMs())
        except Exception as error:
            return type(error).__name__

    def func(key: Any, frames: Iterator[Any], state: Any) -> Iterator[Any]:
        n, d = state.get if state.exists else (0, 0)
        parts: list[str] = []
        if state.hasTimedOut:
            parts.append(f"d={d};w={watermark(state)}")
            if d < b.chain:
                state.update((n, d + 1))
                set_timeout(state, None)
            elif b.on_timer == "clear":
                state.remove()
            elif b.on_timer == "update":
                state.update((n, d))
            yield _frame([(key_text(key), "timeout", int(n), ";".join(parts))])
            return
        values: list[int] = []
        times: list[int] = []
        types = ""
        chunks = 0
        for frame in frames:
            values += [int(v) for v in frame["v"]]
            times += [_ms(t) for t in frame["ts"]]
            types = f"{frame['ts'].dtype}/{type(frame['v'].iloc[0]).__name__}"
            chunks += 1
        parts.append(f"f={chunks}")
        if b.echo_types:
            old = type(state.get[0]).__name__ if state.exists else None
            parts.append(f"y={types},{old};o={state.oldTimeoutTimestamp}")
        n += len(values)
        if b.remove_at is not None and n >= b.remove_at:
            state.remove()
            parts.append("removed")
        else:
            state.update((n, 0))
        if b.timer is not None and (processing or event):
            set_timeout(state, max(times))
        parts.append(f"w={watermark(state)};e={max(times)}")
        quiet = b.quiet and n % 2 == 0  # an empty frame: Spark emits nothing for it
        yield _frame([] if quiet else [(key_text(key), "data", int(n), ";".join(parts))])

    return func
