"""Running the crash child (``tests.support.checkpoint_crash_child``): a ``LocalJob`` in a child
process that kills itself with SIGKILL at the ``k``-th occurrence of a step of the checkpoint
protocol; the parent checks that it died by SIGKILL (and not of anything else)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checkpoint_crash_child import NOT_REACHED, PARALLELISM

PROJECT_ROOT = Path(__file__).resolve().parents[3]
CHILD_TIMEOUT_S = 120.0


def run_child(root: Path, local: Path, *args: object) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tests.support.checkpoint_crash_child", str(root), str(local), *map(str, args)]
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    return subprocess.run(
        cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False
    )


def crash(root: Path, local: Path, step: str, k: int, num_retained: int, parallelism: int = PARALLELISM) -> None:
    proc = run_child(root, local, step, k, num_retained, parallelism)
    if proc.returncode == NOT_REACHED:
        pytest.fail(f"the child never reached its crash step: {proc.stderr}")
    assert proc.returncode == -signal.SIGKILL, f"child exited with {proc.returncode}: {proc.stderr}"
