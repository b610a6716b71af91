"""The S3 fault proxy in front of moto: every action on every operation, through our S3Uploader.

The session's moto server (``tests/conftest.py``); one proxy and pair of uploaders serve the
module; each test gets a fresh plan. HEAD ("exists") is sent with a plain botocore client, since
the uploader has no existence check of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import botocore.session
import pytest
from botocore.config import Config

from benchmarks.support.fault_proxy import FaultProxy
from benchmarks.support.faulty_fs import Fault, FaultPlan
from benchmarks.support.s3_server import (
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    S3Server,
    create_bucket,
)
from dstl import S3Options
from dstl.uploaders import S3Uploader

pytestmark = pytest.mark.s3

WAIT_S = 30.0
OPS = ["put", "get", "delete", "list", "exists"]


@dataclass
class Env:
    """What the module shares: creating an S3 client costs far more than the tests' requests."""

    moto: S3Server
    bucket: str
    proxy: FaultProxy
    loop: asyncio.AbstractEventLoop
    uploader: S3Uploader  # botocore's read timeout: 30 s
    impatient: S3Uploader  # read timeout 200 ms: the client gives up on a request that hangs
    client: Any  # plain botocore, for HEAD and for requests outside the base
    direct: Any  # plain botocore talking to moto itself

    def run(self, body: Callable[[S3Uploader], Coroutine[Any, Any, Any]], impatient: bool = False) -> Any:
        return self.submit(body, impatient).result(WAIT_S)

    def submit(
        self, body: Callable[[S3Uploader], Coroutine[Any, Any, Any]], impatient: bool = False
    ) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(body(self.impatient if impatient else self.uploader), self.loop)

    def keys(self) -> list[str]:
        """The bucket's keys, read from moto directly (not through the proxy)."""
        response = self.direct.list_objects_v2(Bucket=self.bucket)
        return sorted(obj["Key"] for obj in response.get("Contents", []))


def botocore_client(endpoint_url: str) -> Any:
    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=Config(retries={"total_max_attempts": 1}),
    )


@pytest.fixture(scope="module")
def env(moto_server: S3Server) -> Iterator[Env]:
    moto = moto_server
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fault-proxy-test-client", daemon=True)
    thread.start()
    bucket = f"faults-{uuid.uuid4().hex[:20]}"
    create_bucket(moto.endpoint_url, bucket)
    proxy = FaultProxy(moto.endpoint_url, FaultPlan(), base=f"{bucket}/job1")

    def uploader(read_timeout_ms: int) -> S3Uploader:
        options = S3Options(
            endpoint_url=proxy.url,
            region=REGION,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            read_timeout_ms=read_timeout_ms,
        )
        return S3Uploader(f"s3://{bucket}/job1", options)

    clients = botocore_client(proxy.url), botocore_client(moto.endpoint_url)
    shared = Env(moto, bucket, proxy, loop, uploader(30_000), uploader(200), *clients)
    try:
        yield shared
    finally:
        for up in (shared.uploader, shared.impatient):
            asyncio.run_coroutine_threadsafe(up.close(), loop).result(WAIT_S)
        proxy.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
        loop.close()


@pytest.fixture
def plan(env: Env) -> FaultPlan:
    """A fresh plan in the shared proxy, over a bucket holding only ``job1/chk-1/_metadata``."""
    for key in env.keys():  # noqa: SIM118 - a method, not a dict
        env.direct.delete_object(Bucket=env.bucket, Key=key)
    env.direct.put_object(Bucket=env.bucket, Key="job1/chk-1/_metadata", Body=b"metadata-1")
    env.proxy.plan = fresh = FaultPlan()
    return fresh


def one_call(env: Env, op: str, path: str = "chk-1/_metadata") -> Any:
    if op == "exists":
        return env.client.head_object(Bucket=env.bucket, Key=f"job1/{path}")["ContentLength"]
    calls: dict[str, Callable[[S3Uploader], Coroutine[Any, Any, Any]]] = {
        "put": lambda u: u.put(path, b"new"),
        "get": lambda u: u.get(path),
        "delete": lambda u: u.delete(path),
        "list": lambda u: u.list(path.rpartition("/")[0]),
    }
    return env.run(calls[op])


def test_transparent_forwarding_on_pooled_connections(env: Env, plan: FaultPlan) -> None:
    async def body(u: S3Uploader) -> Any:
        await u.put("dstl/ab/chunk", b"0123456789")
        ranged = await u.get("dstl/ab/chunk", 2, 3)
        names = await u.list()
        await u.delete("dstl/ab/chunk")
        with pytest.raises(FileNotFoundError):
            await u.get("dstl/ab/chunk")
        return ranged, names

    assert env.run(body) == (b"234", ["chk-1/_metadata", "dstl/ab/chunk"])
    assert one_call(env, "exists") == len(b"metadata-1")
    assert plan.calls == [
        ("put", "dstl/ab/chunk", "ok"),
        ("get", "dstl/ab/chunk", "ok"),
        ("list", "", "ok"),
        ("delete", "dstl/ab/chunk", "ok"),
        ("get", "dstl/ab/chunk", "status:404"),
        ("exists", "chk-1/_metadata", "ok"),
    ]


