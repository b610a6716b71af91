"""``HedgeDelay`` (the percentile of a window of primary latencies, clamped) and ``HedgeBudget``
(tokens earned per upload, capped at the burst), alone and in an ``UploadExecutor`` whose every
primary is slow.

All time is virtual (``tests.dstl.virtual_time``): every latency below is exact and nothing sleeps.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstl.config import HedgingPolicy
from dstl.hedging import HedgeBudget, HedgeDelay
from tests.dstl.scripted_uploader import OK_FAST, hedge_policy, make
from tests.dstl.virtual_time import run_virtual

# --- HedgeDelay and HedgeBudget -----------------------------------------------------------------


def test_hedge_delay_uses_initial_delay_until_min_samples() -> None:
    delay = HedgeDelay(HedgingPolicy(initial_delay_ms=700, min_samples=3, percentile=0.5, window=10))
    assert delay.current() == 0.7
    delay.observe(0.1)
    delay.observe(0.2)
    assert delay.current() == 0.7
    delay.observe(0.3)
    assert delay.current() == 0.2  # sorted [0.1, 0.2, 0.3], int(0.5 * 3) == 1


def test_hedge_delay_is_the_percentile_of_the_window() -> None:
    delay = HedgeDelay(HedgingPolicy(min_samples=1, percentile=0.9, window=100, max_delay_ms=1_000_000))
    for value in reversed(range(1, 101)):
        delay.observe(float(value))
    result = delay.current()
    # A p-quantile v of the samples: at least 90 % are <= v and at most 90 % are < v.
    assert sum(v <= result for v in range(1, 101)) >= 90
    assert sum(v < result for v in range(1, 101)) <= 90
    assert result in (90.0, 91.0)


@given(
    samples=st.lists(st.floats(0.001, 10.0), min_size=1, max_size=60),
    percentile=st.floats(0.01, 0.99),
    window=st.integers(1, 30),
)
@settings(max_examples=200, deadline=None)
def test_hedge_delay_matches_a_percentile_of_the_last_window_samples(
    samples: list[float], percentile: float, window: int
) -> None:
    policy = HedgingPolicy(min_samples=1, percentile=percentile, window=window, min_delay_ms=1, max_delay_ms=10_000)
    delay = HedgeDelay(policy)
    for value in samples:
        delay.observe(value)
    recent = samples[-window:]
    result = delay.current()
    assert result in recent
    assert sum(v <= result for v in recent) >= percentile * len(recent) - 1e-9
    assert sum(v < result for v in recent) <= percentile * len(recent) + 1e-9


def test_hedge_delay_is_clamped() -> None:
    policy = HedgingPolicy(min_samples=1, percentile=0.5, window=3, min_delay_ms=50, max_delay_ms=2000)
    delay = HedgeDelay(policy)
    delay.observe(0.001)
    assert delay.current() == 0.05
    for _ in range(3):
        delay.observe(60.0)
    assert delay.current() == 2.0
    # The initial delay is clamped too.
    assert HedgeDelay(HedgingPolicy(initial_delay_ms=9000, max_delay_ms=5000)).current() == 5.0


def test_hedge_delay_window_slides() -> None:
    delay = HedgeDelay(HedgingPolicy(min_samples=1, percentile=0.99, window=3, max_delay_ms=100_000))
    for value in (50.0, 1.0, 1.0):
        delay.observe(value)
    assert delay.current() == 50.0
    delay.observe(2.0)  # 50 leaves the window
    assert delay.current() == 2.0
    for _ in range(3):
        delay.observe(3.0)
    assert delay.current() == 3.0


def test_hedge_budget_starts_empty_earns_and_caps_at_burst() -> None:
    budget = HedgeBudget(HedgingPolicy(budget=0.5, burst=3.0))
    assert budget.tokens == 0.0
    assert not budget.try_take()
    budget.earn()
    assert not budget.try_take()  # half a token is no hedge
    budget.earn()
    assert budget.try_take()
    assert budget.tokens == 0.0
    for _ in range(100):
        budget.earn()
    assert budget.tokens == 3.0
    assert [budget.try_take() for _ in range(4)] == [True, True, True, False]


def test_hedge_budget_burst_below_one_still_allows_a_hedge() -> None:
    budget = HedgeBudget(HedgingPolicy(budget=1.0, burst=0.5))
    budget.earn()
    budget.earn()
    assert budget.tokens == 1.0
    assert budget.try_take()


@pytest.mark.parametrize("fraction", [0.05, 0.2])
def test_hedges_stay_within_budget_when_every_primary_is_slow(fraction: float) -> None:
    n = 1000
    policy = hedge_policy(budget=fraction, burst=10.0, max_delay_ms=500)
    executor, fake, metrics = make([], hedging=policy, upload_timeout_ms=30_000)

    async def scenario() -> None:
        for _ in range(n):
            fake.load([("ok", 10.0), OK_FAST])
            await executor.upload(b"x")
        await executor.drain()

    run_virtual(scenario())
    assert metrics.hedges <= fraction * n
    assert metrics.hedges >= math.floor(fraction * n) - 1  # the budget is used when it is needed
    assert metrics.hedges + metrics.hedges_denied_by_budget == n
    assert metrics.hedges_won == metrics.hedges
    assert len(fake.objects) == n  # one object per upload: every loser was deleted
