"""The layer contract of pyproject.toml ([tool.importlinter]) holds: imports point one way, no cycles.

A test rather than only a lint step so that the README's test command (what CI runs) enforces it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports not installed (the test extra installs import-linter)"
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout
