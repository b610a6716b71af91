"""Tasks of ``backend.spark`` that register timers, run without a Spark session: an operator config
on a local directory and a task body that fires the timers due and registers one (``timers_at``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backend.spark.config import OperatorConfig, Watermarks
from backend.state.timers import PROCESSING_TIME
from dstl import ChangelogConfig
from materializer.options import MaterializationOptions

KEYS = [(f"k{i}",) for i in range(20)]


def config(root: Path, parallelism: int = 2, **kw: Any) -> OperatorConfig:
    job = str(root / "state")
    return OperatorConfig(
        job_dir=job, uid="op", parallelism=parallelism, max_parallelism=128, local_root=str(root / "local"),
        changelog=ChangelogConfig(base_path=job), tasks=parallelism, changelog_service=False,
        materialization=MaterializationOptions(interval_ms=10**12), **kw,
    )  # fmt: skip


def timers_at(timestamp: int | None, domain: int = PROCESSING_TIME) -> Any:
    """A task body: fires the processing-time timers due at the batch's time, then gives the first
    key of the subtask a timer at ``timestamp`` (None: no timer); records the watermarks it ran with."""
    seen: list[Watermarks | None] = []

    def process(backend: Any, now: int, watermarks: Watermarks | None) -> list[Any]:
        seen.append(watermarks)
        backend.advance_processing_time(now, lambda key, ts: None)
        if timestamp is not None:
            key = next(k for k in KEYS if backend.key_group_of(k) in backend.key_group_range)
            backend.set_current_key(key)
            backend.timers.register(domain, timestamp)
        return []

    process.seen = seen  # type: ignore[attr-defined]
    return process
