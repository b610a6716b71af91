"""The retry/hedge state machine of ``UploadExecutor``, driven on a virtual-time loop: its cases one
by one (hedges, budgets, retries, backoff, timeouts, cancellation, second hedges).

A scripted in-memory ``Uploader`` (``tests.dstl.scripted_uploader``) takes the behaviour of each
``put`` from a script; with ``store_first=True`` every put stores its object *before* sleeping, like
a request whose bytes reached the store although the caller gave up on it: a cancelled, failed or
timed-out attempt then leaves an object that the executor must delete.
All time is virtual (``tests.dstl.virtual_time``): every latency below is exact and nothing sleeps.
"""

from __future__ import annotations

import asyncio

import pytest

from dstl.config import HedgingPolicy
from dstl.errors import UploadFailedError
from dstl.hedging import HedgeDelay, UploadOutcome
from tests.dstl.scripted_uploader import OK_FAST, Counters, hedge_policy, make, store_variants, upload_and_drain
from tests.dstl.virtual_time import VirtualTimeLoop, elapse, run_virtual, virtual_now

# --- the cases of the state machine -------------------------------------------------------------


@store_variants
def test_fast_primary_is_not_hedged(store_first: bool) -> None:
    executor, fake, metrics = make([OK_FAST], store_first=store_first, hedging=hedge_policy())

    async def scenario() -> UploadOutcome:
        return await upload_and_drain(executor)

    outcome = run_virtual(scenario())
    assert outcome == UploadOutcome(path="obj-1", attempts=1, hedged=False, hedge_won=False, latency_ms=50)
    assert fake.outcomes() == ["ok"]
    assert fake.objects == {"obj-1": b"payload"}
    assert fake.deleted == []
    assert (metrics.upload_requests, metrics.upload_attempts, metrics.hedges, metrics.retries) == (1, 1, 0, 0)
    assert metrics.hedges_denied_by_budget == 0
    assert metrics.upload_failures == 0
    assert list(metrics.upload_latencies_ms.samples) == [50]
    assert list(metrics.attempts_per_upload.samples) == [1]


@store_variants
def test_slow_primary_is_beaten_by_hedge(store_first: bool) -> None:
    executor, fake, metrics = make(
        [("ok", 10.0), OK_FAST],
        store_first=store_first,
        hedging=hedge_policy(budget=1.0, burst=10.0),
        upload_timeout_ms=30_000,
    )
    left_before_drain: dict[str, bytes] = {}

    async def scenario() -> UploadOutcome:
        outcome = await executor.upload(b"payload")
        left_before_drain.update(fake.objects)
        await executor.drain()
        return outcome

    outcome = run_virtual(scenario())
    assert outcome.latency_ms == pytest.approx(100 + 50)
    assert (outcome.path, outcome.attempts, outcome.hedged, outcome.hedge_won) == ("obj-2", 2, True, True)
    # The hedge started at the hedge delay; the primary was cancelled when the hedge won.
    assert [c.start for c in fake.calls] == pytest.approx([0.0, 0.1])
    assert fake.outcomes() == ["cancelled", "ok"]
    assert fake.calls[0].end == pytest.approx(0.15)
    if store_first:
        # The cancelled loser had already written: only the background cleanup removes it.
        assert set(left_before_drain) == {"obj-1", "obj-2"}
    assert fake.objects == {"obj-2": b"payload"}
    assert fake.deleted == ["obj-1"]
    assert (metrics.hedges, metrics.hedges_won, metrics.hedges_denied_by_budget) == (1, 1, 0)
    assert metrics.upload_attempts == 2
    assert metrics.retries == 0
    assert metrics.deleted_orphans == 1
    assert executor.budget.tokens == 0.0


def test_exhausted_budget_denies_the_hedge() -> None:
    executor, fake, metrics = make([("ok", 2.0)], hedging=hedge_policy(budget=0.0), upload_timeout_ms=30_000)
    outcome = run_virtual(upload_and_drain(executor))
    assert outcome.latency_ms == 2000
    assert (outcome.attempts, outcome.hedged, outcome.hedge_won) == (1, False, False)
    assert metrics.hedges_denied_by_budget == 1
    assert metrics.hedges == 0
    assert metrics.upload_attempts == 1
    assert fake.objects == {"obj-1": b"payload"}


