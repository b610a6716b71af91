"""The one retry policy: uploads and every other DFS call back off alike and differ in their deadline.

The README documents one ``retry_delay_ms`` "doubled per failure" and one ``max_attempts`` for
uploads and for every other DFS call, each attempt cut at ``upload_timeout_ms`` or
``dfs_timeout_ms``: both loops (``dstl.hedging`` and ``dstl.retry.call_with_retries``) take their
numbers from a ``RetryPolicy`` built from the configuration; ``read_with_retries`` is the same
loop for a ranged read waited for on the caller's thread (the faults of a real store through it:
``test_deadlines``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from dstl import ChangelogConfig
from dstl.errors import DeadlineExceededError, StorageError
from dstl.retry import RetryPolicy, read_with_retries


@pytest.fixture
def config() -> ChangelogConfig:
    return ChangelogConfig(
        base_path="memory://retry-policy",
        upload_timeout_ms=1_500,
        dfs_timeout_ms=40_000,
        retry_delay_ms=250,
        max_attempts=4,
    )


def test_uploads_and_other_calls_share_the_backoff_and_the_bound(config: ChangelogConfig) -> None:
    uploads, calls = RetryPolicy.for_uploads(config), RetryPolicy.for_calls(config)
    assert [uploads.delay_after(n) for n in (1, 2, 3)] == [0.25, 0.5, 1.0]
    assert [calls.delay_after(n) for n in (1, 2, 3)] == [0.25, 0.5, 1.0]
    assert uploads.attempts == calls.attempts == 4


def test_each_kind_of_call_has_its_own_deadline_per_attempt(config: ChangelogConfig) -> None:
    uploads, calls = RetryPolicy.for_uploads(config), RetryPolicy.for_calls(config)
    assert [uploads.timeout_for(n) for n in (1, 4)] == [1.5, 1.5]
    assert [calls.timeout_for(n) for n in (1, 4)] == [40.0, 40.0]


def test_no_delay_configured_means_immediate_retries() -> None:
    policy = RetryPolicy.for_calls(ChangelogConfig(base_path="memory://retry-policy", retry_delay_ms=0))
    assert policy.delay_after(1) == policy.delay_after(5) == 0.0


# -- the same loop for a read that blocks in a pool, waited for on the caller's thread ----------


def _pool_calls(*outcomes: BaseException | bytes | threading.Event) -> tuple[ThreadPoolExecutor, Any]:
    """A pool and a ``submit`` whose n-th call runs the n-th outcome: raise it, return it, or wait
    for the event (a stalled read)."""
    pool = ThreadPoolExecutor(2)
    calls = iter(outcomes)

    def run(outcome: BaseException | bytes | threading.Event) -> bytes:
        if isinstance(outcome, BaseException):
            raise outcome
        if isinstance(outcome, threading.Event):
            outcome.wait()
            return b"too late"
        return outcome

    return pool, lambda: pool.submit(run, next(calls))


def test_a_blocking_read_is_retried_and_names_every_attempt() -> None:
    pool, submit = _pool_calls(OSError("disk said no"), b"data")
    try:
        assert read_with_retries(RetryPolicy(30, 2, 0), "read", "dfs/a", submit) == b"data"
        pool2, submit2 = _pool_calls(OSError("one"), OSError("two"))
        with pytest.raises(StorageError) as exc_info:
            read_with_retries(RetryPolicy(30, 2, 0), "read", "dfs/a", submit2)
        pool2.shutdown()
        assert not isinstance(exc_info.value, DeadlineExceededError)
        message = str(exc_info.value)
        assert "read dfs/a failed after 2 attempt(s)" in message
        assert "attempt 1: OSError: one" in message and "attempt 2: OSError: two" in message
    finally:
        pool.shutdown()


def test_a_stalled_blocking_read_fails_at_its_deadline_and_a_timeout_it_raises_is_its_own() -> None:
    stalled = threading.Event()
    pool, submit = _pool_calls(stalled, TimeoutError("socket timed out"))
    try:
        with pytest.raises(StorageError) as exc_info:
            read_with_retries(RetryPolicy(0.05, 2, 0), "read", "dfs/a", submit)
        message = str(exc_info.value)
        assert "attempt 1: no answer within 50 ms" in message
        assert "attempt 2: TimeoutError: socket timed out" in message  # raised by the client: not the deadline
        assert not isinstance(exc_info.value, DeadlineExceededError)
    finally:
        stalled.set()
        pool.shutdown()


def test_a_blocking_read_stops_at_the_callers_timeout_and_leaves_missing_files_unretried() -> None:
    stalled = threading.Event()
    pool, submit = _pool_calls(stalled, FileNotFoundError("dfs/b"))
    try:
        with pytest.raises(TimeoutError, match=r"caller's 0\.05 s"):
            read_with_retries(RetryPolicy(60, 3, 0), "read", "dfs/a", submit, timeout=0.05)
        with pytest.raises(FileNotFoundError):
            read_with_retries(RetryPolicy(60, 3, 0), "read", "dfs/b", submit)
    finally:
        stalled.set()
        pool.shutdown()


def test_a_blocking_read_failing_fast_stops_at_the_callers_timeout_not_after_its_backoff() -> None:
    """The caller's timeout bounds the backoff too, as ``StorageLoop.run``'s does: a read whose
    attempts fail at once does not sleep past it, nor start an attempt after it."""
    started: list[Future[bytes]] = []

    def refused() -> Future[bytes]:
        future: Future[bytes] = Future()
        started.append(future)
        future.set_exception(OSError("refused"))
        return future

    with pytest.raises(TimeoutError, match=r"caller's 0\.05 s .*attempt 1: OSError: refused"):
        read_with_retries(RetryPolicy(60, 3, 5), "read", "dfs/a", refused, timeout=0.05)
    assert len(started) == 1  # none started once the timeout was known to pass in the backoff
