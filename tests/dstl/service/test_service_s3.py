"""The changelog service over a real S3 HTTP endpoint (moto's server mode), with uploads held by the
fault proxy (``benchmarks.support.fault_proxy``) where a test needs a persist outstanding.

What a user relies on: the service process, started on demand, uploads the changes of its
clients to S3 as one object per flush, and the handles read back through the client's local
storage; when the service dies (SIGKILL) with a persist outstanding, the persist fails at once
with ``ServiceUnavailableError`` (not at some deadline), the writer never silently continues on
another service, and the next client starts a new service with a higher epoch.
"""

from __future__ import annotations

import os
import signal

import pytest

from benchmarks.support.fault_plan import Fault
from benchmarks.support.s3_server import list_keys
from dstl import HedgingPolicy, KeyGroupRange
from dstl.service import ServiceUnavailableError
from tests.dstl.service.harness import WAIT_S, Harness, S3Env, append_all, make_records

pytestmark = pytest.mark.s3


def test_round_trip_through_the_service_one_object_per_flush(harness: Harness, s3: S3Env) -> None:
    config = s3.config(through_proxy=False, persist_delay_ms=600_000.0)
    storage = harness.client(config)
    writers = [storage.create_writer(f"op{i}", KeyGroupRange(10 * i, 10 * i + 9)) for i in range(3)]
    records = [make_records(range(10 * i, 10 * i + 10), f"s3-{i}", 500) for i in range(3)]
    for writer, recs in zip(writers, records, strict=True):
        append_all(writer, recs)
    handles = [f.result(WAIT_S) for f in [w.persist_durably(0) for w in writers]]

    keys = list_keys(s3.endpoint_url, s3.bucket)
    assert len(keys) == 1 and {f"job1/{p}" for h in handles for p in h.files} == set(keys)
    for handle, recs in zip(handles, records, strict=True):
        assert list(storage.read(handle)) == recs
    # a second worker reads the first one's handle back from S3
    other = harness.client(config)
    assert other.service_pid == storage.service_pid
    assert list(other.read(handles[1], KeyGroupRange(12, 13))) == [(k, d) for k, d in records[1] if k in (12, 13)]


def test_a_killed_service_fails_outstanding_persists_at_once_and_the_next_client_starts_a_new_one(
    harness: Harness, s3: S3Env
) -> None:
    config = s3.config(
        persist_delay_ms=600_000.0, upload_timeout_ms=30_000, max_attempts=1, hedging=HedgingPolicy.disabled()
    )
    storage = harness.client(config)
    assert storage.service_process is not None
    first_epoch = storage.service_epoch
    a = storage.create_writer("a", KeyGroupRange(0, 9))
    b = storage.create_writer("b", KeyGroupRange(10, 19))
    append_all(a, make_records(range(10), "a", 100))
    append_all(b, make_records(range(10, 20), "b", 100))
    s3.plan.add(Fault(op="put", action="stall"))
    persists = [a.persist_durably(0), b.persist_durably(0)]
    assert s3.plan.wait_stalled(1, WAIT_S)  # the upload is held: both persists are outstanding

    os.kill(storage.service_pid, signal.SIGKILL)
    storage.service_process.wait(WAIT_S)
    for writer, persist in zip((a, b), persists, strict=True):
        error = persist.exception(WAIT_S)  # far below the upload's 30 s timeout: the connection died
        assert isinstance(error, ServiceUnavailableError)
        message = str(error)
        assert f"changelog service {storage.socket_path} unavailable" in message
        assert f"persist_durably of writer {writer.log_id} failed: the service closed the connection" in message
    # the writers never continue elsewhere: every later call raises
    with pytest.raises(ServiceUnavailableError, match="last_appended_sqn of writer"):
        a.last_appended_sqn()
    with pytest.raises(ServiceUnavailableError, match="append of writer"):
        a.append(0, b"lost")
    with pytest.raises(ServiceUnavailableError):
        b.persist_durably(0)
    a.close()

    s3.plan.release()
    restarted = harness.client(config)
    assert restarted.service_process is not None and restarted.service_epoch == first_epoch + 1
    # the old storage reconnects for new writers only, to the new service
    again = storage.create_writer("a", KeyGroupRange(0, 9))
    assert again.log_id.startswith(f"a.e{first_epoch + 1}-0-9-")
    records = make_records(range(10), "again", 100)
    append_all(again, records)
    b.close()
    assert list(restarted.read(again.persist_durably(0).result(WAIT_S))) == records
    with pytest.raises(ServiceUnavailableError):
        b.release(again.persist_durably(0).result(WAIT_S))