def test_budget_is_spent_then_hedges_are_denied() -> None:
    """Half a token per upload: every second slow upload may hedge."""
    executor, fake, metrics = make([], hedging=hedge_policy(budget=0.5, burst=10.0), upload_timeout_ms=30_000)

    async def scenario() -> list[UploadOutcome]:
        outcomes = []
        for _ in range(4):
            fake.load([("ok", 10.0), OK_FAST])
            outcomes.append(await upload_and_drain(executor))
        return outcomes

    outcomes = run_virtual(scenario())
    # tokens after each earn: 0.5 (deny), 1.0 (hedge -> 0), 0.5 (deny), 1.0 (hedge)
    assert [o.hedged for o in outcomes] == [False, True, False, True]
    assert [o.latency_ms for o in outcomes] == pytest.approx([10_000, 150, 10_000, 150])
    assert (metrics.hedges, metrics.hedges_denied_by_budget) == (2, 2)


def test_disabled_hedging_never_hedges() -> None:
    executor, fake, metrics = make(
        [("ok", 3.0)], hedging=HedgingPolicy(enabled=False, budget=1.0), upload_timeout_ms=30_000
    )

    async def scenario() -> list[UploadOutcome]:
        outcomes = [await upload_and_drain(executor)]
        # A hanging primary is not hedged either: it is retried after its timeout.
        fake.load([("hang",), OK_FAST])
        outcomes.append(await upload_and_drain(executor))
        return outcomes

    first, second = run_virtual(scenario())
    assert first.latency_ms == 3000 and first.attempts == 1 and not first.hedged
    assert second.latency_ms == pytest.approx(30_000 + 500 + 50)
    assert second.attempts == 2 and not second.hedged
    assert (metrics.hedges, metrics.hedges_won, metrics.hedges_denied_by_budget) == (0, 0, 0)
    assert metrics.retries == 1
    assert executor.hedge_delay.current() * 1000 == HedgingPolicy().initial_delay_ms  # nothing observed


@store_variants
def test_error_then_retry_succeeds(store_first: bool) -> None:
    # Hedging on (with budget), but the hedge delay of 1 s lies beyond the whole upload.
    executor, fake, metrics = make(
        [("fail", 0.01), ("ok", 0.01)],
        store_first=store_first,
        hedging=hedge_policy(initial_delay_ms=1000),
        retry_delay_ms=500,
    )
    outcome = run_virtual(upload_and_drain(executor))
    assert outcome.latency_ms == pytest.approx(10 + 500 + 10)
    assert (outcome.path, outcome.attempts, outcome.hedged) == ("obj-2", 2, False)
    # A retry that wins is not a hedge that won.
    assert outcome.hedge_won is False
    assert (metrics.retries, metrics.hedges, metrics.hedges_won) == (1, 0, 0)
    assert [c.start for c in fake.calls] == pytest.approx([0.0, 0.51])
    assert fake.outcomes() == ["failed", "ok"]
    assert fake.objects == {"obj-2": b"payload"}
    if store_first:
        assert "obj-1" in fake.deleted


def test_backoff_doubles_after_each_failure() -> None:
    executor, fake, metrics = make([("fail", 0.01), ("fail", 0.01), ("ok", 0.01)], max_attempts=3, retry_delay_ms=500)
    outcome = run_virtual(upload_and_drain(executor))
    starts = [c.start for c in fake.calls]
    ends = [c.end for c in fake.calls]
    assert starts[1] - ends[0] == pytest.approx(0.5)  # type: ignore[operator]
    assert starts[2] - ends[1] == pytest.approx(1.0)  # type: ignore[operator]
    assert outcome.latency_ms == pytest.approx(10 + 500 + 10 + 1000 + 10)
    assert outcome.attempts == 3
    assert metrics.retries == 2
    assert list(metrics.attempts_per_upload.samples) == [3]


@store_variants
def test_per_attempt_timeout_then_retry(store_first: bool) -> None:
    executor, fake, metrics = make(
        [("hang",), ("ok", 0.01)], store_first=store_first, upload_timeout_ms=1000, retry_delay_ms=500
    )
    outcome = run_virtual(upload_and_drain(executor))
    assert metrics.attempt_timeouts == 1
    assert outcome.latency_ms == pytest.approx(1000 + 500 + 10)
    assert (outcome.path, outcome.attempts) == ("obj-2", 2)
    assert fake.calls[0].end == pytest.approx(1.0)
    assert fake.outcomes() == ["cancelled", "ok"]
    assert fake.objects == {"obj-2": b"payload"}  # the timed-out attempt's object was deleted


