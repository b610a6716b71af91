"""The DSTL against a real S3 HTTP endpoint (moto's server mode), directly and through a fault proxy.

One moto server runs for the whole test session; each test gets its own bucket. The fault tests put
``benchmarks.support.latency_proxy.LatencyProxy`` between aiobotocore and moto. The proxy runs on its own event
loop in a background thread (the storage's loop thread is the HTTP client), and the client uses
``force_close`` so that each upload attempt is exactly one proxied TCP connection: scripting the
proxy's behaviour per connection scripts the fate of each attempt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, TypeVar

import aiohttp
import pytest

from benchmarks.support.latency_proxy import Behavior, LatencyProxy
from benchmarks.support.s3_server import (
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    S3Server,
    list_keys,
)
from dstl import (
    ChangelogConfig,
    ChangelogHandle,
    ChangelogWriter,
    CorruptChangelogError,
    HedgingPolicy,
    KeyGroupRange,
    S3Options,
    StateChangelogStorage,
    UploadFailedError,
)
from dstl.uploaders import USER_AGENT
from tests.support.s3 import botocore_client, new_bucket

pytestmark = pytest.mark.s3

T = TypeVar("T")

#: Generous: waits end as soon as the awaited thing happens; this only bounds a hang.
WAIT_S = 30.0
#: ``<base>/dstl/<2 hex prefix>/<32 hex uuid>``
OBJECT_KEY = re.compile(r"job1/dstl/[0-9a-f]{2}/[0-9a-f]{32}")

Records = list[tuple[int, bytes]]


# -- fixtures and helpers -------------------------------------------------------------------------


@pytest.fixture
def bucket(moto_server: S3Server) -> str:
    return new_bucket(moto_server, "dstl")


def s3_config(endpoint_url: str, bucket: str, *, force_close: bool = False, **overrides: Any) -> ChangelogConfig:
    return ChangelogConfig(
        base_path=f"s3://{bucket}/job1",
        s3=S3Options(
            endpoint_url=endpoint_url,
            region=REGION,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            force_close=force_close,
        ),
        **overrides,
    )


def object_sizes(endpoint_url: str, bucket: str) -> dict[str, int]:
    response = botocore_client(endpoint_url).list_objects_v2(Bucket=bucket)
    return {obj["Key"]: obj["Size"] for obj in response.get("Contents", [])}


def append_records(writer: ChangelogWriter, key_groups: Iterable[int], tag: str, count: int) -> Records:
    """Append ``count`` changes spread over ``key_groups``; returns them in append order."""
    kgs = list(key_groups)
    records = [(kgs[i % len(kgs)], f"{tag}:{i}:{'x' * (i % 37)}".encode()) for i in range(count)]
    for kg, data in records:
        writer.append(kg, data)
    return records


def key(handle_path: str) -> str:
    return f"job1/{handle_path}"


class ThreadedProxy:
    """A ``LatencyProxy`` running on its own event loop in a daemon thread.

    Starting, scripting and stopping are marshalled onto the proxy's loop, so tests stay synchronous and never
    block the loop that forwards the storage's requests.
    """

    def __init__(self, upstream_port: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="latency-proxy", daemon=True)
        self._thread.start()
        self.proxy = LatencyProxy("127.0.0.1", upstream_port)
        self._call(self.proxy.start())

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(WAIT_S)

    @property
    def url(self) -> str:
        return self.proxy.url

    def script(self, *behaviors: Behavior, default: Behavior = Behavior.PASS) -> None:
        async def apply() -> None:
            self.proxy.scripted.clear()
            self.proxy.scripted.extend(behaviors)
            self.proxy.default_behavior = default

        self._call(apply())

    def close(self) -> None:
        try:
            self._call(self.proxy.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(WAIT_S)
            self._loop.close()


@pytest.fixture
def proxy(moto_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadedProxy]:
    # aiohttp re-sends an idempotent request (our PUT) once on a fresh connection when that
    # connection is reset *after* the request went out, but not when the reset beats the request:
    # a timing race that would make one of our attempts one or two connections at random. Switch
    # it off (as aiohttp's own test_utils does), so one attempt is exactly one proxied connection.
    original_init = aiohttp.ClientSession.__init__

    def init_without_transparent_retry(self: aiohttp.ClientSession, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._retry_connection = False

    monkeypatch.setattr(aiohttp.ClientSession, "__init__", init_without_transparent_retry)
    p = ThreadedProxy(moto_server.port)
    try:
        yield p
    finally:
        p.close()


# -- round trip through real HTTP -----------------------------------------------------------------


def test_round_trip_one_object_per_flush_and_ranged_reads(moto_server: S3Server, bucket: str) -> None:
    endpoint = moto_server.endpoint_url
    # No timer flushes: a flush happens exactly when every writer has asked to persist.
    config = s3_config(endpoint, bucket, persist_delay_ms=30_000)
    ranges = [KeyGroupRange(0, 9), KeyGroupRange(10, 19), KeyGroupRange(20, 29)]
    with StateChangelogStorage(config) as storage:
        assert storage.files.parallel_reads is None  # latency to hide: as many reads as the caller likes
        writers = [storage.create_writer(f"op{i}", rng) for i, rng in enumerate(ranges)]

        first = [append_records(w, rng, f"a{i}", 200) for i, (w, rng) in enumerate(zip(writers, ranges, strict=True))]
        handles1 = [f.result(WAIT_S) for f in [w.persist_durably(0) for w in writers]]
        assert storage.metrics.flushes == 1
        keys = list_keys(endpoint, bucket)
        assert len(keys) == 1 and OBJECT_KEY.fullmatch(keys[0]), keys
        # One file holds the changesets of every writer.
        assert {key(p) for h in handles1 for p in h.files} == set(keys)

        second = [append_records(w, rng, f"b{i}", 150) for i, (w, rng) in enumerate(zip(writers, ranges, strict=True))]
        futures = [w.persist_durably(h.upto) for w, h in zip(writers, handles1, strict=True)]
        handles2 = [f.result(WAIT_S) for f in futures]
        assert storage.metrics.flushes == 2
        keys = list_keys(endpoint, bucket)
        assert len(keys) == 2 and all(OBJECT_KEY.fullmatch(k) for k in keys), keys
        assert {key(p) for h in handles2 for p in h.files} == set(keys) - {key(p) for h in handles1 for p in h.files}

        for h, a in zip(handles1, first, strict=True):
            assert list(storage.read(h)) == a
        for h, b in zip(handles2, second, strict=True):
            assert list(storage.read(h)) == b

        # A persist from the start reuses both uploaded changesets: no new upload, two files read back in order.
        full = writers[0].persist_durably(0).result(WAIT_S)
        assert storage.metrics.flushes == 2 and len(list_keys(endpoint, bucket)) == 2
        assert [s.sqn for s in full.segments] == [1, 2] and len(full.files) == 2
        assert list(storage.read(full)) == first[0] + second[0]

        # Ranged read: the middle writer's segment sits strictly inside the shared object.
        middle = handles1[1]
        (segment,) = middle.segments
        size = object_sizes(endpoint, bucket)[key(segment.path)]
        assert segment.offset > 0 and segment.offset + segment.length < size
        assert list(storage.read(middle)) == first[1]
        wanted = KeyGroupRange(12, 13)
        assert list(storage.read(middle, wanted)) == [(kg, d) for kg, d in first[1] if kg in wanted]
        # Key groups of another writer: nothing (the segment is skipped by its key-group index).
        assert list(storage.read(middle, ranges[2])) == []


@pytest.mark.parametrize("expect_continue", [False, True])
def test_puts_skip_the_expect_continue_round_trip_unless_asked(
    moto_server: S3Server, bucket: str, proxy: ThreadedProxy, expect_continue: bool
) -> None:
    proxy.proxy.client_bytes = bytearray()
    config = s3_config(proxy.url, bucket, persist_delay_ms=30_000)
    config = dataclasses.replace(config, s3=dataclasses.replace(config.s3, expect_continue=expect_continue))
    with StateChangelogStorage(config) as storage:
        writer = storage.create_writer("op", KeyGroupRange(0, 3))
        records = append_records(writer, range(4), "e", 50)
        handle = writer.persist_durably(0).result(WAIT_S)
        assert list(storage.read(handle)) == records
    wire = bytes(proxy.proxy.client_bytes).lower()
    assert b"put /" in wire
    assert (b"expect: 100-continue" in wire) is expect_continue
    # A fixed User-Agent that names this library (botocore's structured one costs CPU per request).
    agents = re.findall(rb"user-agent: ([^\r]*)\r\n", wire)
    assert agents and all(a.startswith(USER_AGENT.lower().encode()) for a in agents), agents


def test_released_and_truncated_file_is_deleted_from_the_bucket(moto_server: S3Server, bucket: str) -> None:
    endpoint = moto_server.endpoint_url
    with StateChangelogStorage(s3_config(endpoint, bucket, persist_delay_ms=30_000)) as storage:
        a = storage.create_writer("a", KeyGroupRange(0, 3))
        b = storage.create_writer("b", KeyGroupRange(4, 7))
        append_records(a, range(0, 4), "a", 50)
        append_records(b, range(4, 8), "b", 50)
        ha, hb = (f.result(WAIT_S) for f in [a.persist_durably(0), b.persist_durably(0)])
        (path,) = ha.files
        assert hb.files == {path}
        assert list_keys(endpoint, bucket) == [key(path)]

        # Releasing the handle alone keeps the file: the changeset is not truncated yet.
        a.release(ha)
        storage.flush(WAIT_S)
        assert list_keys(endpoint, bucket) == [key(path)]
        # Writer a is done with it, but b's changeset and handle still reference the shared file.
        a.truncate(ha.upto + 1)
        storage.flush(WAIT_S)
        assert list_keys(endpoint, bucket) == [key(path)]
        b.release(hb)
        b.truncate(hb.upto + 1)
        storage.flush(WAIT_S)
        assert list_keys(endpoint, bucket) == []
        assert storage.metrics.files_deleted == 1
        assert storage.tracked_files() == {}


def test_confirmed_handle_survives_close_and_restart(moto_server: S3Server, bucket: str) -> None:
    endpoint = moto_server.endpoint_url
    config = s3_config(endpoint, bucket)
    with StateChangelogStorage(config) as storage:
        kept = storage.create_writer("kept", KeyGroupRange(0, 7))
        dropped = storage.create_writer("dropped", KeyGroupRange(8, 15))
        records = append_records(kept, range(0, 8), "kept", 100)
        confirmed = kept.persist_durably(0).result(WAIT_S)
        append_records(dropped, range(8, 16), "dropped", 100)
        unconfirmed = dropped.persist_durably(0).result(WAIT_S)
        assert confirmed.files.isdisjoint(unconfirmed.files)
        kept.confirm(confirmed)
        dropped.release(unconfirmed)  # its checkpoint aborted
        text = confirmed.dumps()
    # Closing drops every writer: the released handle's file goes, the checkpoint's file stays.
    assert list_keys(endpoint, bucket) == [key(p) for p in confirmed.files]

    with StateChangelogStorage(config) as restarted:
        assert list(restarted.read(ChangelogHandle.loads(text))) == records


def test_a_segment_placed_past_the_end_of_its_object_is_corrupt_not_a_store_failure(
    moto_server: S3Server, bucket: str
) -> None:
    """S3 answers a range past an object's end with 416 InvalidRange: that is the handle's damage
    (named by its file, not retried), as a read past a local file's end is."""
    with StateChangelogStorage(s3_config(moto_server.endpoint_url, bucket)) as storage:
        writer = storage.create_writer("op", KeyGroupRange(0, 7))
        append_records(writer, range(8), "r", 10)
        handle = writer.persist_durably(0).result(WAIT_S)
        (segment,) = handle.segments
        forged = ChangelogHandle.loads(
            dataclasses.replace(handle, segments=(dataclasses.replace(segment, offset=1 << 30),)).dumps()
        )
        with pytest.raises(CorruptChangelogError, match=rf"{segment.path}: segment of sqn 1 truncated \(0 bytes\)"):
            list(storage.read(forged))


