"""A call run in a thread of its own, its outcome kept for the test to check once it has joined.

Why: tests of races (two jobs claiming one directory, a call held by a fault while another goes on)
start the held side in a thread and must see what it returned or raised, not lose an exception in
a thread's default hook."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``call`` in a daemon thread; the dict gets ``"result"`` or ``"error"`` when it ends."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome
