"""Scenarios of the differential suite: what one run feeds both queries, and hypothesis strategies.

A scenario is plain data (its ``repr`` is the Python that rebuilds it, for ``@example``): the API,
the time mode or timeout, the output mode, whether Spark runs no-data batches, the processor's
``Behaviour``, an optional initial state, the grouping (one key column or two), session settings
a user may have (time zone, rows per pandas chunk), the drop-in's parallelism, and 2-5 rounds of
input rows, each followed by a pause and, sometimes, a restart of both queries (the drop-in then
at another parallelism). Keys come from a small alphabet, with a null key in some scenarios.

Event times are seconds after ``BASE_SECONDS``; each round's rows lie around a base that moves
forward 20 s per round, reaching back up to 30 s, so that with the 10 s watermark delay some rows
are late (at or behind the watermark) and some lie exactly on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hypothesis import strategies as st

from tests.backend.spark.parity.processors import BASE_SECONDS, Behaviour

KEYS = "abcd"
TWS_MODES = ("None", "ProcessingTime", "EventTime")
GROUP_TIMEOUTS = ("NoTimeout", "ProcessingTimeTimeout", "EventTimeTimeout")
#: the pauses between rounds, milliseconds: they let Spark run no-data batches, and time pass
PAUSES_MS = (0, 0, 100, 600)
#: where timers go (processors.PROCESSING_OFFSETS, EVENT_OFFSETS)
TIMERS = ("now", "past", "soon", "far")


@dataclass(frozen=True)
class Round:
    """One input file: rows (key, value, event time in seconds after BASE_SECONDS), then a pause,
    then optionally a restart of both queries from their checkpoints (``restart``: the drop-in's
    parallelism from then on, which rescales its state; Spark's operator cannot change its own)."""

    rows: tuple[tuple[str | None, int, int], ...]
    pause_ms: int = 0
    restart: int | None = None

    def text(self) -> str:
        """The file's JSON lines (the event time as epoch seconds, which Spark reads as a timestamp)."""
        return "".join(json.dumps({"key": k, "v": v, "ts": BASE_SECONDS + t}) + "\n" for k, v, t in self.rows)


@dataclass(frozen=True)
class Scenario:
    """Everything one differential run feeds both queries."""

    api: str  # "pandas" (transformWithStateInPandas), "row" (transformWithState), "gs" (applyInPandasWithState)
    mode: str  # the TWS time mode, or the GroupStateTimeout for "gs"
    rounds: tuple[Round, ...]
    output_mode: str = "Update"
    no_data: bool = True  # spark.sql.streaming.noDataMicroBatches.enabled
    watermark: bool = False  # withWatermark("ts", "10 seconds") on the input
    behaviour: Behaviour = field(default_factory=Behaviour)
    initial: tuple[tuple[str, int], ...] | None = None  # TWS: initialState rows (key, start)
    parallelism: int = 4  # the drop-in's (Spark's operator has spark.sql.shuffle.partitions)
    max_records: int | None = None  # rows per pandas chunk (harness.ARROW_BATCH_CONF); None: Spark's default
    time_zone: str | None = None  # spark.sql.session.timeZone (None: the session's, UTC here)
    composite_key: bool = False  # group by (key, v) instead of key (no initial state then)

    @property
    def processing_time(self) -> bool:
        return self.mode in ("ProcessingTime", "ProcessingTimeTimeout")

    @property
    def event_time(self) -> bool:
        return self.mode in ("EventTime", "EventTimeTimeout")

    @property
    def runs_continuously(self) -> bool:
        """Spark's own operator runs a no-data batch at every trigger (processAllAvailable never returns)."""
        return self.processing_time and self.no_data

    @property
    def settle_batches(self) -> int:
        """Batches after the one that read a round's file by which everything the round causes is
        due and has fired: a timer or timeout 1 ms ahead fires in the next batch, each link of a
        chain at most one batch later; one more for margin."""
        return self.behaviour.chain + 2


def _rows(round_index: int, null_keys: bool) -> st.SearchStrategy[tuple[tuple[str | None, int, int], ...]]:
    base = 20 * round_index
    keys = st.sampled_from((*KEYS, None) if null_keys else KEYS)
    row = st.tuples(keys, st.integers(0, 9), st.integers(base - 30, base + 10))
    return st.lists(row, min_size=1, max_size=6).map(tuple)


@st.composite
def rounds(draw: st.DrawFn) -> tuple[Round, ...]:
    count = draw(st.integers(2, 5))
    null_keys = draw(st.integers(0, 4)) == 0  # a null grouping key in some scenarios
    out = []
    for i in range(count):
        restart = None
        if i < count - 1 and draw(st.integers(0, 5)) == 0:  # now and then, not after the last round
            restart = draw(st.integers(1, 4))
        out.append(Round(draw(_rows(i, null_keys)), draw(st.sampled_from(PAUSES_MS)), restart))
    return tuple(out)


@st.composite
def behaviours(draw: st.DrawFn, api: str, mode: str, no_data: bool) -> Behaviour:
    timed = mode not in ("None", "NoTimeout")
    if api == "gs":
        timers = ("soon", "far") if mode == "ProcessingTimeTimeout" else TIMERS  # a duration must be positive
        # A timed-out key whose function leaves its state untouched ("keep") times out again in every
        # later batch on Spark (pyspark reports the old timeout as unset, so the JVM keeps the expired
        # one): with a no-data batch at every trigger, how often would depend on the batches' speed.
        endings = ("update", "clear") if mode == "ProcessingTimeTimeout" and no_data else ("keep", "update", "clear")
        return Behaviour(
            timer=draw(st.sampled_from(timers)) if timed else None,
            chain=draw(st.integers(0, 2)) if timed else 0,
            on_timer=draw(st.sampled_from(endings)),
            remove_at=draw(st.none() | st.integers(2, 4)),
            echo_types=draw(st.booleans()),
            quiet=draw(st.booleans()),
        )
    timer = draw(st.none() | st.sampled_from(TIMERS)) if timed else None
    return Behaviour(
        list_state=draw(st.booleans()),
        map_state=draw(st.booleans()),
        # Spark refuses a TTL in timeMode None and EventTime (STATEFUL_PROCESSOR_INCORRECT_TIME_MODE_TO_ASSIGN_TTL)
        ttl_ms=draw(st.sampled_from((None, 1, 3_600_000))) if mode == "ProcessingTime" else None,
        ttl_all=draw(st.booleans()),
        timer=timer,
        delete_timers=draw(st.booleans()) if timer else False,
        chain=draw(st.integers(0, 2)) if timer else 0,
        on_timer=draw(st.sampled_from(("keep", "clear"))),
        delete_if_exists=draw(st.booleans()),
        initial_timer=draw(st.booleans()) if timed else False,
        echo_types=draw(st.booleans()),
        quiet=draw(st.booleans()),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """Any API, time mode or timeout, output mode, no-data setting, behaviour and input rounds."""
    api = draw(st.sampled_from(("pandas", "row", "gs")))
    mode = draw(st.sampled_from(GROUP_TIMEOUTS if api == "gs" else TWS_MODES))
    event_time = mode in ("EventTime", "EventTimeTimeout")
    no_data = draw(st.booleans())
    initial = None
    if api != "gs" and draw(st.booleans()):
        initial = tuple(draw(st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, 50)), min_size=1, max_size=4)))
    return Scenario(
        api=api,
        mode=mode,
        rounds=draw(rounds()),
        output_mode=draw(st.sampled_from(("Update", "Append"))),
        no_data=no_data,
        watermark=event_time or draw(st.booleans()),
        behaviour=draw(behaviours(api, mode, no_data)),
        initial=initial,
        parallelism=draw(st.integers(1, 4)),
        # applyInPandasWithState's chunks, and those of the first batch with an initial state, depend
        # on which keys share a partition (docs/spark-parity.md)
        max_records=None if api == "gs" or initial is not None else draw(st.sampled_from((None, None, 2))),
        time_zone=draw(st.sampled_from((None, None, "America/Los_Angeles", "Asia/Kolkata"))),
        composite_key=initial is None and draw(st.integers(0, 3)) == 0,
    )
