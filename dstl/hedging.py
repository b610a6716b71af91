"""Uploading one file: per-attempt timeouts, retries with backoff, request hedging, cleanup.

The state machine, for one upload (every attempt writes its *own* object name, so that the loser
of a hedge can be deleted without touching the winner's object):

1. Start attempt 1. Arm the hedge timers at the current hedge delays (adaptive percentiles of
   recent primary-attempt latencies, see ``HedgeDelay``; the second one only once enough
   latencies were seen and where it lies beyond the first).
2. First successful attempt wins: the others are cancelled, and every other object name that was
   tried is deleted in the background once those attempts have ended (a cancelled or timed-out
   request may still have written).
3. A hedge timer fires while an attempt runs: if attempts remain and the budget has a token,
   start one more attempt (the running ones keep running; the first to finish wins).
4. An attempt fails (error, or its per-attempt timeout): when nothing else is running and
   attempts remain, start another one after the policy's ``delay_after(failures)``
   (``dstl.retry``: ``retry_delay_ms`` doubled per failure, as every DFS call). When no attempt
   remains, the upload fails at once with ``UploadFailedError`` and every object tried is deleted
   in the background (``drain`` waits for that); a
   timed-out *last* attempt fails the upload too (Flink's FLINK-26396 did not).

Those deletions go to ``discard``: a storage passes its retried, counted background deletion
(``dstl.storage.files.RetryingDfsFiles.discard``), so a loser whose DELETE is refused is retried,
and if it never goes, counted and listed with the other files left to the orphan scan. An executor
used alone (tests, benchmarks) deletes each loser once, best effort.

Hedges count as attempts (``max_attempts`` bounds the load one upload can cause). Time comes from
the running loop's clock only, so tests drive the whole machine on a virtual-time loop.

Latency samples for the hedge delay come from primary attempts only: a primary cancelled because
a hedge won contributes its elapsed time, a lower bound that lies above the first hedge's delay,
so the first percentile is not biased towards the fast hedges that won. The second percentile
is: such bounds (about the first delay plus a hedge's latency) often lie below the true p99, so
the second hedge starts a little earlier than its percentile says; the budget still caps how
many hedges there are.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dstl.config import ChangelogConfig, HedgingPolicy
from dstl.errors import AttemptFailed, AttemptTimedOut, UploadFailedError
from dstl.metrics import ChangelogMetrics
from dstl.retry import RetryPolicy, describe_attempt
from dstl.uploaders.base import Uploader


class HedgeDelay:
    """The ``percentile`` of a sliding window of latencies, clamped to the policy's bounds.

    It works in seconds, the unit of the loop's clock it is fed from and armed on: the policy's
    millisecond bounds are converted once here.
    """

    def __init__(self, policy: HedgingPolicy) -> None:
        self._policy = policy
        self._initial = policy.initial_delay_ms / 1000
        self._min = policy.min_delay_ms / 1000
        self._max = policy.max_delay_ms / 1000
        self._window: deque[float] = deque()
        self._sorted: list[float] = []

    def observe(self, latency_s: float) -> None:
        if len(self._window) == self._policy.window:
            old = self._window.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._window.append(latency_s)
        bisect.insort(self._sorted, latency_s)

    def current(self) -> float:
        """The first hedge's delay."""
        p = self._policy
        value = self._initial if len(self._sorted) < p.min_samples else self._at(p.percentile)
        return min(self._max, max(self._min, value))

    def delays(self) -> list[float]:
        """The delays of the hedges to arm for a new upload, ascending."""
        first = self.current()
        p = self._policy
        if p.second_percentile is None or len(self._sorted) < p.min_samples:
            return [first]
        second = min(self._max, max(self._min, self._at(p.second_percentile)))
        # A second hedge right behind the first is one hedge more for the same wait.
        return [first, second] if second >= first + self._min else [first]

    def _at(self, percentile: float) -> float:
        return self._sorted[min(len(self._sorted) - 1, int(percentile * len(self._sorted)))]


