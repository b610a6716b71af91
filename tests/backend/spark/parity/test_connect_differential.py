"""The differential suite on a Spark Connect session: the drop-in's explicit entry points and Spark's
own operator, side by side on one Connect server (the ``connect`` fixture), must give the same
outputs round by round (``harness.run_scenario``; its ``foreachBatch`` function runs on the
server there and leaves each batch's rows in a file).

The default suite runs one representative per operator and API: transformWithStateInPandas with a
restart at another parallelism, transformWithState (Row API) in event time with late rows, and
applyInPandasWithState with a processing-time timeout. ``PARITY_CONNECT_EXAMPLES`` runs that many
generated scenarios too (0 by default), except those in which Spark's own operator runs a batch at
every trigger (the harness follows those by a listener's progress events, which pyspark's Connect
client stops delivering once a query with a Python data source reports its accumulators, and can
deadlock removing).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("pyspark")

from hypothesis import HealthCheck, Phase, assume, given, settings

from tests.backend.spark.parity.harness import run_scenario
from tests.backend.spark.parity.processors import Behaviour
from tests.backend.spark.parity.scenarios import Round, Scenario, scenarios

pytestmark = [pytest.mark.spark, pytest.mark.spark_parity]

EXAMPLES = int(os.environ.get("PARITY_CONNECT_EXAMPLES", "0"))

REPRESENTATIVES = {
    "pandas": Scenario(
        api="pandas",
        mode="None",
        rounds=(Round((("a", 1, 0), ("b", 2, 1))), Round((("a", 3, 2),), restart=2), Round((("b", 1, 3),))),
    ),
    "row": Scenario(
        api="row",
        mode="EventTime",
        watermark=True,
        rounds=(Round((("a", 1, 100),)), Round((("a", 1, 105),)), Round((("a", 1, 50), ("b", 1, 50)))),
    ),
    "gs": Scenario(
        api="gs",
        mode="ProcessingTimeTimeout",
        rounds=(Round((("a", 1, 0),)), Round((("b", 1, 1),)), Round((("b", 1, 2),))),
        no_data=False,
        behaviour=Behaviour(timer="soon", on_timer="keep"),
    ),
}


@pytest.mark.parametrize("api", sorted(REPRESENTATIVES))
def test_each_operator_gives_sparks_outputs_on_connect(connect: Any, api: str) -> None:
    outcome = run_scenario(connect, REPRESENTATIVES[api])
    assert not outcome.differing(), outcome.report()
    assert any(rows for _, rows in outcome.rounds()), "the scenario emitted nothing: it compares nothing"


@pytest.mark.skipif(EXAMPLES <= 0, reason="PARITY_CONNECT_EXAMPLES=0: generated scenarios on Connect are off")
@settings(
    max_examples=max(EXAMPLES, 1),
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(scenario=scenarios())
def test_generated_scenarios_give_sparks_outputs_on_connect(connect: Any, scenario: Scenario) -> None:
    assume(not scenario.runs_continuously)
    outcome = run_scenario(connect, scenario)
    assert not outcome.differing(), outcome.report()
