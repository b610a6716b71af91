"""The one retry policy: uploads and every other DFS call back off alike and differ in their deadline.

The README documents one ``retry_delay_ms`` "doubled per failure" and one ``max_attempts`` for
uploads and for every other DFS call, each attempt cut at ``upload_timeout_ms`` or
``dfs_timeout_ms``: both loops (``dstl.hedging`` and ``dstl.retry.call_with_retries``) take their
numbers from a ``RetryPolicy`` built from the configuration.
"""

from __future__ import annotations

import pytest

from dstl import ChangelogConfig
from dstl.retry import RetryPolicy


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
