"""The README's demo and example must keep working: they are what a new user runs first."""

from __future__ import annotations

from pathlib import Path

from backend.example import main as backend_example
from dstl.demo import run as log_demo


def test_log_demo_restores_the_recomputed_state_at_another_parallelism(tmp_path: Path) -> None:
    assert log_demo(tmp_path, events=3_000, checkpoint_every=500)


def test_backend_example_restores_and_carries_on() -> None:
    assert backend_example()