@store_variants
def test_all_attempts_failing_fails_the_upload(store_first: bool) -> None:
    executor, fake, metrics = make(
        [("fail", 0.01), ("hang",)], store_first=store_first, max_attempts=2, upload_timeout_ms=1000
    )

    async def scenario() -> tuple[UploadFailedError, float]:
        with pytest.raises(UploadFailedError) as info:
            await executor.upload(b"payload")
        failed_at = virtual_now()
        await executor.drain()
        return info.value, failed_at

    error, failed_at = run_virtual(scenario())
    message = str(error)
    assert "after 2 attempts" in message
    assert "attempt 1: OSError: scripted failure of obj-1 (raised after 10 ms)" in message
    assert "attempt 2: no answer within 1000 ms" in message
    assert message.startswith("upload of a changelog file (7 bytes) failed")
    assert message.endswith("objects tried, deleted in the background: obj-1, obj-2")
    # The last attempt timing out fails the upload at its timeout (FLINK-26396 hung instead).
    assert failed_at == pytest.approx(0.01 + 0.5 + 1.0)
    assert fake.outcomes() == ["failed", "cancelled"]
    assert fake.objects == {}
    assert sorted(fake.deleted) == ["obj-1", "obj-2"]
    assert metrics.upload_failures == 1
    assert metrics.attempt_timeouts == 1
    assert metrics.upload_latencies_ms.count == 0
    assert list(metrics.attempts_per_upload.samples) == [2]


@store_variants
def test_timed_out_single_attempt_fails_the_upload(store_first: bool) -> None:
    """FLINK-26396: a timed-out last attempt must fail the upload, not leave it pending."""
    executor, fake, metrics = make([("hang",)], store_first=store_first, max_attempts=1, upload_timeout_ms=2000)

    async def scenario() -> float:
        with pytest.raises(UploadFailedError, match=r"after 1 attempts \(attempt 1: no answer within 2000 ms\)"):
            await executor.upload(b"x")
        failed_at = virtual_now()
        await executor.drain()
        return failed_at

    assert run_virtual(scenario()) == 2.0
    assert fake.objects == {}
    assert (metrics.upload_failures, metrics.attempt_timeouts, metrics.retries) == (1, 1, 0)


def test_a_timeout_error_the_uploader_raises_is_not_the_attempt_deadline() -> None:
    """The uploader gives up by itself after 50 ms, far within the 1 s deadline: the error says
    what it raised and when; it is no attempt timeout."""
    executor, _, metrics = make([("timeout", 0.05), ("timeout", 0.05)], max_attempts=2, upload_timeout_ms=1000)

    async def scenario() -> str:
        with pytest.raises(UploadFailedError) as info:
            await executor.upload(b"payload")
        await executor.drain()
        return str(info.value)

    message = run_virtual(scenario())
    assert "attempt 1: TimeoutError: scripted socket timeout of obj-1 (raised after 50 ms)" in message
    assert "attempt 2: TimeoutError: scripted socket timeout of obj-2 (raised after 50 ms)" in message
    assert "no answer" not in message
    assert metrics.attempt_timeouts == 0


@store_variants
def test_hedges_count_as_attempts(store_first: bool) -> None:
    executor, fake, metrics = make(
        [("hang",), ("fail", 0.05)],
        store_first=store_first,
        hedging=hedge_policy(),
        max_attempts=2,
        upload_timeout_ms=1000,
    )

    async def scenario() -> tuple[str, float]:
        with pytest.raises(UploadFailedError) as info:
            await executor.upload(b"payload")
        failed_at = virtual_now()
        await executor.drain()
        return str(info.value), failed_at

    message, failed_at = run_virtual(scenario())
    assert len(fake.calls) == 2  # the script has no 3rd step: a 3rd put would fail the test loudly
    assert [c.start for c in fake.calls] == pytest.approx([0.0, 0.1])
    assert failed_at == pytest.approx(1.0)  # when the primary timed out; no retry after that
    assert "after 2 attempts" in message
    # Causes are named by attempt number, not by the order in which they failed.
    assert "attempt 1: no answer within 1000 ms" in message
    assert "attempt 2: OSError: scripted failure of obj-2 (raised after 50 ms)" in message
    assert (metrics.hedges, metrics.retries, metrics.upload_attempts) == (1, 0, 2)
    assert metrics.upload_failures == 1
    assert fake.objects == {}