@pytest.mark.parametrize("op", OPS)
def test_fail_answers_503_slow_down_then_passes(env: Env, plan: FaultPlan, op: str) -> None:
    plan.add(Fault(op=op, path="chk-1*", action="fail", times=1))  # type: ignore[arg-type]
    with pytest.raises(Exception, match=r"SlowDown|503") as info:
        one_call(env, op)
    assert "botocore" in type(info.value).__module__
    one_call(env, op)
    assert [out for o, _, out in plan.calls if o == op] == ["fail", "ok"]


def test_after_skips_then_times_counts(env: Env, plan: FaultPlan) -> None:
    fault = plan.add(Fault(op="get", path="chk-1/_metadata", action="fail", after=1, times=2))
    outcomes = []
    for _ in range(4):
        try:
            one_call(env, "get")
            outcomes.append("ok")
        except Exception:
            outcomes.append("fail")
    assert outcomes == ["ok", "fail", "fail", "ok"]
    assert plan.hits(fault) == 2


@pytest.mark.parametrize("op", OPS)
def test_reset_breaks_the_connection(env: Env, plan: FaultPlan, op: str) -> None:
    plan.add(Fault(op=op, action="reset"))  # type: ignore[arg-type]
    with pytest.raises(Exception) as info:
        one_call(env, op)
    assert "SlowDown" not in str(info.value)
    assert (op, "chk-1/_metadata" if op != "list" else "chk-1", "reset") in plan.calls


@pytest.mark.parametrize("op", OPS)
def test_stall_holds_the_request_until_release(env: Env, plan: FaultPlan, op: str) -> None:
    plan.add(Fault(op=op, action="stall"))  # type: ignore[arg-type]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(one_call, env, op)
        assert plan.wait_stalled(1, WAIT_S)
        assert env.keys() == ["job1/chk-1/_metadata"]  # nothing done yet
        assert not call.done()
        plan.release()
        call.result(WAIT_S)
    assert env.keys() == ([] if op == "delete" else ["job1/chk-1/_metadata"])


def test_a_stall_whose_client_gave_up_is_dropped(env: Env, plan: FaultPlan) -> None:
    plan.add(Fault(op="put", action="stall"))
    with pytest.raises(Exception, match=r"[Tt]imeout|timed out"):
        env.run(lambda u: u.put("chk-2/_metadata", b"x"), impatient=True)
    assert plan.wait_stalled(1, WAIT_S)
    plan.close()  # ends the stall: nothing reaches the server
    env.run(lambda u: u.list())  # the proxy still serves
    assert env.keys() == ["job1/chk-1/_metadata"]


@pytest.mark.parametrize("op", OPS)
def test_delay_then_forwards(env: Env, plan: FaultPlan, op: str) -> None:
    plan.add(Fault(op=op, action="delay", delay_s=0.05))  # type: ignore[arg-type]
    start = time.monotonic()
    one_call(env, op)
    assert time.monotonic() - start >= 0.05
    assert [out for o, _, out in plan.calls if o == op] == ["delay"]


def test_trickled_get_outlasts_the_socket_read_timeout(env: Env, plan: FaultPlan) -> None:
    payload = bytes(range(256)) * 8
    env.run(lambda u: u.put("big", payload))
    plan.add(Fault(op="get", path="big", action="trickle", bytes_per_s=len(payload) * 2))
    start = time.monotonic()
    # each socket read gets a few bytes well within the read timeout; the whole body takes longer
    assert env.run(lambda u: u.get("big"), impatient=True) == payload
    assert time.monotonic() - start >= 0.5


def test_trickled_put_lands_whole(env: Env, plan: FaultPlan) -> None:
    payload = b"p" * 400
    plan.add(Fault(op="put", path="big", action="trickle", bytes_per_s=2000))
    start = time.monotonic()
    env.run(lambda u: u.put("big", payload))
    assert time.monotonic() - start >= 0.2
    assert env.run(lambda u: u.get("big")) == payload


def test_late_put_lands_after_the_client_gave_up(env: Env, plan: FaultPlan) -> None:
    plan.add(Fault(op="put", path="chk-2/_metadata", action="late"))
    with pytest.raises(Exception, match=r"[Tt]imeout|timed out"):
        env.run(lambda u: u.put("chk-2/_metadata", b"metadata-2"), impatient=True)
    env.run(lambda u: u.delete("chk-2/_metadata"))  # the client's clean-up finds nothing
    assert plan.pending_late == [("put", "chk-2/_metadata")]
    assert plan.land_late() == 1
    assert env.run(lambda u: u.get("chk-2/_metadata")) == b"metadata-2"


def test_late_delete_lands_when_told(env: Env, plan: FaultPlan) -> None:
    plan.add(Fault(op="delete", action="late"))
    with pytest.raises(Exception, match=r"[Tt]imeout|timed out"):
        env.run(lambda u: u.delete("chk-1/_metadata"), impatient=True)
    assert env.keys() == ["job1/chk-1/_metadata"]
    plan.land_late()
    assert env.keys() == []


def test_requests_outside_the_base_pass_untouched(env: Env, plan: FaultPlan) -> None:
    plan.add(Fault(op="*", action="fail"))
    env.client.put_object(Bucket=env.bucket, Key="elsewhere/x", Body=b"x")
    assert env.client.get_object(Bucket=env.bucket, Key="elsewhere/x")["Body"].read() == b"x"
    assert plan.calls == []
