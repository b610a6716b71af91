"""The virtual-time loop (``tests.dstl.virtual_time``) the retry/hedge tests run on: timers fire in
order without real waiting, and a deadlock is reported instead of hanging.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.dstl.virtual_time import VirtualTimeDeadlock, VirtualTimeLoop, run_virtual, virtual_now

# --- the virtual clock itself -------------------------------------------------------------------


def test_virtual_clock_jumps_to_timers_in_order_without_real_waiting() -> None:
    order: list[tuple[str, float]] = []

    async def sleeper(name: str, delay: float) -> None:
        await asyncio.sleep(delay)
        order.append((name, virtual_now()))

    async def scenario() -> None:
        await asyncio.gather(sleeper("a", 500.0), sleeper("b", 1.0), sleeper("c", 3.0))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                await asyncio.Event().wait()
        order.append(("timeout", virtual_now()))

    loop = VirtualTimeLoop()
    real_start = time.monotonic()
    run_virtual(scenario(), loop=loop)
    assert time.monotonic() - real_start < 5.0
    assert order == [("b", 1.0), ("c", 3.0), ("a", 500.0), ("timeout", 501.0)]
    assert loop.time() == 501.0 and loop.is_closed()


def test_virtual_clock_reports_a_deadlock_instead_of_hanging() -> None:
    with pytest.raises(VirtualTimeDeadlock):
        run_virtual(asyncio.Event().wait())
