"""One retry policy for every call on the DFS: a deadline per attempt, a doubling backoff, a bound.

After Flink's ``RetryPolicy`` and ``RetryingExecutor`` (``flink-dstl``): the policy answers two
questions, ``timeout_for(attempt)`` (how long attempt ``n`` may take) and ``delay_after(attempt)``
(how long to wait once attempt ``n`` failed), and the loops that use it stay where their
state lives. There are two such loops: log uploads (``dstl.hedging``, which also hedges) and
every other DFS call (``call_with_retries`` here: whole-file reads and writes of checkpoints and
chunks, ranged reads of log files, existence checks, listings, deletions; ``read_with_retries``,
the same loop for a ranged read that blocks in a thread pool of the uploader's own and is waited
for from the caller's thread, not the storage's loop). Both take their
numbers from a ``RetryPolicy`` built from the ``ChangelogConfig``: ``for_uploads`` (deadline
``upload_timeout_ms``) and ``for_calls`` (deadline ``dfs_timeout_ms``); ``max_attempts`` and
``retry_delay_ms`` are shared, so the backoff formula exists once.

Why every call has a deadline: a call bounded only by the client's socket timeouts can be held
for ever by a trickling or stalled store, and a raw client exception (a botocore
``ClientError``, an ``OSError``) names neither the object nor what was tried. Here each attempt is
cut at its deadline (the uploader abandons it: on S3 the request is dropped, on fsspec the thread
finishes in the background and the caller goes on), a failed attempt is retried after
``delay_after`` up to ``attempts``, and the final failure is a ``StorageError``
(``DeadlineExceededError`` when the last attempt ran out of time) naming the operation, the
object and every attempt: what each one raised and after how long (``describe_attempt``), or that
it got no answer within the deadline. A ``TimeoutError`` the client raises itself (a socket
timeout, an ``ETIMEDOUT``) is an error it raised, not the deadline: it is named as such.

Not retried, because retrying cannot change them: a missing object (``FileNotFoundError``, which
callers test for and which is re-raised as it is) and a path refused by the confinement checks
(``ConfigurationError``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from dstl.config import ChangelogConfig
from dstl.errors import ConfigurationError, DeadlineExceededError, StorageClosedError, StorageError

__all__ = ["RetryPolicy", "call_with_retries", "describe_attempt", "read_with_retries"]

T = TypeVar("T")


class RetryPolicy:
    """The deadline and retries of one kind of DFS call, in the loop's unit (seconds). Derived
    from the ``ChangelogConfig`` once per use (``for_uploads``, ``for_calls``), not an options class
    of its own (so not a dataclass: the README's options reference lists what users set)."""

    __slots__ = ("attempts", "retry_delay_s", "timeout_s")

    def __init__(self, timeout_s: float, attempts: int, retry_delay_s: float) -> None:
        #: the deadline of every attempt
        self.timeout_s = timeout_s
        #: attempts in all (hedges of an upload count as attempts)
        self.attempts = attempts
        #: the wait after the first failed attempt; doubled after each further one
        self.retry_delay_s = retry_delay_s

    @classmethod
    def for_uploads(cls, config: ChangelogConfig) -> RetryPolicy:
        """Log uploads: each attempt has ``upload_timeout_ms``."""
        return cls(config.upload_timeout_ms / 1000, config.max_attempts, config.retry_delay_ms / 1000)

    @classmethod
    def for_calls(cls, config: ChangelogConfig) -> RetryPolicy:
        """Every other DFS call: each attempt has ``dfs_timeout_ms``."""
        return cls(config.dfs_timeout_ms / 1000, config.max_attempts, config.retry_delay_ms / 1000)

    def timeout_for(self, attempt: int) -> float:
        """The deadline of attempt ``attempt`` (1-based), in seconds."""
        return self.timeout_s

    def delay_after(self, attempt: int) -> float:
        """The wait once the ``attempt``-th attempt (1-based) failed, before the next one starts."""
        return self.retry_delay_s * 2.0 ** (attempt - 1)


async def call_with_retries(policy: RetryPolicy, op: str, what: str, call: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``await call()`` with a deadline per attempt and retries; ``op`` and ``what`` name it in errors."""
    causes: list[str] = []
    timed_out = False
    loop = asyncio.get_running_loop()
    for attempt in range(1, policy.attempts + 1):
        if attempt > 1:
            await asyncio.sleep(policy.delay_after(attempt - 1))
        timeout = policy.timeout_for(attempt)
        deadline = asyncio.timeout(timeout)
        start = loop.time()
        try:
            async with deadline:
                return await call()
        except (FileNotFoundError, ConfigurationError):
            raise
        except Exception as exc:  # any client error: retried, then named in the StorageError
            timed_out = deadline.expired()
            if timed_out:
                causes.append(f"attempt {attempt}: no answer within {timeout * 1000:g} ms")
            else:
                causes.append(f"attempt {attempt}: {describe_attempt(exc, loop.time() - start)}")
    raise _gave_up(policy, op, what, causes, timed_out)


def read_with_retries(
    policy: RetryPolicy,
    op: str,
    what: str,
    submit: Callable[[], concurrent.futures.Future[T]],
    timeout: float | None = None,
) -> T:
    """``call_with_retries`` for a call that ``submit`` starts in a thread pool, waited for on the
    caller's thread: the same deadline per attempt (an attempt past it is abandoned: its thread
    finishes in the background), backoff, errors and exceptions not retried. ``timeout`` bounds
    the caller's whole wait on top, as ``StorageLoop.run``'s does (``TimeoutError``)."""
    causes: list[str] = []
    timed_out = False
    give_up = None if timeout is None else time.monotonic() + timeout
    for attempt in range(1, policy.attempts + 1):
        if attempt > 1:  # the backoff, as ``asyncio.sleep`` above, but never past the caller's timeout
            delay = policy.delay_after(attempt - 1)
            if give_up is not None and time.monotonic() + delay >= give_up:
                time.sleep(max(give_up - time.monotonic(), 0.0))
                raise TimeoutError(f"{op} {what}: no answer within the caller's {timeout} s ({'; '.join(causes)})")
            time.sleep(delay)
        deadline = policy.timeout_for(attempt)
        wait = deadline if give_up is None else min(deadline, give_up - time.monotonic())
        start = time.monotonic()
        try:
            future = submit()
        except StorageClosedError as exc:  # named as any other failure: the operation and the object
            raise StorageClosedError(f"{op} {what}: {exc}") from None
        if not concurrent.futures.wait([future], max(wait, 0.0)).done:
            future.cancel()  # not started yet: never starts; running: left to finish
            if give_up is not None and time.monotonic() >= give_up:
                raise TimeoutError(f"{op} {what}: no answer within the caller's {timeout} s")
            timed_out = True
            causes.append(f"attempt {attempt}: no answer within {deadline * 1000:g} ms")
            continue
        try:
            return future.result()
        except (FileNotFoundError, ConfigurationError):
            raise
        except Exception as exc:  # any client error (a TimeoutError it raised too): retried, then named
            timed_out = False
            causes.append(f"attempt {attempt}: {describe_attempt(exc, time.monotonic() - start)}")
    raise _gave_up(policy, op, what, causes, timed_out)


def _gave_up(policy: RetryPolicy, op: str, what: str, causes: list[str], timed_out: bool) -> StorageError:
    """The error of a call whose every attempt failed: ``DeadlineExceededError`` when the last one
    ran out of time, naming the operation, the object and each attempt."""
    error = DeadlineExceededError if timed_out else StorageError
    return error(f"{op} {what} failed after {policy.attempts} attempt(s): {'; '.join(causes)}")


def describe_attempt(exc: BaseException, elapsed_s: float) -> str:
    """What an attempt raised and after how long: ``"OSError: refused (raised after 12 ms)"``."""
    raised = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return f"{raised} (raised after {elapsed_s * 1000:.0f} ms)"
