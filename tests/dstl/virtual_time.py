"""A virtual-time asyncio event loop for deterministic tests of timing logic.

``VirtualTimeLoop`` is a ``SelectorEventLoop`` whose ``time()`` is a virtual clock. Whenever an
iteration of the loop finds no ready callbacks but scheduled timers, the clock jumps straight to
the earliest (non-cancelled) timer, so ``asyncio.sleep(n)``, ``asyncio.timeout(1)`` and
``loop.call_later`` take no real time and fire in a deterministic order. Virtual time never moves
while callbacks run: code between two awaits takes zero virtual seconds.

Only for pure-asyncio code: no real I/O, no threads (``to_thread``, ``run_in_executor``), no
subprocesses. The selector is still polled, but always with timeout 0 once the clock has jumped,
so a result that would arrive from the outside world is simply never waited for. When nothing is
ready and no timer is pending, real code would block forever; here the loop raises
``VirtualTimeDeadlock`` instead of hanging the test run.

Implementation: overrides ``time()`` and ``_run_once``, relying on CPython's private
``BaseEventLoop._ready`` (deque of ready handles), ``_scheduled`` (heap of ``TimerHandle``) and
``_stopping``. The constructor asserts that they exist, so a Python version that renames them
fails loudly instead of silently running in real time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["VirtualTimeDeadlock", "VirtualTimeLoop", "run_virtual", "virtual_now"]


class VirtualTimeDeadlock(RuntimeError):
    """The loop has no ready callback and no pending timer: the awaited code can never finish."""


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        for attr in ("_ready", "_scheduled", "_stopping", "_run_once"):
            assert hasattr(self, attr), (
                f"VirtualTimeLoop relies on CPython's private BaseEventLoop.{attr}, which this Python lacks"
            )
        self._virtual_now = float(start)
        #: number of clock jumps, for tests that want to see that time did advance
        self.jumps = 0

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by hand (timers that become due run at the next iteration)."""
        if seconds < 0:
            raise ValueError("virtual time cannot go backwards")
        self._virtual_now += seconds

    def _run_once(self) -> None:
        if not self._ready and not self._stopping:  # type: ignore[attr-defined]
            pending = [h.when() for h in self._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
            if not pending:
                raise VirtualTimeDeadlock(
                    "virtual-time loop deadlocked: no ready callbacks and no pending timers "
                    "(awaiting something that is never set, or real I/O / threads?)"
                )
            earliest = min(pending)
            if earliest > self._virtual_now:
                self._virtual_now = earliest
                self.jumps += 1
        super()._run_once()  # type: ignore[misc]


def run_virtual(coro: Coroutine[Any, Any, T], *, loop: VirtualTimeLoop | None = None) -> T:
    """Run ``coro`` to completion on a fresh ``VirtualTimeLoop`` (or the given one) and close it.

    Pass your own ``loop`` to assert on ``loop.time()`` afterwards (the clock stays readable after
    the loop is closed); inside the coroutine use ``virtual_now()`` or ``asyncio.get_running_loop().time()``.
    Like ``asyncio.run``: leftover tasks are cancelled and async generators finalized before closing.
    """
    the_loop = loop if loop is not None else VirtualTimeLoop()
    with asyncio.Runner(loop_factory=lambda: the_loop) as runner:
        return runner.run(coro)


def virtual_now() -> float:
    """The running virtual loop's clock (asserts that the running loop is a ``VirtualTimeLoop``)."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop), f"not running on a VirtualTimeLoop but {type(loop).__name__}"
    return loop.time()


async def elapse(seconds: float) -> None:
    """Let ``seconds`` of *virtual* time pass (on a ``VirtualTimeLoop`` this takes no real time):
    the scenario's clock, not a synchronization by waiting."""
    await asyncio.sleep(seconds)
