"""The README's demo and example must keep working: they are what a new user runs first."""

from __future__ import annotations

from pathlib import Path

from backend.demo import run as backend_demo
from backend.example import main as backend_example
from dstl.demo import run as log_demo


def test_log_demo_restores_the_recomputed_state_at_another_parallelism(tmp_path: Path) -> None:
    assert log_demo(tmp_path, events=3_000, checkpoint_every=500)


def test_backend_demo_survives_sigkill_and_rescale(tmp_path: Path) -> None:
    assert backend_demo(tmp_path, 6_000, 1_000)
    assert list((tmp_path / "dfs" / "demo-job").glob("chk-*/_metadata"))


def test_backend_example_restores_and_carries_on() -> None:
    assert backend_example()
