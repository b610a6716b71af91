"""A ``LocalJob`` on S3: the moto server (``tests.support.s3``) behind a fault proxy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.job import LocalJob
from benchmarks.support.fault_plan import FaultPlan
from benchmarks.support.fault_proxy import FaultProxy
from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY
from dstl import ChangelogConfig, S3Options
from tests.backend.checkpointing.workloads import make_job


@dataclass
class S3Root:
    """A bucket holding the job directory ``job``, the proxy in front of it and the proxy's plan."""

    bucket: str
    proxy: FaultProxy
    plan: FaultPlan
    direct: Any  # plain botocore talking to moto itself: what is really stored

    @property
    def root(self) -> str:
        return f"s3://{self.bucket}"

    def changelog(self) -> ChangelogConfig:
        """The storage settings of a job on the proxy: each DFS call gets 2 s per attempt
        (botocore's read timeout is longer, so the deadline is what gives up on a request the proxy
        holds) and 3 attempts."""
        s3 = S3Options(
            endpoint_url=self.proxy.url,
            region=REGION,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            read_timeout_ms=10_000,
        )
        return ChangelogConfig(base_path=self.root, s3=s3, dfs_timeout_ms=2000, max_attempts=3, retry_delay_ms=10)

    def job(self, local: Path) -> LocalJob:
        """A job on the proxy (``changelog``)."""
        return make_job(self.root, local, changelog=self.changelog())

    def stored(self, prefix: str = "job/") -> set[str]:
        """The keys under ``prefix``, relative to the job directory, read from moto directly."""
        pages = self.direct.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return {obj["Key"].removeprefix("job/") for page in pages for obj in page.get("Contents", [])}