class HedgeBudget:
    """Token bucket: each upload earns ``budget`` tokens (up to ``burst``); a hedge costs one.

    It starts empty, so hedges never exceed ``budget`` times the uploads so far.
    """

    def __init__(self, policy: HedgingPolicy) -> None:
        self._rate = policy.budget
        self._burst = max(1.0, policy.burst)
        self.tokens = 0.0

    def earn(self) -> None:
        self.tokens = min(self._burst, self.tokens + self._rate)

    def try_take(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass(frozen=True, slots=True)
class UploadOutcome:
    path: str
    attempts: int
    hedged: bool
    hedge_won: bool
    latency_ms: float


class UploadExecutor:
    """Runs uploads through one ``Uploader`` with the retry/hedge state machine above."""

    def __init__(
        self,
        uploader: Uploader,
        config: ChangelogConfig,
        metrics: ChangelogMetrics,
        name_factory: Callable[[], str],
        discard: Callable[[str], None] | None = None,
    ) -> None:
        """``discard(path)`` deletes a losing attempt's object in the background (on the loop)."""
        self._uploader = uploader
        self._discard = discard
        self._config = config
        self._metrics = metrics
        self._new_name = name_factory
        self.hedge_delay = HedgeDelay(config.hedging)
        self.budget = HedgeBudget(config.hedging)
        #: each attempt's deadline (``upload_timeout_ms``), the backoff and the bound on attempts
        self.retry = RetryPolicy.for_uploads(config)
        self._cleanups: set[asyncio.Task[None]] = set()

    async def _attempt(self, path: str, data: bytes, attempt: int) -> None:
        timeout = self.retry.timeout_for(attempt)
        deadline = asyncio.timeout(timeout)
        start = asyncio.get_running_loop().time()
        try:
            async with deadline:
                await self._uploader.put(path, data)
        except TimeoutError as exc:
            if deadline.expired():
                raise AttemptTimedOut(f"no answer within {timeout * 1000:g} ms") from None
            raise _raised_after(exc, start) from exc
        except Exception as exc:
            raise _raised_after(exc, start) from exc

    async def upload(self, data: bytes, name: str | None = None) -> UploadOutcome:
        """Upload ``data`` to a new name per attempt, or, given ``name``, every attempt to that one
        (a file readers find by listing its directory must never appear twice: its attempts
        write the same bytes over each other, and there are no losers to delete)."""
        loop = asyncio.get_running_loop()
        metrics, policy, retry = self._metrics, self._config.hedging, self.retry
        start = loop.time()
        self.budget.earn()
        metrics.upload_requests += 1
        running: dict[asyncio.Task[None], str] = {}
        tried: list[str] = []
        errors: list[tuple[int, BaseException]] = []
        primary: asyncio.Task[None] | None = None
        hedge_times = [start + d for d in self.hedge_delay.delays()] if policy.enabled else []
        retry_at: float | None = None
        hedged = False
        hedge_tasks: set[asyncio.Task[None]] = set()

        def launch() -> asyncio.Task[None]:
            path = name or self._new_name()
            tried.append(path)
            task = asyncio.ensure_future(self._attempt(path, data, len(tried)))
            running[task] = path
            metrics.upload_attempts += 1
            return task

        primary = launch()
        try:
            while running or retry_at is not None:
                wakeups = [t for t in (hedge_times[0] if hedge_times else None, retry_at) if t is not None]
                timeout = max(0.0, min(wakeups) - loop.time()) if wakeups else None
                if running:
                    done, _ = await asyncio.wait(running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(timeout or 0.0)
                    done = set()
                for task in done:
                    path = running.pop(task)
                    exc = task.exception()
                    if exc is None:
                        return self._won(task, path, primary, start, tried, running, hedged, hedge_tasks)
                    unpin(exc)
                    if isinstance(exc, AttemptTimedOut):
                        metrics.attempt_timeouts += 1
                    if task is primary and policy.enabled:
                        self.hedge_delay.observe(loop.time() - start)
                    errors.append((tried.index(path) + 1, exc))
                now = loop.time()
                if hedge_times and now >= hedge_times[0]:
                    while hedge_times and now >= hedge_times[0]:  # after a stalled loop: one hedge, not two at once
                        del hedge_times[0]
                    if running and len(tried) < retry.attempts:
                        if self.budget.try_take():
                            hedge_tasks.add(launch())
                            hedged = True
                            metrics.hedges += 1
                        else:
                            metrics.hedges_denied_by_budget += 1
                if retry_at is not None and now >= retry_at:
                    retry_at = None
                    launch()
                    metrics.retries += 1
                if not running and retry_at is None and len(tried) < retry.attempts:
                    retry_at = now + retry.delay_after(len(errors))
            metrics.upload_failures += 1
            metrics.attempts_per_upload.observe(len(tried))
            self._cleanup_later([], list(dict.fromkeys(tried)))  # off the failure path; drain() waits for it
            causes = "; ".join(f"attempt {i}: {_describe(e)}" for i, e in sorted(errors, key=lambda ie: ie[0]))
            raise UploadFailedError(
                f"upload of a changelog file ({len(data)} bytes) failed after {len(tried)} attempts ({causes}); "
                f"objects tried, deleted in the background: {', '.join(tried)}"
            )
        except asyncio.CancelledError:
            for task in running:
                task.cancel()
            self._cleanup_later(list(running), list(dict.fromkeys(tried)))
            raise

    def _won(
        self,
        winner: asyncio.Task[None],
        path: str,
        primary: asyncio.Task[None] | None,
        start: float,
        tried: list[str],
        running: dict[asyncio.Task[None], str],
        hedged: bool,
        hedge_tasks: set[asyncio.Task[None]],
    ) -> UploadOutcome:
        loop = asyncio.get_running_loop()
        latency = loop.time() - start
        if self._config.hedging.enabled and (winner is primary or primary in running):
            # The primary's latency, or a lower bound of it when a hedge won. (A primary that
            # failed was sampled then; a retry's latency includes the backoff and is no sample.)
            self.hedge_delay.observe(latency)
        for task in running:
            task.cancel()
        losers = [p for p in tried if p != path]
        if losers:
            self._cleanup_later(list(running), losers)
        hedge_won = winner in hedge_tasks
        metrics = self._metrics
        metrics.hedges_won += hedge_won
        latency_ms = latency * 1000
        metrics.upload_latencies_ms.observe(latency_ms)
        metrics.attempts_per_upload.observe(len(tried))
        return UploadOutcome(path=path, attempts=len(tried), hedged=hedged, hedge_won=hedge_won, latency_ms=latency_ms)

    def _cleanup_later(self, tasks: list[asyncio.Task[None]], paths: list[str]) -> None:
        async def cleanup() -> None:
            if tasks:
                await asyncio.wait(tasks)
                for task in tasks:
                    try:
                        task.result()
                    except BaseException as exc:  # cancelled: its frames still hold the file
                        unpin(exc)
            await self._delete_all(paths)

        self.track(asyncio.ensure_future(cleanup()))

    def track(self, task: asyncio.Task[None]) -> None:
        """Keep a background deletion alive until done; ``drain`` waits for all of them."""
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _delete_all(self, paths: list[str]) -> None:
        if self._discard is not None:
            for path in paths:
                self._discard(path)
            return
        for path in paths:
            # Best effort (an executor used alone): the orphan cleanup removes what remains.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(max(self.retry.timeout_for(1), 5.0)):
                    await self._uploader.delete(path)
                self._metrics.deleted_orphans += 1

    def when_released(self, data: bytes, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the uploader holds ``data`` no more: at once, unless a write of
        it still runs in a thread after its attempt gave up (``FsspecUploader.when_released``);
        then later, from that thread."""
        hook: Callable[[bytes, Callable[[], None]], None] | None = getattr(self._uploader, "when_released", None)
        if hook is None:
            callback()
        else:
            hook(data, callback)

    async def drain(self) -> None:
        """Wait for background deletions of losers (used on close and by tests)."""
        while self._cleanups:
            await asyncio.wait(list(self._cleanups))


def unpin(exc: BaseException) -> None:
    """Drop the locals of the finished frames in ``exc``'s tracebacks, its causes' included.

    An attempt's error outlives the attempt (in the upload's error list, in a task, in a
    reference cycle through a timeout's task that only the cyclic collector frees), and its
    frames hold the file being uploaded: a failed or timed-out attempt would keep the encoded file
    alive after its upload gave up, outside every byte count."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [e for e in (error.__cause__, error.__context__) if e is not None]


def _raised_after(exc: BaseException, start: float) -> AttemptFailed:
    return AttemptFailed(describe_attempt(exc, asyncio.get_running_loop().time() - start))


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, (AttemptTimedOut, AttemptFailed)) else f"{type(exc).__name__}: {exc}"
