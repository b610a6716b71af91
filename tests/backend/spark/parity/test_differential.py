"""The differential suite: generated scenarios give the same outputs, round by round, on the drop-in
and on Spark's own operator (RocksDB state store), in one SparkSession.

One example costs seconds (two streaming queries, Python workers), so examples are neither shrunk
nor many in CI: ``PARITY_EXAMPLES`` sets their number (default 2; 200 under
``HYPOTHESIS_PROFILE=slow``; ``tox -e slow`` runs 5 x 40 with fixed seeds, one Spark session
each). A failure prints the scenario as Python to paste into ``@example`` and, per round, the rows
only one side emitted. ``PARITY_SELF_EXAMPLES`` runs
the harness with Spark's own operator on both sides (it must find no difference: the waiting and
the attribution of batches to rounds are then what is tested).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("pyspark")

from hypothesis import HealthCheck, Phase, given, settings

from tests.backend.spark.parity.harness import run_scenario
from tests.backend.spark.parity.processors import Behaviour
from tests.backend.spark.parity.scenarios import Round, Scenario, scenarios

pytestmark = [pytest.mark.spark, pytest.mark.spark_parity]

_SLOW = os.environ.get("HYPOTHESIS_PROFILE") == "slow"
EXAMPLES = int(os.environ.get("PARITY_EXAMPLES", "200" if _SLOW else "2"))
SELF_EXAMPLES = int(os.environ.get("PARITY_SELF_EXAMPLES", "10" if _SLOW else "0"))


def _settings(examples: int) -> settings:
    return settings(
        max_examples=max(examples, 1),
        deadline=None,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),  # no shrinking: an example costs seconds
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


@_settings(EXAMPLES)
@given(scenario=scenarios())
def test_generated_scenarios_give_sparks_outputs_round_by_round(spark: Any, scenario: Scenario) -> None:
    outcome = run_scenario(spark, scenario, ("ours", "spark"))
    assert not outcome.differing(), outcome.report()


@pytest.mark.skipif(SELF_EXAMPLES <= 0, reason="PARITY_SELF_EXAMPLES=0: the harness self-check is off")
@_settings(SELF_EXAMPLES)
@given(scenario=scenarios())
def test_harness_finds_no_difference_between_spark_and_itself(spark: Any, scenario: Scenario) -> None:
    outcome = run_scenario(spark, scenario, ("spark", "spark"))
    assert not outcome.differing(), outcome.report()


# The cases 1 and 2, as described there, with Spark's outputs spelled out.

LATE = (Round((("a", 1, 100),)), Round((("a", 1, 105),)), Round((("a", 1, 50), ("b", 1, 50))))


@pytest.mark.parametrize(("api", "mode", "kind"), [("pandas", "EventTime", "in"), ("gs", "EventTimeTimeout", "data")])
def test_late_rows_never_reach_the_processor(spark: Any, api: str, mode: str, kind: str) -> None:
    """Case 1: with withWatermark("ts", "10 seconds"), key a at 100 s, a at 105 s, then a and b at
    50 s (behind the watermark): Spark's operator drops the late rows; nothing is emitted or counted."""
    outcome = run_scenario(spark, Scenario(api=api, mode=mode, rounds=LATE, watermark=True))
    assert not outcome.differing(), outcome.report()
    rounds = [sorted(row[:3] for row in spark_rows.elements()) for _, spark_rows in outcome.rounds()]
    assert rounds == [[("a", kind, 1)], [("a", kind, 2)], []]


def test_a_processing_time_timeout_fires_in_a_no_data_batch(spark: Any) -> None:
    """Case 2: applyInPandasWithState with a 1 ms ProcessingTimeTimeout, key a, a pause, key a
    again: Spark times the key out after each round's data (its state removed) in a batch without
    input, so both rounds emit (a, data, 1) and (a, timeout, 1)."""
    scenario = Scenario(
        api="gs",
        mode="ProcessingTimeTimeout",
        rounds=(Round((("a", 1, 0),), pause_ms=600), Round((("a", 2, 20),))),
        behaviour=Behaviour(timer="soon", on_timer="clear"),
    )
    outcome = run_scenario(spark, scenario)
    assert not outcome.differing(), outcome.report()
    expected = [("a", "data", 1), ("a", "timeout", 1)]
    assert [sorted(row[:3] for row in spark_rows.elements()) for _, spark_rows in outcome.rounds()] == [expected] * 2


def test_a_timed_out_key_left_untouched_times_out_again_in_every_batch(spark: Any) -> None:
    """pyspark hands the JVM a timed-out key's old timeout as unset (``oldTimeoutTimestamp`` is -1),
    so when the function neither updates nor removes the state nor sets a timeout, Spark sees no
    change, keeps the expired timeout and calls the function again, timed out, in every later batch
    until the key has data. Without no-data batches that is once per input file."""
    scenario = Scenario(
        api="gs",
        mode="ProcessingTimeTimeout",
        rounds=(Round((("a", 1, 0),)), Round((("b", 1, 1),)), Round((("b", 1, 2),))),
        no_data=False,
        behaviour=Behaviour(timer="soon", on_timer="keep"),
    )
    outcome = run_scenario(spark, scenario)
    assert not outcome.differing(), outcome.report()
    kinds = [sorted(row[:3] for row in spark_rows.elements()) for _, spark_rows in outcome.rounds()]
    assert kinds == [
        [("a", "data", 1)],
        [("a", "timeout", 1), ("b", "data", 1)],
        [("a", "timeout", 1), ("b", "data", 2)],
    ]
