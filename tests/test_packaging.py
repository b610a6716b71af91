"""The wheel works on its own: built from the checkout, installed in a fresh venv, run from elsewhere.

The development venv imports the checkout through an editable install, so nothing else shows
whether the wheel holds every module (a package without ``__init__.py``, a module importing
``tests``). The fresh venv sees the current environment's third-party packages through a ``.pth``
line (a plain path: the editable install's own ``.pth`` finder in that directory is not run), and
hides matplotlib and uvloop, which only the ``bench`` extra installs, so the benchmark runs as it
would after ``pip install .[test]``. Every command runs with its working directory outside the
checkout and checks that the imported code is the wheel's.

The hedging benchmark's quick mode makes about two thousand paced uploads: this test takes a few
minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
PACKAGES = ("dstl", "backend", "materializer", "benchmarks")
HIDDEN = ("matplotlib", "uvloop")  # the bench extra: not installed by CI's `pip install .[test]`


def run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def build_wheel(tmp_path: Path) -> Path:
    """Build from a copy of the sources, so no stale ``build/`` of the checkout leaks into the wheel."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PACKAGES:
        shutil.copytree(CHECKOUT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(CHECKOUT / name, src / name)
    out = tmp_path / "wheel"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    # Build isolation, as `python -m build` does: the build backend comes from [build-system]
    # requires, not from whatever setuptools the test environment has (without `wheel`, older
    # ones cannot build a wheel at all).
    run([*pip, "wheel", "--no-deps", "-w", str(out), str(src)], tmp_path, 300)
    (wheel,) = out.glob("dstl_state_backend-*.whl")
    return wheel


def fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, 120)
    python = venv / "bin" / "python"
    purelib = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    outer = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    (purelib / "outer_environment.pth").write_text("".join(f"{p}\n" for p in sorted(outer)))
    for name in HIDDEN:  # found before the outer site-packages, which come last on sys.path
        (purelib / name).mkdir()
        (purelib / name / "__init__.py").write_text(f"raise ImportError('{name}: hidden by test_packaging')\n")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    # --ignore-installed: the outer editable install's metadata is visible through the .pth line
    run([*pip, "install", "--no-deps", "--no-index", "--ignore-installed", str(wheel)], tmp_path, 300)
    return venv


def test_the_wheel_runs_the_cli_and_the_hedging_benchmark_outside_the_checkout(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    venv = fresh_venv(tmp_path, wheel)
    python, elsewhere = str(venv / "bin" / "python"), tmp_path / "elsewhere"
    elsewhere.mkdir()

    where = json.loads(
        run(
            [python, "-c", f"import json, sys, {', '.join(PACKAGES)}; "
             f"print(json.dumps([sys.path, [m.__file__ for m in ({', '.join(PACKAGES)})]]))"],
            elsewhere, 60,
        ).stdout
    )  # fmt: skip
    sys_path, files = where
    assert all(Path(f).is_relative_to(venv) for f in files), files
    assert CHECKOUT not in {Path(p).resolve() for p in sys_path if p}, sys_path

    usage = run([str(venv / "bin" / "dstl"), "--help"], elsewhere, 60).stdout
    assert "usage: dstl" in usage and "checkpoints" in usage

    result = elsewhere / "hedging.json"
    run([python, "-m", "benchmarks", "hedging", "--quick", "--json", str(result)], elsewhere, 900)
    report = json.loads(result.read_text())
    assert report["benchmark"] == "hedging" and report["quick"] is True
    assert report["metrics"]["uploads_per_mode"] > 0
    assert report["plots"] == []  # matplotlib is hidden: no plot, no failure
