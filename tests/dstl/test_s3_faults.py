"""Checkpoint-path calls over S3 have a deadline and retries and fail naming the object (issue 16,
defects 7 and 8), with the faults injected over HTTP by ``benchmarks.support.fault_proxy``.

``tests/dstl/test_deadlines.py`` proves the same on the ``faulty://`` file system; here the calls go
through aiobotocore to the moto server, so what is checked is also what botocore does with a
trickled body (each socket read is quick: its read timeout never fires), a 503 SlowDown and a
reset connection. One moto server serves the test session; each test gets its own bucket, proxy and plan.
``WAIT_S`` only bounds a hang: a passing test never waits that long.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from benchmarks.support.fault_plan import Fault, FaultPlan
from benchmarks.support.fault_proxy import FaultProxy
from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server
from dstl import ChangelogConfig, HedgingPolicy, S3Options, StateChangelogStorage
from dstl.errors import DeadlineExceededError, StorageError
from tests.support.s3 import faulted_bucket

pytestmark = pytest.mark.s3

WAIT_S = 30.0
PATH = "chk-1/_metadata"
Call = Callable[[StateChangelogStorage], Any]


@dataclass
class S3Env:
    """A bucket, the proxy in front of moto (its rules apply under ``<bucket>/job1``) and its plan."""

    bucket: str
    proxy: FaultProxy
    plan: FaultPlan
    storages: list[StateChangelogStorage]

    @property
    def base_path(self) -> str:
        return f"s3://{self.bucket}/job1"

    def storage(self, **overrides: Any) -> StateChangelogStorage:
        """A storage on the proxy: a read timeout of 2 s (botocore's), no hedging, quick retries.

        The deadline per attempt is generous (a loaded CI machine must not turn a slow answer into
        an extra attempt); the deadline tests pass their own short one."""
        options: dict[str, Any] = {
            "dfs_timeout_ms": 10_000,
            "max_attempts": 3,
            "retry_delay_ms": 1,
            "hedging": HedgingPolicy.disabled(),
        }
        options.update(overrides)
        s3 = S3Options(
            endpoint_url=self.proxy.url,
            region=REGION,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            read_timeout_ms=2000,
        )
        storage = StateChangelogStorage(ChangelogConfig(base_path=self.base_path, s3=s3, **options))
        self.storages.append(storage)
        return storage

    def calls_since(self, start: int, op: str) -> list[str]:
        """Outcomes of the ``op`` calls the proxy saw after the first ``start`` calls."""
        return [outcome for o, _, outcome in self.plan.calls[start:] if o == op]


@pytest.fixture
def s3(moto_server: S3Server) -> Iterator[S3Env]:
    with faulted_bucket(moto_server, "s3faults", under="job1") as (bucket, proxy, plan):
        env = S3Env(bucket, proxy, plan, [])
        try:
            yield env
        finally:
            plan.close()
            for storage in env.storages:
                storage.close()


# -- defect 7: a trickled whole-file read is cut at its deadline, not at the socket timeout -------


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("get", lambda s: s.files.get(PATH, timeout=WAIT_S)),
        ("read", lambda s: s.files.read_range(PATH, 0, 20_000, WAIT_S)),
    ],
    ids=["get", "read_range"],
)
def test_a_trickled_read_fails_at_its_deadline_naming_the_object(s3: S3Env, name: str, call: Call) -> None:
    """20 KB at 2,000 B/s would take 10 s per attempt; each attempt is cut at 500 ms."""
    storage = s3.storage(max_attempts=2, dfs_timeout_ms=500)
    payload = os.urandom(20_000)
    storage.files.put(PATH, payload)
    s3.plan.add(Fault(op="get", path=PATH, action="trickle", bytes_per_s=2_000))
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError) as exc_info:
        call(storage)
    elapsed = time.monotonic() - start
    message = str(exc_info.value)
    assert f"{name} {s3.base_path}/{PATH} failed after 2 attempt(s)" in message
    assert "attempt 2: no answer within 500 ms" in message
    assert s3.plan.calls_of("get") == [PATH, PATH]  # both attempts reached the store, both were trickled
    assert elapsed < 5.0, elapsed  # two deadlines and a backoff, far from one trickled body
    s3.plan.clear()
    assert storage.files.get(PATH) == payload  # the abandoned requests do not hold the storage


# -- defect 8: checkpoint-path calls are retried and fail as StorageError naming the object -------

CALLS: dict[str, tuple[str, Call]] = {
    "put": ("put", lambda s: s.files.put(PATH, b"meta-2")),
    "get": ("get", lambda s: s.files.get(PATH)),
    "read_range": ("get", lambda s: s.files.read_range(PATH, 0, 1)),  # the coordinator's existence check
    "delete": ("delete", lambda s: s.files.delete(PATH)),
    "list": ("list", lambda s: s.files.list("chk-1")),
}


@pytest.mark.parametrize(
    ("call_name", "action"),
    [(name, "fail") for name in CALLS] + [("put", "reset"), ("get", "reset")],
)
def test_a_slow_down_or_reset_on_a_checkpoint_path_is_retried(s3: S3Env, call_name: str, action: str) -> None:
    storage = s3.storage()
    storage.files.put(PATH, b"meta-1")
    op, call = CALLS[call_name]
    start = len(s3.plan.calls)
    s3.plan.add(Fault(op=op, path="chk-1*", action=action, times=2))  # type: ignore[arg-type]
    result = call(storage)
    assert s3.calls_since(start, op) == [action, action, "ok"]
    expected: dict[str, Any] = {"get": b"meta-1", "read_range": b"m", "list": [PATH]}
    assert result == expected.get(call_name)
    if call_name == "put":
        assert storage.files.get(PATH) == b"meta-2"
    elif call_name == "delete":
        assert storage.files.list("") == []


@pytest.mark.parametrize("call_name", ["put", "get"])
def test_a_path_answering_slow_down_every_time_raises_storage_error_naming_it(s3: S3Env, call_name: str) -> None:
    storage = s3.storage()
    storage.files.put(PATH, b"meta-1")
    op, call = CALLS[call_name]
    fault = s3.plan.add(Fault(op=op, path=PATH, action="fail"))  # type: ignore[arg-type]
    with pytest.raises(StorageError) as exc_info:
        call(storage)
    error = exc_info.value
    assert not isinstance(error, DeadlineExceededError)  # the store answered each time
    message = str(error)
    assert f"{op} {s3.base_path}/{PATH} failed after 3 attempt(s)" in message
    assert "attempt 1:" in message and "attempt 3:" in message and "SlowDown" in message
    assert s3.plan.hits(fault) == 3


def test_a_missing_object_stays_file_not_found_and_is_not_retried(s3: S3Env) -> None:
    storage = s3.storage()
    with pytest.raises(FileNotFoundError):
        storage.files.get("chk-9/_metadata")
    assert s3.plan.calls == [("get", "chk-9/_metadata", "status:404")]
