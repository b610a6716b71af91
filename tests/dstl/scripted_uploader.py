"""A scripted in-memory ``Uploader`` and the ``UploadExecutor`` it drives, for the retry/hedge tests.

``ScriptedUploader`` takes the behaviour of each ``put`` from a script: ``("ok", latency)`` sleeps
then stores, ``("fail", latency)`` sleeps then raises ``OSError``, ``("timeout", latency)`` sleeps
then raises ``TimeoutError`` (the uploader's own, as a socket timeout), ``("hang",)`` never
returns. With ``store_first=True`` every put stores its object *before* sleeping, like a request
whose bytes reached the store although the caller gave up on it: a cancelled, failed or timed-out
attempt then leaves an object that the executor must delete. ``make`` builds an executor over one;
run it on the virtual-time loop (``tests.dstl.virtual_time``). ``Counters`` copies the integer
counters of the metrics, to compare before and after an upload.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from dstl.config import ChangelogConfig, HedgingPolicy
from dstl.hedging import UploadExecutor, UploadOutcome
from dstl.metrics import ChangelogMetrics
from tests.dstl.virtual_time import virtual_now

Step = tuple[str, float] | tuple[str]

OK_FAST: Step = ("ok", 0.05)


@dataclass
class Call:
    path: str
    step: Step
    start: float
    end: float | None = None
    #: running | ok | failed | cancelled (cancelled covers per-attempt timeouts, hedge losers, aborts)
    outcome: str = "running"


class ScriptedUploader:
    """In-memory ``Uploader`` whose ``put`` calls follow a script, in call order."""

    def __init__(self, script: Sequence[Step] = (), *, store_first: bool = False) -> None:
        self.store_first = store_first
        self.calls: list[Call] = []
        self.objects: dict[str, bytes] = {}
        self.deleted: list[str] = []
        self._script: list[Step] = []
        self._offset = 0
        self.load(script)

    def load(self, script: Sequence[Step]) -> None:
        """Script the calls from now on (the next ``put`` takes ``script[0]``)."""
        self._script = list(script)
        self._offset = len(self.calls)

    async def put(self, path: str, data: bytes) -> None:
        index = len(self.calls) - self._offset
        assert index < len(self._script), f"put #{index + 1} of {path!r} is not scripted: {self._script}"
        step = self._script[index]
        call = Call(path=path, step=step, start=virtual_now())
        self.calls.append(call)
        assert path not in self.objects, f"executor reused object name {path!r}"
        if self.store_first:
            self.objects[path] = data
        try:
            if step[0] == "hang":
                await asyncio.Event().wait()
            else:
                assert step[0] in ("ok", "fail", "timeout"), step
                await asyncio.sleep(step[1])  # type: ignore[misc]
        except asyncio.CancelledError:
            call.end, call.outcome = virtual_now(), "cancelled"
            raise
        call.end = virtual_now()
        if step[0] == "fail":
            call.outcome = "failed"
            raise OSError(f"scripted failure of {path}")
        if step[0] == "timeout":
            call.outcome = "failed"
            raise TimeoutError(f"scripted socket timeout of {path}")
        self.objects[path] = data
        call.outcome = "ok"

    async def get(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.objects[path]
        return data[offset:] if length is None else data[offset : offset + length]

    async def delete(self, path: str) -> None:
        self.deleted.append(path)
        self.objects.pop(path, None)

    def remove_empty_directory(self, path: str) -> bool:
        return True  # a dict has no directories

    async def list(self, prefix: str = "") -> builtins.list[str]:
        return sorted(p for p in self.objects if p.startswith(prefix))

    async def close(self) -> None:
        return None

    def outcomes(self) -> builtins.list[str]:
        return [c.outcome for c in self.calls]


def counter_names() -> Callable[[], str]:
    counter = itertools.count(1)
    return lambda: f"obj-{next(counter)}"


def make(
    script: Sequence[Step],
    *,
    store_first: bool = False,
    hedging: HedgingPolicy | None = None,
    **config: object,
) -> tuple[UploadExecutor, ScriptedUploader, ChangelogMetrics]:
    fake = ScriptedUploader(script, store_first=store_first)
    metrics = ChangelogMetrics()
    cfg = ChangelogConfig(
        base_path="memory://unused",
        hedging=hedging if hedging is not None else HedgingPolicy.disabled(),
        **config,  # type: ignore[arg-type]
    )
    return UploadExecutor(fake, cfg, metrics, name_factory=counter_names()), fake, metrics


def hedge_policy(**overrides: object) -> HedgingPolicy:
    """Hedging at 100 ms (before any sample is seen) with plenty of budget."""
    settings_: dict[str, object] = {"initial_delay_ms": 100, "budget": 1.0, "burst": 10.0}
    settings_.update(overrides)
    return HedgingPolicy(**settings_)  # type: ignore[arg-type]


async def upload_and_drain(executor: UploadExecutor, data: bytes = b"payload") -> UploadOutcome:
    outcome = await executor.upload(data)
    await executor.drain()
    return outcome


class Counters:
    """The integer counters of ``metrics`` at one moment."""

    def __init__(self, metrics: ChangelogMetrics) -> None:
        self.__dict__.update({k: v for k, v in vars(metrics).items() if type(v) is int})

    def __getattr__(self, name: str) -> int:
        raise AttributeError(name)


store_variants = pytest.mark.parametrize("store_first", [False, True], ids=["store-after", "store-first"])