@store_variants
def test_cancelling_the_upload_cancels_attempts_and_cleans_up(store_first: bool) -> None:
    executor, fake, metrics = make(
        [("hang",), ("hang",)], store_first=store_first, hedging=hedge_policy(), upload_timeout_ms=30_000
    )

    async def scenario() -> None:
        task = asyncio.ensure_future(executor.upload(b"payload"))
        await elapse(0.5)
        assert fake.outcomes() == ["running", "running"]  # primary and its hedge
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await executor.drain()
        assert virtual_now() == 0.5

    run_virtual(scenario())
    assert fake.outcomes() == ["cancelled", "cancelled"]
    assert fake.objects == {}
    assert sorted(fake.deleted) == ["obj-1", "obj-2"]
    assert metrics.upload_failures == 0  # cancelled, not failed
    assert metrics.upload_latencies_ms.count == 0


def test_cancelling_the_upload_during_retry_backoff_cleans_up() -> None:
    executor, fake, metrics = make([("fail", 0.01), OK_FAST], store_first=True, retry_delay_ms=500)

    async def scenario() -> None:
        task = asyncio.ensure_future(executor.upload(b"payload"))
        await elapse(0.2)  # the first attempt failed at 0.01, the retry waits until 0.51
        assert fake.objects == {"obj-1": b"payload"}
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await executor.drain()

    run_virtual(scenario())
    assert len(fake.calls) == 1
    assert fake.objects == {}
    assert metrics.retries == 0


def test_adaptive_hedge_delay_in_the_executor() -> None:
    """After ``min_samples`` uploads the hedge fires at the observed percentile, not the initial delay."""
    policy = hedge_policy(initial_delay_ms=1000, min_samples=5, percentile=0.5, window=5)
    executor, fake, metrics = make([], hedging=policy, upload_timeout_ms=30_000)

    async def scenario() -> UploadOutcome:
        for _ in range(5):
            fake.load([("ok", 0.2)])
            await upload_and_drain(executor)
        assert executor.hedge_delay.current() == 0.2
        fake.load([("ok", 10.0), OK_FAST])
        return await upload_and_drain(executor)

    outcome = run_virtual(scenario())
    assert outcome.hedge_won
    assert outcome.latency_ms == pytest.approx(200 + 50)
    assert metrics.hedges == 1


def test_second_hedge_wins_when_the_primary_and_the_first_hedge_are_both_slow() -> None:
    policy = hedge_policy(initial_delay_ms=5000, min_samples=4, window=4, percentile=0.5, second_percentile=0.9)
    # store_first: a cancelled attempt has written its object, which must be deleted.
    executor, fake, metrics = make([], hedging=policy, upload_timeout_ms=30_000, store_first=True)

    async def scenario() -> UploadOutcome:
        for latency in (0.1, 0.2, 0.3, 0.4):
            fake.load([("ok", latency)])
            await upload_and_drain(executor)
        assert executor.hedge_delay.delays() == pytest.approx([0.3, 0.4])  # sorted window, int(q * 4)
        fake.load([("ok", 10.0), ("ok", 10.0), OK_FAST])
        return await upload_and_drain(executor)

    outcome = run_virtual(scenario())
    assert outcome.hedge_won and outcome.attempts == 3
    assert outcome.latency_ms == pytest.approx(400 + 50)
    assert metrics.hedges == 2 and metrics.hedges_won == 1
    losers = {c.path for c in fake.calls[4:]} - {outcome.path}
    assert len(losers) == 2 and losers <= set(fake.deleted)
    assert set(fake.objects) == {c.path for c in fake.calls[:4]} | {outcome.path}


