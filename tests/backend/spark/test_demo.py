"""The README's command 1 (the Spark demo) must pass: on the embedded default (a local directory),
against an S3 endpoint given by flag (the session's moto server) and on a multi-executor master
(``--master local-cluster[2,1,1024]``). Each run is a fresh Python process (the demo starts and
SIGKILLs its own Spark drivers). Its output is for people: no stack trace, no ERROR line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, list_keys
from tests.support.s3 import new_bucket

pytestmark = pytest.mark.spark
pytest.importorskip("pyspark")
ROOT = Path(__file__).resolve().parents[3]  # the checkout: tests/backend/spark/ -> .


def run_demo(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> str:
    """The demo's stdout; its stdout and stderr (the JVMs write there) carry no stack trace or ERROR."""
    result = subprocess.run(
        [sys.executable, "-m", "backend.spark.demo", "--dir", str(tmp_path), "--batches", "6", "--kill-after", "3",
         *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    both = result.stdout + result.stderr
    assert "Traceback" not in both, both[-5000:]
    assert not re.findall(r"^.*\bERROR\b.*$", both, re.M), both[-5000:]
    return result.stdout


def test_demo_passes_on_a_local_directory(tmp_path: Path) -> None:
    out = run_demo(tmp_path)
    assert "killing the driver (SIGKILL)" in out
    assert "PASS" in out and "FAIL" not in out
    assert list((tmp_path / "state").glob("chk-*/_metadata"))


def test_demo_passes_against_s3(tmp_path: Path, moto_server: S3Server) -> None:
    bucket = new_bucket(moto_server, "demo")
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
               AWS_DEFAULT_REGION=REGION)  # fmt: skip
    out = run_demo(tmp_path, "--s3", f"s3://{bucket}/state", "--s3-endpoint", moto_server.endpoint_url, env=env)
    keys = list_keys(moto_server.endpoint_url, bucket, "state/")
    assert "PASS" in out
    assert any(k.endswith("/_metadata") for k in keys)
    assert any("/pending/" in k and k.endswith(".dstl") for k in keys)  # the log, the records in it
    assert not (tmp_path / "state").exists()


@pytest.mark.cluster
def test_demo_passes_on_a_local_cluster(tmp_path: Path) -> None:
    out = run_demo(tmp_path, "--master", "local-cluster[2,1,1024]")
    assert "2 executor JVMs" in out
    assert "killing the driver (SIGKILL)" in out
    assert "PASS" in out and "FAIL" not in out
    assert list((tmp_path / "executor-logs").glob("app-*/*/stderr"))  # moved out of Spark's home
