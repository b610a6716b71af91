"""Waiting for a condition that another thread or process brings about and exposes no event for
(a service's state, a storage loop's counters): poll it, with a deadline that fails the test."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