def test_hedge_timers_that_fall_due_while_nothing_runs_start_nothing() -> None:
    """The primary failed and the retry waits out its backoff: both hedge timers pass unused."""
    policy = hedge_policy(initial_delay_ms=5000, min_samples=4, window=4, percentile=0.5, second_percentile=0.9)
    executor, fake, metrics = make([], hedging=policy, upload_timeout_ms=30_000, retry_delay_ms=1000)

    async def scenario() -> UploadOutcome:
        for latency in (0.1, 0.2, 0.3, 0.4):
            fake.load([("ok", latency)])
            await upload_and_drain(executor)
        fake.load([("fail", 0.01), OK_FAST])
        return await upload_and_drain(executor)

    before = Counters(metrics)
    outcome = run_virtual(scenario())
    assert outcome.attempts == 2 and not outcome.hedged
    assert metrics.hedges == before.hedges and metrics.retries - before.retries == 1
    assert outcome.latency_ms == pytest.approx(10 + 1000 + 50)


def test_a_stalled_loop_starts_one_hedge_not_both_at_once() -> None:
    policy = hedge_policy(initial_delay_ms=5000, min_samples=4, window=4, percentile=0.5, second_percentile=0.9)
    executor, fake, metrics = make([], hedging=policy, upload_timeout_ms=30_000)

    async def scenario() -> None:
        for latency in (0.1, 0.2, 0.3, 0.4):
            fake.load([("ok", latency)])
            await upload_and_drain(executor)
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)

        async def stall() -> None:  # the loop is busy from 0.25 s to 0.75 s: both timers pass
            await elapse(0.25)
            loop.advance(0.5)

        stalled = asyncio.ensure_future(stall())
        fake.load([("ok", 2.0), ("ok", 2.0), ("ok", 2.0)])
        await upload_and_drain(executor)
        await stalled

    run_virtual(scenario())
    assert metrics.hedges == 1 and len(fake.calls) == 4 + 2


def test_no_second_hedge_once_an_attempt_finished_or_without_samples_or_room() -> None:
    delay = HedgeDelay(HedgingPolicy(initial_delay_ms=700, min_samples=3, percentile=0.5, second_percentile=0.9))
    assert delay.delays() == [0.7]  # no latency seen yet: no estimate for a second hedge
    for value in (0.2, 0.2, 0.2):
        delay.observe(value)
    assert delay.delays() == [0.2]  # the second percentile is no later than the first
    delay.observe(5.0)
    assert delay.delays() == [0.2, 5.0]
    no_second = HedgeDelay(HedgingPolicy(min_samples=1, percentile=0.5, second_percentile=None))
    for value in (0.1, 0.2, 0.3):
        no_second.observe(value)
    assert no_second.delays() == [0.2]
    # max_attempts 2: the first hedge uses the last attempt, the second timer starts nothing.
    policy = hedge_policy(initial_delay_ms=5000, min_samples=2, window=2, percentile=0.4, second_percentile=0.9)
    executor, fake, metrics = make([], hedging=policy, upload_timeout_ms=30_000, max_attempts=2)

    async def scenario() -> UploadOutcome:
        for latency in (0.1, 0.3):
            fake.load([("ok", latency)])
            await upload_and_drain(executor)
        before = metrics.hedges
        fake.load([("ok", 1.0), ("ok", 1.0)])
        outcome = await upload_and_drain(executor)
        assert metrics.hedges - before == 1
        return outcome

    assert run_virtual(scenario()).attempts == 2


@pytest.mark.parametrize("second", [0.0, -0.5, 1.0, 1.5])
def test_second_percentile_must_be_a_quantile(second: float) -> None:
    with pytest.raises(ValueError, match="second_percentile"):
        HedgingPolicy(second_percentile=second)
    # At or below the first percentile it is allowed: the second hedge never lies beyond the first.
    delay = HedgeDelay(HedgingPolicy(min_samples=1, percentile=0.99, second_percentile=0.5))
    for value in (0.1, 0.2, 0.3):
        delay.observe(value)
    assert delay.delays() == [0.3]


def test_hedge_delay_samples_only_primary_attempts() -> None:
    """A retry that wins after the primary failed is no primary latency (it includes the backoff)."""
    policy = hedge_policy(initial_delay_ms=1000, min_samples=2, percentile=0.5, window=10)
    executor, _, _ = make([("fail", 0.01), ("ok", 0.01)], hedging=policy, retry_delay_ms=500)

    run_virtual(upload_and_drain(executor))
    # Only the failed primary's 0.01 s was observed: one sample, below min_samples.
    assert executor.hedge_delay.current() == 1.0
    executor.hedge_delay.observe(0.3)
    assert executor.hedge_delay.current() == 0.3  # sorted [0.01, 0.3], index int(0.5 * 2) == 1
