"""The retry/hedge state machine of ``UploadExecutor`` under random scripts: the invariants of its
attempts, hedges, retries, metrics and left-over objects, for any policy.

A scripted in-memory ``Uploader`` (``tests.dstl.scripted_uploader``) takes the behaviour of each
``put`` from a script. All time is virtual (``tests.dstl.virtual_time``): nothing sleeps.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dstl.config import HedgingPolicy
from dstl.errors import UploadFailedError
from dstl.hedging import UploadOutcome
from tests.dstl.scripted_uploader import Counters, Step, make
from tests.dstl.virtual_time import VirtualTimeLoop, run_virtual, virtual_now

# --- the state machine under random scripts -----------------------------------------------------


latencies = st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.3, 1.0, 2.5])
steps: st.SearchStrategy[Step] = st.one_of(
    st.tuples(st.just("ok"), latencies),
    st.tuples(st.just("fail"), latencies),
    st.just(("hang",)),
)
policies = st.builds(
    HedgingPolicy,
    enabled=st.sampled_from([True, True, True, False]),
    percentile=st.sampled_from([0.25, 0.5, 0.9, 0.99]),
    second_percentile=st.sampled_from([None, 0.6, 0.9, 0.995]),
    window=st.integers(1, 5),
    min_samples=st.integers(1, 3),
    initial_delay_ms=st.sampled_from([10, 50, 100, 500, 2000]),
    min_delay_ms=st.just(5),
    max_delay_ms=st.sampled_from([300, 5000]),
    budget=st.sampled_from([0.0, 0.3, 1.0, 1.0]),
    burst=st.sampled_from([1.0, 2.0, 3.0]),
)


@given(
    data=st.data(),
    max_attempts=st.integers(1, 4),
    policy=policies,
    upload_timeout_ms=st.sampled_from([200, 1000, 3000]),
    retry_delay_ms=st.sampled_from([0, 100, 500]),
    store_first=st.booleans(),
    uploads=st.integers(1, 3),
    seen=st.lists(latencies, max_size=6),
    tokens=st.sampled_from([0.0, 3.0]),
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_state_machine_invariants(
    data: st.DataObject,
    max_attempts: int,
    policy: HedgingPolicy,
    upload_timeout_ms: int,
    retry_delay_ms: int,
    store_first: bool,
    uploads: int,
    seen: list[float],
    tokens: float,
) -> None:
    scripts = [
        data.draw(st.lists(steps, min_size=max_attempts, max_size=max_attempts), label=f"script {i}")
        for i in range(uploads)
    ]
    executor, fake, metrics = make(
        [],
        store_first=store_first,
        hedging=policy,
        max_attempts=max_attempts,
        upload_timeout_ms=upload_timeout_ms,
        retry_delay_ms=retry_delay_ms,
    )
    # Latencies seen and tokens saved by earlier uploads: both hedge timers armed from the start.
    for latency in seen:
        executor.hedge_delay.observe(latency)
    executor.budget.tokens = min(tokens, policy.burst)
    winners: set[str] = set()
    loop = VirtualTimeLoop()

    async def scenario() -> None:
        for script in scripts:
            fake.load(script)
            first_call = len(fake.calls)
            before = Counters(metrics)
            start = virtual_now()
            try:
                outcome: UploadOutcome | None = await executor.upload(b"payload")
            except UploadFailedError:
                outcome = None
            await executor.drain()
            calls = fake.calls[first_call:]
            n = len(calls)
            hedges = metrics.hedges - before.hedges
            retries = metrics.retries - before.retries
            assert 1 <= n <= max_attempts
            assert metrics.upload_attempts - before.upload_attempts == n
            assert hedges <= n - 1
            assert hedges + retries == n - 1  # every extra attempt is a hedge or a retry
            assert metrics.hedges_won - before.hedges_won <= hedges
            assert all(c.outcome != "running" for c in calls), "an attempt outlived its upload"
            succeeded = [c for c in calls if c.outcome == "ok"]
            event("failed" if outcome is None else "hedge won" if outcome.hedge_won else "succeeded")
            event(f"attempts: {n}, hedges: {hedges}")
            if outcome is None:
                # Failure only once the attempts ran out, and only if none of them succeeded.
                assert not succeeded
                assert n == max_attempts
                assert metrics.upload_failures - before.upload_failures == 1
                assert metrics.attempt_timeouts - before.attempt_timeouts == sum(
                    c.outcome == "cancelled" for c in calls
                )
            else:
                winner = next(c for c in calls if c.path == outcome.path)
                assert winner.outcome == "ok"
                assert outcome.attempts == n
                assert outcome.latency_ms == pytest.approx((winner.end - start) * 1000)  # type: ignore[operator]
                assert outcome.hedged == (hedges > 0)
                assert outcome.hedge_won <= outcome.hedged
                assert metrics.upload_failures == before.upload_failures
                winners.add(outcome.path)
            # Exactly the winners' objects remain: every loser, failure and timed-out write is gone.
            assert set(fake.objects) == winners

    run_virtual(scenario(), loop=loop)
    assert metrics.hedges <= policy.budget * uploads + min(tokens, policy.burst) + 1e-9
    if not policy.enabled:
        assert metrics.hedges == 0 and metrics.hedges_denied_by_budget == 0
