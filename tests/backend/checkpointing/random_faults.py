"""Support of the randomized fault test: a fault plan that faults a random share of DFS calls, a
meter of every checkpoint-path DFS call's duration against its deadline, and the run's tally.

Why a plan of its own: ``FaultPlan`` rules pick calls by count and glob, which suits a test of one
defect; a random test wants "about this share of every call, of any kind", whatever the call
sequence turns out to be, decided by a seeded generator so an example can be run again.
The plan also models a crashed process: once ``dead``, every call of that process fails (a dead
process sends nothing more), and its stalls and delays end with the plan (``close``).
"""

from __future__ import annotations

import fnmatch
import functools
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from benchmarks.support.faulty_fs import Action, Fault, FaultPlan, Op
from dstl import ChangelogConfig
from dstl.errors import ChangelogError
from dstl.storage.files import RetryingDfsFiles

__all__ = ["DeadlineMeter", "RandomFaults", "Tally", "call_bound_s", "names_an_object"]

#: (action, weight) per operation; "late" and "trickle" exist only for the operations that carry
#: them (a held-back write or delete; a paced body)
_ACTIONS: dict[str, list[tuple[Action, float]]] = {
    "put": [("fail", 3), ("reset", 1), ("delay", 3), ("late", 1.5), ("trickle", 1), ("stall", 0.5)],
    "get": [("fail", 3), ("reset", 1), ("delay", 3), ("trickle", 1), ("stall", 0.5)],
    "delete": [("fail", 3), ("reset", 1), ("delay", 3), ("late", 1.5), ("stall", 0.5)],
    "exists": [("fail", 3), ("reset", 1), ("delay", 3), ("stall", 0.5)],
    "list": [("fail", 3), ("reset", 1), ("delay", 3), ("stall", 0.5)],
}
_OBJECT = re.compile(r"chk-\d+|_metadata|_aborted|dstl/|shared/|\.chunk|faulty://")


#: how long a stalled call waits when nothing abandons it: far past any call's bound (``call_bound_s``
#: with the tests' slack), so a call without a deadline is told apart from one slowed by a loaded host
STALL_LIMIT_S = 120.0


class RandomFaults(FaultPlan):
    """Faults ``rate`` of the calls (seeded), ``hot_rate`` of those whose path matches the glob
    ``hot`` (so that a part of the protocol fails often enough for its rarer paths to be taken:
    every attempt of a ``_metadata`` write failing, say), with actions weighted by ``_ACTIONS``.

    ``delay`` lasts either well under the per-attempt deadline or beyond it (the attempt is then
    abandoned and its thread lands the call later, as a slow store does); ``stall`` waits for the
    plan's end or ``stall_limit_s``. ``decided``/``injected`` count the calls of the live process.
    """

    def __init__(
        self,
        seed: int,
        rate: float,
        deadline_s: float,
        hot: str | None = None,
        hot_rate: float = 0.7,
        stall_limit_s: float = STALL_LIMIT_S,
    ) -> None:
        super().__init__(stall_limit_s=stall_limit_s)
        self.rng = random.Random(seed)
        self.rate = rate
        self.hot = hot
        self.hot_rate = hot_rate if rate > 0 else 0.0
        self.deadline_s = deadline_s
        self.dead = False
        self.decided = 0
        self.injected: Counter[str] = Counter()
        self._pick_lock = threading.Lock()

    def decide(self, op: str, path: str) -> Fault | None:
        with self._pick_lock:
            if self.dead:
                return Fault(cast(Op, op), action="fail", error=OSError("the process crashed: nothing reaches the DFS"))
            self.decided += 1
            hot = self.hot is not None and fnmatch.fnmatchcase(path, self.hot)
            if self.rng.random() >= (self.hot_rate if hot else self.rate):
                return None
            actions, weights = zip(*_ACTIONS[op], strict=True)
            action = self.rng.choices(actions, weights)[0]
            fault = Fault(
                cast(Op, op),
                action=action,
                delay_s=self.rng.choice([0.02, 0.3 * self.deadline_s, 1.5 * self.deadline_s, 3 * self.deadline_s]),
                bytes_per_s=self.rng.choice([20_000.0, 200_000.0]),
            )
            self.injected[action] += 1
        self.calls.append((op, path, action))
        return fault

    def crash(self) -> None:
        """The process is gone: its later calls fail, its stalled and delayed calls end."""
        with self._pick_lock:
            self.dead = True
        self.close()


def call_bound_s(config: ChangelogConfig, slack_s: float) -> float:
    """The most one DFS call may take: every attempt to its deadline, the backoff between, slack."""
    attempts = config.max_attempts
    backoff = config.retry_delay_ms / 1000 * float(2 ** (attempts - 1) - 1)
    return attempts * config.dfs_timeout_ms / 1000 + backoff + slack_s


def names_an_object(exc: BaseException) -> bool:
    """Whether an error's message (or its cause's) names a file or directory of the job."""
    text = f"{exc} {exc.__cause__ or ''}"
    return _OBJECT.search(text) is not None


