"""One DFS call with a deadline per attempt and the log uploads' retry policy, failing as ``StorageError``.

Log uploads have their state machine (``dstl.hedging``); every other call on the DFS (whole-file
reads and writes of checkpoints and chunks, ranged reads of log files, existence checks, listings,
deletions) goes through ``call_with_retries``. Why one place: a call that is bounded only by the
client's socket timeouts can be held for ever by a trickling or stalled store, and a raw client
exception (a botocore ``ClientError``, an ``OSError``) names neither the object nor what was
tried. Here each attempt is cut at ``dfs_timeout_ms`` (the uploader abandons it: on S3 the
request is dropped, on fsspec the thread finishes in the background and the caller goes on), a
failed attempt is retried after ``retry_delay_ms * 2**(failures-1)`` up to ``max_attempts``, and
the final failure is a ``StorageError`` (``DeadlineExceededError`` when the last attempt ran out
of time) naming the operation, the object and every attempt: what each one raised and after how
long, or that it got no answer within the deadline. A ``TimeoutError`` the client raises itself
(a socket timeout, an ``ETIMEDOUT``) is an error it raised, not the deadline: it is named as such.

Not retried, because retrying cannot change them: a missing object (``FileNotFoundError``, which
callers test for and which is re-raised as it is) and a path refused by the confinement checks
(``ConfigurationError``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from dstl.config import ChangelogConfig
from dstl.errors import ConfigurationError, DeadlineExceededError, StorageError

__all__ = ["CallPolicy", "call_with_retries"]

T = TypeVar("T")


class CallPolicy:
    """The deadline and retries of a DFS call, in the loop's unit (seconds). Derived from the
    ``ChangelogConfig`` once per storage, not an options class of its own."""

    __slots__ = ("attempts", "retry_delay_s", "timeout_s")

    def __init__(self, timeout_s: float, attempts: int, retry_delay_s: float) -> None:
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.retry_delay_s = retry_delay_s

    @classmethod
    def of(cls, config: ChangelogConfig) -> CallPolicy:
        return cls(config.dfs_timeout_ms / 1000, config.max_attempts, config.retry_delay_ms / 1000)


async def call_with_retries(policy: CallPolicy, op: str, what: str, call: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``await call()`` with a deadline per attempt and retries; ``op`` and ``what`` name it in errors."""
    causes: list[str] = []
    timed_out = False
    loop = asyncio.get_running_loop()
    for attempt in range(1, policy.attempts + 1):
        if attempt > 1:
            await asyncio.sleep(policy.retry_delay_s * 2 ** (attempt - 2))
        deadline = asyncio.timeout(policy.timeout_s)
        start = loop.time()
        try:
            async with deadline:
                return await call()
        except (FileNotFoundError, ConfigurationError):
            raise
        except Exception as exc:  # any client error: retried, then named in the StorageError
            timed_out = deadline.expired()
            if timed_out:
                causes.append(f"attempt {attempt}: no answer within {policy.timeout_s * 1000:g} ms")
            else:
                raised = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                causes.append(f"attempt {attempt}: {raised} (raised after {(loop.time() - start) * 1000:.0f} ms)")
    error = DeadlineExceededError if timed_out else StorageError
    raise error(f"{op} {what} failed after {policy.attempts} attempt(s): {'; '.join(causes)}")
