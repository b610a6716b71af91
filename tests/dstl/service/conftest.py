"""Fixtures of the changelog service tests: short socket directories, services and clients that
never outlive their test (``harness``), and a bucket of the session's moto server with a fault
proxy in front of it (``s3``). Every client is closed and every service process the test started
is stopped (SIGTERM, then SIGKILL) at teardown. The helpers are in ``harness.py``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.support.s3_server import S3Server
from tests.dstl.service.harness import Harness, S3Env
from tests.support.s3 import faulted_bucket


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short private directory for sockets (AF_UNIX paths are limited to 107 bytes)."""
    base = "/tmp" if os.path.isdir("/tmp") else None
    directory = Path(tempfile.mkdtemp(prefix="dsv-", dir=base))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def harness(socket_dir: Path) -> Iterator[Harness]:
    h = Harness(socket_dir)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def s3(moto_server: S3Server) -> Iterator[S3Env]:
    with faulted_bucket(moto_server, "svc", under="job1") as (bucket, proxy, plan):
        yield S3Env(moto_server.endpoint_url, bucket, proxy, plan)
