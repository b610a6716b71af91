"""The S3 tests' side of the moto server: one server per test session, a fresh bucket per test.

The server itself (moto's S3 application on 127.0.0.1, port 0, in a child process) is
``benchmarks.support.s3_server``, which the benchmarks use too; the ``moto_server`` fixture
(``tests/conftest.py``) starts it on first use and stops it when the session ends. Tests share it
and never share a bucket: each makes its own (``new_bucket``), so no test sees another's objects.
Faults are injected by ``benchmarks.support.fault_proxy`` in front of the server
(``faulted_bucket``), never by patching our own code.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

from benchmarks.support.fault_plan import FaultPlan
from benchmarks.support.fault_proxy import FaultProxy
from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, create_bucket

__all__ = ["botocore_client", "faulted_bucket", "new_bucket"]


def new_bucket(server: S3Server, prefix: str) -> str:
    """A new, empty bucket named ``<prefix>-<20 random hex digits>``."""
    name = f"{prefix}-{uuid.uuid4().hex[:20]}"
    create_bucket(server.endpoint_url, name)
    return name


def botocore_client(endpoint_url: str) -> Any:
    """Plain (synchronous) botocore on ``endpoint_url``: what a test reads or writes around the code
    under test, e.g. what is really stored. Creating one costs more than a test's requests: share it."""
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )


@contextlib.contextmanager
def faulted_bucket(server: S3Server, prefix: str, under: str = "") -> Iterator[tuple[str, FaultProxy, FaultPlan]]:
    """A new bucket, a fault proxy in front of the server and the proxy's plan, whose rules apply
    to the paths under ``<bucket>/<under>``; the plan is closed at the end (no stall outlives it)."""
    bucket = new_bucket(server, prefix)
    plan = FaultPlan()
    with FaultProxy(server.endpoint_url, plan, base=f"{bucket}/{under}" if under else bucket) as proxy:
        try:
            yield bucket, proxy, plan
        finally:
            plan.close()
