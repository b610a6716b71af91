"""Fault rules and the thread-safe plan that decides, call by call, which fault a DFS call gets.

One plan drives both fault layers: ``faulty_fs`` (an fsspec file system over a local directory)
and ``fault_proxy`` (an HTTP proxy in front of moto), so a test states its faults once, the same
way for either store. The plan only decides and keeps the books (rules, counters, the call log,
held "late" writes); each layer carries the fault out in its own terms.

Stalls wait on a ``_Gate`` rather than on the plan, so a stalled thread holds no reference to the
plan: when the test drops the plan, a finalizer closes the gate and the thread ends with an error.
``release()``, ``close()`` and a per-plan stall limit end stalls too: a stalled thread never
outlives its test (the default thread pool is joined at interpreter exit, so one that did would
hang the test process).
"""

from __future__ import annotations

import fnmatch
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "Fault", "FaultPlan", "Op", "StallEnded", "close_all_plans"]

Op = Literal["put", "get", "delete", "exists", "list", "*"]
Action = Literal["fail", "stall", "delay", "trickle", "late", "reset", "lag", "truncate"]

_OPS = ("put", "get", "delete", "exists", "list", "*")
_ACTIONS = ("fail", "stall", "delay", "trickle", "late", "reset", "lag", "truncate")
#: operations whose effect can be held back and landed later ("late")
_LATE_OPS = ("put", "delete")


class StallEnded(OSError):
    """A stalled or delayed call was ended because its plan was closed or hit its stall limit."""


@dataclass(frozen=True, eq=False)
class Fault:
    """One rule: which calls it hits (``op``, ``path`` glob, ``after``, ``times``) and what they get.

    ``path`` is an ``fnmatch`` glob on the path relative to the base (``*`` also matches ``/``).
    ``after`` matching calls pass untouched first, then ``times`` matching calls are hit (``None``:
    all of them). Every call that matches ``op`` and ``path`` counts towards ``after``, whichever
    rule ends up hitting it. ``lag`` (listings, ``faulty_fs`` only: the S3 proxy forwards them
    untouched) answers a listing without the entries matching the ``hide`` glob, as a store whose
    listing lags behind its writes. ``truncate`` (reads only) answers a read with the first half of
    its bytes and no error, as a misbehaving store or proxy that frames a short body as whole.
    ``error`` replaces the default ``OSError`` of ``fail`` (an exception
    instance or class; the file system raises it, the S3 proxy ignores it and answers 503).
    Rules compare by identity: adding an equal rule twice gives two independent rules.
    """

    op: Op
    path: str = "*"
    action: Action = "fail"
    times: int | None = None
    after: int = 0
    delay_s: float = 0.0
    bytes_per_s: float = 1024.0
    error: BaseException | type[BaseException] | None = None
    hide: str = "*"

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"unknown op {self.op!r}; expected one of {_OPS}")
        if self.action not in _ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; expected one of {_ACTIONS}")
        if self.times is not None and self.times < 0:
            raise ValueError(f"times must be >= 0 or None, got {self.times}")
        if self.after < 0:
            raise ValueError(f"after must be >= 0, got {self.after}")
        if self.action == "delay" and self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")
        if self.action == "trickle" and self.bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be > 0, got {self.bytes_per_s}")
        if self.action == "lag" and self.op != "list":
            raise ValueError(f"'lag' applies to listings only, not {self.op!r}")
        if self.action == "truncate" and self.op != "get":
            raise ValueError(f"'truncate' applies to reads only, not {self.op!r}")
        if self.action == "late" and self.op not in (*_LATE_OPS, "*"):
            raise ValueError(f"'late' applies to {_LATE_OPS} only, not {self.op!r}")

    def matches(self, op: str, path: str) -> bool:
        """Whether a call ``op`` on ``path`` (relative to the base) is one this rule counts."""
        if self.op != "*" and self.op != op:
            return False
        if self.action == "late" and op not in _LATE_OPS:
            return False
        return fnmatch.fnmatchcase(path, self.path)


class _Rule:
    """A fault with its counters; ``released`` stall rules no longer match."""

    __slots__ = ("fault", "hits", "released", "seen")

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.seen = 0
        self.hits = 0
        self.released = False


class _Gate:
    """What stalled and delayed calls wait on; closed when the plan is closed or collected."""

    def __init__(self, stall_limit_s: float) -> None:
        self.cond = threading.Condition()
        self.generation = 0  # bumped by every release()
        self.closed = False
        self.stalled = 0
        self.stall_limit_s = stall_limit_s

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def stall(self, what: str) -> None:
        """Block until ``release()``; raise ``StallEnded`` on close or after the stall limit."""
        deadline = time.monotonic() + self.stall_limit_s
        with self.cond:
            start = self.generation
            self.stalled += 1
            self.cond.notify_all()
            try:
                while self.generation == start and not self.closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StallEnded(f"injected stall of {what} ended by the stall limit")
                    self.cond.wait(left)
                if self.closed:
                    raise StallEnded(f"injected stall of {what} ended: fault plan closed")
            finally:
                self.stalled -= 1

    def sleep(self, seconds: float, what: str) -> None:
        """Sleep ``seconds`` (a delay or trickle pace); raise ``StallEnded`` if the plan closes."""
        deadline = time.monotonic() + seconds
        with self.cond:
            while not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)
            raise StallEnded(f"injected delay of {what} ended: fault plan closed")


