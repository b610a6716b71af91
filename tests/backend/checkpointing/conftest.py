"""Fixtures of the checkpointing tests on S3: ``s3``, a job directory in a new bucket of the
session's moto server behind a fault proxy, and ``direct``, plain botocore on moto itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.support.s3_server import S3Server
from tests.backend.checkpointing.s3_root import S3Root
from tests.support.s3 import botocore_client, faulted_bucket


@pytest.fixture(scope="module")
def direct(moto_server: S3Server) -> Any:
    """Plain botocore talking to moto itself (creating a client costs more than a test's requests)."""
    return botocore_client(moto_server.endpoint_url)


@pytest.fixture
def s3(moto_server: S3Server, direct: Any) -> Iterator[S3Root]:
    with faulted_bucket(moto_server, "commit") as (bucket, proxy, plan):
        yield S3Root(bucket, proxy, plan, direct)