@dataclass
class DeadlineMeter:
    """Times every blocking DFS call of a storage's files (``RetryingDfsFiles``: ``put``, ``get``,
    ``read_range``, ``read_ranges``, ``delete``, ``list``) while ``installed``; ``late`` lists those past
    ``bound_s``. It wraps the class's methods for the test's duration: it measures, changes nothing."""

    bound_s: float
    calls: int = 0
    late: list[str] = field(default_factory=list)
    slowest_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    _METHODS = ("put", "get", "read_range", "read_ranges", "delete", "list")

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(files: RetryingDfsFiles, *args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return method(files, *args, **kwargs)
            finally:
                elapsed = time.monotonic() - start
                with self._lock:
                    self.calls += 1
                    self.slowest_s = max(self.slowest_s, elapsed)
                    if elapsed > self.bound_s:
                        self.late.append(f"{name}{args[:1]} took {elapsed:.2f} s > {self.bound_s:.2f} s")

        return timed

    @contextmanager
    def installed(self) -> Iterator[DeadlineMeter]:
        originals = {name: getattr(RetryingDfsFiles, name) for name in self._METHODS}
        try:
            for name, method in originals.items():
                setattr(RetryingDfsFiles, name, self._timed(name, method))
            yield self
        finally:
            for name, method in originals.items():
                setattr(RetryingDfsFiles, name, method)


@dataclass
class Tally:
    """What the examples did, summed over the run; ``problems`` must stay empty."""

    examples: int = 0
    checkpoint_attempts: int = 0
    #: of ``checkpoint_attempts``, those on a healed DFS (the last one of each example's final checks)
    checkpoints_healed: int = 0
    #: failed checkpoints by what their error said of the commit
    failure_kinds: Counter[str] = field(default_factory=Counter)
    checkpoints_completed: int = 0
    checkpoints_failed: int = 0
    crashes: int = 0
    crashes_in_protocol: int = 0
    restarts: int = 0
    restarts_failed: int = 0
    materializations: int = 0
    dfs_calls: int = 0
    healthy_calls: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    late_landed: int = 0
    resumed_uncertain: int = 0
    states_checked: int = 0
    operations_timed: int = 0
    slowest_operation_s: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def add_plan(self, plan: RandomFaults) -> None:
        """Count a plan's calls: under faults, or on the healed DFS of the final checks (apart)."""
        if plan.rate == 0:
            self.healthy_calls += plan.decided
            return
        self.dfs_calls += plan.decided
        self.faults.update(plan.injected)

    def checkpoint_failed(self, exc: BaseException) -> None:
        """Count a failed checkpoint by what its error says of the commit."""
        self.checkpoints_failed += 1
        text = str(exc)
        for kind in ("outcome unknown", "fenced by", "fence could not be written", "does not exist", "deleted with"):
            if kind in text:
                self.failure_kinds[f"{type(exc).__name__}: {kind}"] += 1
                break
        else:
            self.failure_kinds[type(exc).__name__] += 1
        self.failed("checkpoint", exc)

    def failed(self, where: str, exc: BaseException) -> None:
        """Count a failure; one that is not the project's error naming the object is a problem."""
        self.errors[type(exc).__name__] += 1
        if not isinstance(exc, ChangelogError):
            self.problems.append(f"{where}: not a ChangelogError: {type(exc).__name__}: {exc}")
        elif not names_an_object(exc):
            self.problems.append(f"{where}: {type(exc).__name__} names no object: {exc}")

    def summary(self, call_meter: DeadlineMeter) -> str:
        injected = sum(self.faults.values())
        fraction = injected / self.dfs_calls if self.dfs_calls else 0.0
        wrong = sum(1 for p in self.problems if p.startswith("state"))
        return "\n".join(
            [
                "randomized fault run:",
                f"  examples                      {self.examples}",
                f"  checkpoint attempts           {self.checkpoint_attempts} "
                f"(under faults {self.checkpoint_attempts - self.checkpoints_healed}, on a healed DFS "
                f"{self.checkpoints_healed}; completed {self.checkpoints_completed}, failed {self.checkpoints_failed}, "
                f"cut by a crash {self.crashes_in_protocol})",
                f"  checkpoint failures by kind   {dict(sorted(self.failure_kinds.items()))}",
                f"  DFS calls under faults        {self.dfs_calls} (attempts; on a healed DFS: {self.healthy_calls})",
                f"  faults injected               {injected} ({fraction:.1%}) {dict(sorted(self.faults.items()))}",
                f"  late writes/deletes landed    {self.late_landed}",
                f"  materializations              {self.materializations}",
                f"  crashes                       {self.crashes} (inside the checkpoint protocol: "
                f"{self.crashes_in_protocol})",
                f"  restarts                      {self.restarts} (failed under faults and retried: "
                f"{self.restarts_failed})",
                f"  restored states checked       {self.states_checked}",
                f"  lost or wrong states          {wrong}",
                f"  resumed a checkpoint reported failed with outcome unknown (documented) {self.resumed_uncertain}",
                f"  DFS calls timed               {call_meter.calls} (slowest {call_meter.slowest_s:.2f} s, "
                f"bound {call_meter.bound_s:.2f} s)",
                f"  calls past their deadline     {len(call_meter.late)}",
                f"  operations timed              {self.operations_timed} (slowest {self.slowest_operation_s:.2f} s)",
                f"  errors seen                   {dict(sorted(self.errors.items()))}",
                f"  problems                      {len(self.problems)}",
                *(f"    {p}" for p in self.problems[:20]),
            ]
        )
