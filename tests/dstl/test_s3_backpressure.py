"""The in-flight bound on S3 holds from a writer's first append on a fresh storage.

The bound is applied from the storage's loop thread (``dstl.storage.throttle``): it cuts the
active changesets and gates appends every few milliseconds; the appending thread looks too, every
``LOOK_EVERY`` changes. Before it did, whatever blocked that loop let an operator append without
any bound meanwhile, and the S3 client's creation (importing aiobotocore,
loading botocore's service models) is slow, CPU-bound work on it: created by a storage's first
upload, it let an operator that had just started run far past the bound. Here every PUT stalls
behind the fault proxy (``benchmarks.support.fault_proxy``) in front of moto, so nothing ever
becomes durable: an operator that starts appending, and persisting, as soon as a storage exists
must be stopped near the bound and not after hundreds of megabytes.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import pytest

from benchmarks.support.fault_plan import Fault, FaultPlan
from benchmarks.support.fault_proxy import FaultProxy
from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server
from dstl import ChangelogConfig, HedgingPolicy, KeyGroupRange, S3Options, StateChangelogStorage, StateChangelogWriter
from dstl.append_buffer import LOOK_EVERY
from tests.support import polling
from tests.support.s3 import new_bucket

pytestmark = pytest.mark.s3

WAIT_S = 60.0
MiB = 1 << 20
LIMIT = 16 * MiB
#: small, so that the first upload (and the client's creation) starts long before the bound
THRESHOLD = 256 * 1024
PAYLOAD = 1000
#: what an operator may append before its append blocks: the bound, the active changeset (cut
#: past the threshold) and what it appends between two of its own looks, twice (the look that cuts,
#: then the one that waits; ``dstl.append_buffer``): the loop thread's looks may come late
ALLOWED = LIMIT + THRESHOLD + 2 * LOOK_EVERY * PAYLOAD


@dataclass
class Operator:
    """Appends distinct changes (slices are copies: real memory per change) until its append fails."""

    writer: StateChangelogWriter
    appended: int = 0
    errors: list[BaseException] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._noise = os.urandom(4 * MiB)
        threading.Thread(target=self._run, name="operator", daemon=True).start()

    def _run(self) -> None:
        noise, span, append = self._noise, len(self._noise) - PAYLOAD, self.writer.append
        try:
            append(0, b"first")
            self.writer.persist_durably(0)  # a checkpoint starts at once: so does the first upload
            while True:
                offset = (self.appended * 7919) % span
                append(self.appended % 16, noise[offset : offset + PAYLOAD])
                self.appended += 1
        except BaseException as exc:  # WriterClosedError once the test closes the storage
            self.errors.append(exc)
        finally:
            self.done.set()


def test_appends_on_a_fresh_s3_storage_stop_at_the_bound(moto_server: S3Server) -> None:
    bucket = new_bucket(moto_server, "cold")
    with FaultPlan() as plan, FaultProxy(moto_server.endpoint_url, plan, base=f"{bucket}/job1") as proxy:
        plan.add(Fault(op="put", action="stall"))
        s3 = S3Options(endpoint_url=proxy.url, region=REGION, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY)
        config = ChangelogConfig(
            base_path=f"s3://{bucket}/job1",
            s3=s3,
            max_in_flight_bytes=LIMIT,
            preemptive_persist_threshold=THRESHOLD,
            persist_delay_ms=0,
            upload_timeout_ms=600_000,  # the stalled PUTs never end by themselves while the test looks
            max_attempts=1,
            hedging=HedgingPolicy.disabled(),
        )
        storage = StateChangelogStorage(config)
        try:
            op = Operator(storage.create_writer("op", KeyGroupRange(0, 15)))
            metrics = storage.metrics
            polling.wait_until(lambda: metrics.backpressure_waits >= 1 or op.done.is_set(), "a blocked append", WAIT_S)
            # Nothing becomes durable, so the blocked append never returns: this count is final.
            appended = op.appended * PAYLOAD
            assert not op.done.is_set(), op.errors
            assert appended <= ALLOWED, (
                f"{appended} bytes were appended before the first append blocked, bound {LIMIT} "
                f"(counted against it: {metrics.bytes_in_flight} bytes not durable, {metrics.bytes_encoded} encoded)"
            )
        finally:
            plan.close()  # the stalled PUTs fail, the storage can close
            storage.close()
        assert op.done.wait(WAIT_S)