_live_gates: weakref.WeakSet[_Gate] = weakref.WeakSet()
_live_lock = threading.Lock()


def close_all_plans() -> None:
    """Close every live plan's gate (a test teardown hook): no stall survives the test."""
    with _live_lock:
        gates = list(_live_gates)
    for gate in gates:
        gate.close()


class FaultPlan:
    """The rules of one test, the log of calls they saw, and the writes held back as "late".

    Thread-safe: both fault layers call ``decide`` from many threads. ``calls`` holds
    ``(op, path, outcome)``: the action's name when a rule hit the call (logged when the fault
    starts, so a stalled call is visible while it waits), otherwise ``"ok"`` or ``"error:<Type>"``
    once the real operation returned.
    """

    def __init__(self, stall_limit_s: float = 300.0) -> None:
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._late: list[tuple[str, str, Callable[[], None]]] = []
        self.calls: list[tuple[str, str, str]] = []
        self._gate = _Gate(stall_limit_s)
        with _live_lock:
            _live_gates.add(self._gate)
        weakref.finalize(self, self._gate.close)

    # --- rules -----------------------------------------------------------------------------
    def add(self, fault: Fault) -> Fault:
        """Append a rule (earlier rules win when several apply) and return it."""
        with self._lock:
            self._rules.append(_Rule(fault))
        return fault

    def remove(self, fault: Fault) -> None:
        """Drop a rule (a DFS that recovers); calls already hit are unaffected."""
        with self._lock:
            self._rules = [r for r in self._rules if r.fault is not fault]

    def clear(self) -> None:
        """Drop every rule: from now on every call passes (stalls in progress keep waiting)."""
        with self._lock:
            self._rules = []

    def hits(self, fault: Fault) -> int:
        """How many calls ``fault`` has hit so far."""
        with self._lock:
            return sum(r.hits for r in self._rules if r.fault is fault)

    def decide(self, op: str, path: str) -> Fault | None:
        """The fault this call gets (``None``: pass), counting it; logs hit calls."""
        with self._lock:
            chosen: Fault | None = None
            for rule in self._rules:
                fault = rule.fault
                if rule.released or not fault.matches(op, path):
                    continue
                rule.seen += 1
                if chosen is not None or rule.seen <= fault.after:
                    continue
                if fault.times is not None and rule.hits >= fault.times:
                    continue
                rule.hits += 1
                chosen = fault
            if chosen is not None:
                self.calls.append((op, path, chosen.action))
            return chosen

    def record(self, op: str, path: str, outcome: str) -> None:
        """Log a call that no rule hit, once its real outcome is known."""
        with self._lock:
            self.calls.append((op, path, outcome))

    def calls_of(self, op: str | None = None, outcome: str | None = None) -> list[str]:
        """The paths of logged calls, filtered by op and outcome (a convenience for asserts)."""
        with self._lock:
            return [p for o, p, out in self.calls if (op is None or o == op) and (outcome is None or out == outcome)]

    # --- stalls ----------------------------------------------------------------------------
    @property
    def gate(self) -> _Gate:
        """What a fault layer stalls and sleeps on (holds no reference back to the plan)."""
        return self._gate

    @property
    def stalled(self) -> int:
        """How many calls are stalled right now."""
        with self._gate.cond:
            return self._gate.stalled

    def wait_stalled(self, n: int = 1, timeout: float = 30.0) -> bool:
        """Wait until at least ``n`` calls are stalled at once; ``False`` on timeout."""
        with self._gate.cond:
            return self._gate.cond.wait_for(lambda: self._gate.stalled >= n, timeout)

    def release(self) -> None:
        """End every stall in progress (the calls then proceed) and retire every stall rule."""
        with self._lock:
            for rule in self._rules:
                if rule.fault.action == "stall":
                    rule.released = True
        with self._gate.cond:
            self._gate.generation += 1
            self._gate.cond.notify_all()

    def close(self) -> None:
        """End the plan: stalls and delays in progress fail with ``StallEnded``; idempotent."""
        self._gate.close()

    @property
    def closed(self) -> bool:
        return self._gate.closed

    # --- late writes -----------------------------------------------------------------------
    def hold_late(self, op: str, path: str, land: Callable[[], None]) -> None:
        """Keep an operation the client gave up on; ``land_late()`` performs it."""
        with self._lock:
            self._late.append((op, path, land))

    @property
    def pending_late(self) -> list[tuple[str, str]]:
        """``(op, path)`` of the held operations, oldest first."""
        with self._lock:
            return [(op, path) for op, path, _ in self._late]

    def land_late(self) -> int:
        """Perform the held "late" operations in the order they were held; returns how many."""
        with self._lock:
            late, self._late = self._late, []
        for op, path, land in late:
            land()
            self.record(op, path, "landed")
        return len(late)

    def __enter__(self) -> FaultPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