def test_credentials_and_endpoint_from_environment(
    moto_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    endpoint = moto_server.endpoint_url
    # Nothing from the host's AWS configuration may help.
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    config = ChangelogConfig(base_path=f"s3://{bucket}/job1")
    assert config.s3 == S3Options()
    with StateChangelogStorage(config) as storage:
        writer = storage.create_writer("env", KeyGroupRange(0, 3))
        records = append_records(writer, range(4), "env", 40)
        handle = writer.persist_durably(0).result(WAIT_S)
        assert list_keys(endpoint, bucket) == [key(p) for p in handle.files]
        assert list(storage.read(handle)) == records


def test_missing_credentials_fail_the_persist_naming_the_cause(
    moto_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)
    config = ChangelogConfig(
        base_path=f"s3://{bucket}/job1",
        s3=S3Options(endpoint_url=moto_server.endpoint_url, region=REGION),
        max_attempts=1,
        hedging=HedgingPolicy.disabled(),
    )
    with StateChangelogStorage(config) as storage:
        writer = storage.create_writer("anon", KeyGroupRange(0, 3))
        append_records(writer, range(4), "anon", 10)
        with pytest.raises(UploadFailedError, match="NoCredentialsError"):
            writer.persist_durably(0).result(WAIT_S)
    assert list_keys(moto_server.endpoint_url, bucket) == []


# -- through the fault-injecting proxy ------------------------------------------------------------


def test_stalled_attempt_is_beaten_by_its_hedge(moto_server: S3Server, bucket: str, proxy: ThreadedProxy) -> None:
    proxy.script(Behavior.STALL)
    config = s3_config(
        proxy.url,
        bucket,
        force_close=True,
        # min_samples is never reached, so the hedge fires after initial_delay_ms; the budget allows it.
        hedging=HedgingPolicy(initial_delay_ms=200, min_samples=1000, budget=1.0, burst=10),
        # Long enough that the per-attempt timeout is not what rescues the upload.
        upload_timeout_ms=30_000,
    )
    with StateChangelogStorage(config) as storage:
        writer = storage.create_writer("hedged", KeyGroupRange(0, 15))
        records = append_records(writer, range(16), "hedged", 300)
        handle = writer.persist_durably(0).result(WAIT_S)
        storage.flush(WAIT_S)  # the loser is cancelled and its object name deleted in the background

        m = storage.metrics
        assert (m.hedges, m.hedges_won, m.attempt_timeouts, m.retries, m.upload_failures) == (1, 1, 0, 0, 0)
        assert m.upload_attempts == 2
        assert proxy.proxy.stalled == 1
        # Exactly the winner's object: the stalled attempt never wrote, and its name was cleaned up.
        assert list_keys(moto_server.endpoint_url, bucket) == [key(p) for p in handle.files]
        assert list(storage.read(handle)) == records


def test_reset_attempt_is_retried(moto_server: S3Server, bucket: str, proxy: ThreadedProxy) -> None:
    proxy.script(Behavior.RESET)
    config = s3_config(
        proxy.url,
        bucket,
        force_close=True,
        hedging=HedgingPolicy.disabled(),
        retry_delay_ms=50,
        upload_timeout_ms=10_000,
    )
    with StateChangelogStorage(config) as storage:
        writer = storage.create_writer("retried", KeyGroupRange(0, 15))
        records = append_records(writer, range(16), "retried", 300)
        handle = writer.persist_durably(0).result(WAIT_S)
        storage.flush(WAIT_S)

        m = storage.metrics
        assert (m.retries, m.upload_attempts, m.hedges, m.upload_failures) == (1, 2, 0, 0)
        assert proxy.proxy.resets == 1
        assert list_keys(moto_server.endpoint_url, bucket) == [key(p) for p in handle.files]
        assert list(storage.read(handle)) == records


def test_upload_failing_every_attempt_fails_the_persist_and_loses_nothing(
    moto_server: S3Server, bucket: str, proxy: ThreadedProxy
) -> None:
    endpoint = moto_server.endpoint_url
    proxy.script(default=Behavior.RESET)
    config = s3_config(
        proxy.url,
        bucket,
        force_close=True,
        hedging=HedgingPolicy.disabled(),
        max_attempts=3,
        retry_delay_ms=50,
        upload_timeout_ms=10_000,
    )
    with StateChangelogStorage(config) as storage:
        writer = storage.create_writer("doomed", KeyGroupRange(0, 15))
        records = append_records(writer, range(16), "doomed", 300)
        with pytest.raises(UploadFailedError) as failure:
            writer.persist_durably(0).result(WAIT_S)
        message = str(failure.value)
        assert "after 3 attempts" in message
        assert all(f"attempt {i}:" in message for i in (1, 2, 3)), message
        storage.flush(WAIT_S)
        m = storage.metrics
        assert (m.upload_failures, m.upload_attempts, m.retries) == (1, 3, 2)
        assert proxy.proxy.resets >= 3  # the three PUTs (the best-effort deletions are reset too)
        assert list_keys(endpoint, bucket) == []

        # The store recovers: persisting the same range again uploads the same changes.
        proxy.script(default=Behavior.PASS)
        handle = writer.persist_durably(0).result(WAIT_S)
        assert list(storage.read(handle)) == records
        storage.flush(WAIT_S)
        assert list_keys(endpoint, bucket) == [key(p) for p in handle.files]
