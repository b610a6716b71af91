"""The changelog service as workers use it: real service processes started on demand, real client
processes, a local directory as the DFS (``test_service_s3.py`` has the S3 side).

What a user relies on: the writers of several workers land in one file per flush; a retried task
fences its zombie predecessor, even one whose request races the fencing; a dead worker releases
its writers; backpressure reaches the appending thread and loses nothing; the service exits when
idle; and a bad change, a bad call or a closed writer is an error that says what happened and
where (``test_failures.py`` has starting and reaching a service, ``test_liveness.py`` a service
that stops answering).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig, HedgingPolicy, KeyGroupRange, Note, StateChangelogStorage
from dstl.errors import ConfigurationError, WriterClosedError
from dstl.service import FencedWriterError, ServiceUnavailableError
from dstl.service.configjson import dumps_config
from dstl.writer import ChangelogWriter
from tests.dstl.service.harness import (
    FLOOD_CAP,
    WAIT_S,
    Harness,
    Records,
    append_all,
    local_config,
    log_files,
    make_records,
    stop_process,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[3]


def run_in_threads(*jobs: Any) -> list[Any]:
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not errors, errors
    return results


# -- batching across workers -------------------------------------------------------------------------


def test_two_workers_share_one_file_per_flush(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path)
    a = harness.client(config)  # starts the service
    b = harness.client(config)  # finds it running
    assert a.service_process is not None and b.service_process is None
    assert a.service_pid == b.service_pid == a.service_process.pid
    wa = a.create_writer("left", KeyGroupRange(0, 9))
    wb = b.create_writer("right", KeyGroupRange(10, 19))
    assert wa.log_id.startswith(f"left.e{a.service_epoch}-0-9-")

    def work(writer: Any, rng: range, tag: str, after: int) -> tuple[Records, Any]:
        records = make_records(rng, tag, 3000)
        append_all(writer, records)
        return records, writer.persist_durably(after).result(WAIT_S)

    (ra, ha), (rb, hb) = run_in_threads(lambda: work(wa, range(10), "a", 0), lambda: work(wb, range(10, 20), "b", 0))
    # nobody flushes on a timer here: the one flush came when both writers waited
    assert ha.files == hb.files and len(log_files(config)) == 1
    assert list(a.read(ha)) == ra and list(b.read(hb)) == rb

    (ra2, ha2), (rb2, hb2) = run_in_threads(
        lambda: work(wa, range(10), "a2", ha.upto), lambda: work(wb, range(10, 20), "b2", hb.upto)
    )
    assert ha2.files == hb2.files and len(log_files(config)) == 2
    assert list(a.read(ha2)) == ra2 and list(b.read(hb2)) == rb2
    assert list(a.read(wa.persist_durably(0).result(WAIT_S))) == ra + ra2


def test_workers_that_expect_to_persist_share_one_file_while_idle_writers_do_not_hold_it(
    tmp_path: Path, harness: Harness
) -> None:
    """Two workers' tasks (expect_persist at their start) finish one after the other: their
    changes share one file although a third worker's writer (an idle subtask) never persists
    and the persist delay is zero."""
    config = local_config(tmp_path, persist_delay_ms=0.0, expected_persist_wait_ms=600_000)
    a, b, idle = harness.client(config), harness.client(config), harness.client(config)
    idle.create_writer("idle", KeyGroupRange(20, 29))
    wa, wb = a.create_writer("left", KeyGroupRange(0, 9)), b.create_writer("right", KeyGroupRange(10, 19))
    wa.expect_persist()
    wb.expect_persist()
    ra, rb = make_records(range(10), "a", 100), make_records(range(10, 20), "b", 100)
    append_all(wa, ra)
    first = wa.persist_durably(0)
    append_all(wb, rb)  # the second task finishes later
    second = wb.persist_durably(0)
    ha, hb = first.result(WAIT_S), second.result(WAIT_S)
    assert ha.files == hb.files and len(log_files(config)) == 1
    assert list(a.read(ha)) == ra and list(b.read(hb)) == rb


def test_a_persists_note_travels_through_the_service_into_the_rounds_file(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path, persist_delay_ms=0.0, expected_persist_wait_ms=600_000)
    a, b = harness.client(config), harness.client(config)
    wa, wb = a.create_writer("left", KeyGroupRange(0, 9)), b.create_writer("right", KeyGroupRange(10, 19))
    wa.expect_persist()
    wb.expect_persist()
    append_all(wa, make_records(range(10), "a", 50))
    fa = wa.persist_durably(0, Note("pending/0/op", {"subtask": 0}))
    append_all(wb, make_records(range(10, 20), "b", 50))
    fb = wb.persist_durably(0, Note("pending/0/op", {"subtask": 1}))
    ha, hb = fa.result(WAIT_S), fb.result(WAIT_S)
    [noted_file] = sorted((Path(config.base_path) / "pending" / "0" / "op").iterdir())
    notes = a.read_notes(f"pending/0/op/{noted_file.name}")
    assert sorted((n.payload["subtask"], n.handle) for n in notes) == [(0, ha), (1, hb)]
    assert log_files(config) == []  # the round's changes went to the noted file only


def test_a_workers_files_go_straight_to_the_dfs_through_its_local_storage(tmp_path: Path, harness: Harness) -> None:
    """``RemoteChangelogStorage.files`` is the local storage's: chunks and metadata skip the service."""
    config = local_config(tmp_path)
    harness.serve(config)
    local = StateChangelogStorage(config, owns_files=False)
    try:
        remote = harness.client(config, start=False, local=local)
        assert remote.files is local.files
        remote.files.put("chk-1/_metadata", b"meta")
        assert (Path(config.base_path) / "chk-1" / "_metadata").read_bytes() == b"meta"
        assert remote.files.list("chk-1") == ["chk-1/_metadata"]
        remote.files.delete("chk-1/_metadata")
        assert remote.files.list("") == []
    finally:
        local.close()


def test_handles_are_confirmed_released_and_truncated_on_the_service(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path, persist_delay_ms=1.0)
    service = harness.serve(config, owns_files=True)
    storage = harness.client(config, start=False)
    writer = storage.create_writer("op", KeyGroupRange(0, 3))
    append_all(writer, make_records(range(4), "kept", 10))
    kept = writer.persist_durably(0).result(WAIT_S)
    writer.confirm(kept)
    append_all(writer, make_records(range(4), "dropped", 10))
    dropped = writer.persist_durably(kept.upto).result(WAIT_S)
    assert writer.last_appended_sqn() == dropped.upto
    writer.release(dropped)
    writer.truncate(dropped.upto + 1)
    assert service.storage is not None
    service.storage.flush(WAIT_S)
    # the released, truncated file is gone; the confirmed one belongs to its checkpoint
    assert log_files(config) == [p.removeprefix("dstl/") for p in sorted(kept.files)]


# -- fencing and dead workers ------------------------------------------------------------------------


def test_a_newer_attempt_fences_the_older_writer(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path)
    zombie_storage = harness.client(config)
    retry_storage = harness.client(config)
    zombie = zombie_storage.create_writer("op", KeyGroupRange(0, 9))
    bystander = zombie_storage.create_writer("bystander", KeyGroupRange(20, 29))  # holds the flush back
    append_all(zombie, make_records(range(10), "zombie", 100))
    outstanding = zombie.persist_durably(0)
    retry = retry_storage.create_writer("op", KeyGroupRange(0, 9))

    with pytest.raises(FencedWriterError) as exc_info:
        zombie.last_appended_sqn()
    message = str(exc_info.value)
    assert f"writer {zombie.log_id} was taken over by a newer attempt (writer {retry.log_id})" in message
    assert zombie_storage.socket_path in message
    with pytest.raises(FencedWriterError):
        zombie.append(0, b"late")
    with pytest.raises(FencedWriterError):
        zombie.persist_durably(0)
    zombie.close()  # closing a fenced writer is quiet

    records = make_records(range(10), "retry", 100)
    append_all(retry, records)
    bystander.append(20, b"flush now")
    persists = [retry.persist_durably(0), bystander.persist_durably(0)]
    assert list(retry_storage.read(persists[0].result(WAIT_S))) == records
    # the zombie's persist was answered too, once its changes were uploaded, with the fencing
    assert isinstance(outstanding.exception(WAIT_S), FencedWriterError)


def test_a_request_racing_the_fencing_fails_as_fenced(tmp_path: Path, harness: Harness) -> None:
    """The zombie's LAST_SQN passed the fencing check when the newer attempt took its writer over
    and closed it: the zombie hears that it was fenced, not that its writer is closed."""
    config = local_config(tmp_path)
    service = harness.serve(config)
    zombie_storage = harness.client(config, start=False)
    retry_storage = harness.client(config, start=False)
    zombie = zombie_storage.create_writer("op", KeyGroupRange(0, 9))
    (slot,) = [s for h in list(service._connections) for s in h.writers.values()]
    taken_over: list[Any] = []

    def fenced_meanwhile() -> Any:  # on the zombie's connection thread, inside its request
        taken_over.append(retry_storage.create_writer("op", KeyGroupRange(0, 9)))
        assert slot.writer.closed
        return ChangelogWriter.last_appended_sqn(slot.writer)

    slot.writer.last_appended_sqn = fenced_meanwhile  # type: ignore[method-assign]
    with pytest.raises(FencedWriterError, match=f"writer {zombie.log_id} was taken over by a newer attempt"):
        zombie.last_appended_sqn()
    assert taken_over and zombie_storage.lost is None  # the connection serves on


def test_a_handle_of_another_writer_is_refused(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path, persist_delay_ms=1.0)
    storage = harness.client(config)
    mine = storage.create_writer("mine", KeyGroupRange(0, 3))
    other = storage.create_writer("other", KeyGroupRange(4, 7))
    other.append(4, b"x")
    handle = other.persist_durably(0).result(WAIT_S)
    for call in (mine.confirm, mine.release):
        with pytest.raises(ConfigurationError, match=f"handle of log {handle.log_id} does not belong to writer"):
            call(handle)
    other.confirm(handle)  # its own writer may


CLIENT = """
import sys
from dstl import ChangelogConfig, KeyGroupRange
from dstl.service import RemoteChangelogStorage
from dstl.service.configjson import loads_config
config = loads_config(sys.stdin.readline())
storage = RemoteChangelogStorage(config, socket_dir=sys.argv[1], start=False)
writer = storage.create_writer("dead", KeyGroupRange(0, 9))
for i in range(1000):
    writer.append(i % 10, b"unpersisted")
writer.last_appended_sqn()  # the appends reached the service
print("READY", flush=True)
sys.stdin.read()
"""


def test_a_killed_worker_releases_its_writers_and_the_service_serves_on(
    tmp_path: Path, harness: Harness, socket_dir: Path
) -> None:
    config = local_config(tmp_path)
    storage = harness.client(config)
    worker = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(socket_dir)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdin is not None and worker.stdout is not None
        worker.stdin.write(dumps_config(config) + "\n")
        worker.stdin.flush()
        assert worker.stdout.readline() == "READY\n"
        worker.kill()
        worker.wait(WAIT_S)
    finally:
        stop_process(worker)

    # With no timer flush, a persist completes only once every registered writer waits: the dead
    # worker's writer must be gone for this one to finish.
    writer = storage.create_writer("live", KeyGroupRange(10, 19))
    records = make_records(range(10, 20), "live", 200)
    append_all(writer, records)
    handle = writer.persist_durably(0).result(WAIT_S)
    assert list(storage.read(handle)) == records
    # its operator and range are free for a new attempt, which fences nobody alive
    writer.close()
    again = storage.create_writer("dead", KeyGroupRange(0, 9))
    append_all(again, [(0, b"new")])
    assert list(storage.read(again.persist_durably(0).result(WAIT_S))) == [(0, b"new")]


# -- backpressure --------------------------------------------------------------------------------------


def test_backpressure_blocks_the_appending_thread_and_loses_nothing(tmp_path: Path, harness: Harness) -> None:
    with FaultPlan() as plan:
        config = ChangelogConfig(
            base_path=faulty_base_path(tmp_path / "dfs", plan),
            persist_delay_ms=1.0,
            preemptive_persist_threshold=16 * 1024,
            max_in_flight_bytes=64 * 1024,
            upload_timeout_ms=30_000,
            hedging=HedgingPolicy.disabled(),
        )
        service = harness.serve(config)
        storage = harness.client(config, start=False)
        writer = storage.create_writer("op", KeyGroupRange(0, 15))
        plan.add(Fault(op="put", action="stall"))
        # Appends until told to stop: how much the sender, both socket buffers and the service
        # absorb before they push back depends on thread scheduling, so a fixed number of appends
        # may pass before the service's loop notices the held upload.
        stop = threading.Event()
        done = threading.Event()
        appended = 0
        errors: list[BaseException] = []

        def operator() -> None:
            nonlocal appended
            try:
                while not stop.is_set() and appended < FLOOD_CAP:
                    writer.append(appended % 16, change(appended))
                    appended += 1
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.set()

        def waited(counter: Callable[[], int]) -> Callable[[], bool]:
            def check() -> bool:
                assert not done.is_set(), f"the appends ended before any backpressure: {errors}"
                return counter() > 0

            return check

        thread = threading.Thread(target=operator, name="operator", daemon=True)
        thread.start()
        try:
            assert plan.wait_stalled(1, WAIT_S)
            assert service.storage is not None
            metrics = service.storage.metrics
            wait_until(waited(lambda: metrics.backpressure_waits), "the service to stop reading")
            wait_until(waited(lambda: writer.backpressure_waits), "the appending thread to wait for the sender")
        finally:
            stop.set()  # also when an assertion failed: no flood up to the cap
        plan.release()
        assert done.wait(WAIT_S) and not errors, errors
        handle = writer.persist_durably(0).result(WAIT_S)
        assert list(storage.read(handle)) == [(i % 16, change(i)) for i in range(appended)]


def change(i: int) -> bytes:
    return i.to_bytes(4, "little") * 25


# -- idle exit -----------------------------------------------------------------------------------------


def test_the_service_exits_once_idle_after_the_last_client_left(tmp_path: Path, harness: Harness) -> None:
    """The client that starts the service connects and says HELLO under the start lock, which the
    service needs to exit idle: a short idle timeout cannot end it before its first client is in."""
    config = local_config(tmp_path)
    storage = harness.client(config, idle_timeout_ms=200)
    proc = storage.service_process
    assert proc is not None
    writer = storage.create_writer("op", KeyGroupRange(0, 3))
    records = make_records(range(4), "idle", 100)
    append_all(writer, records)
    handle = writer.persist_durably(0).result(WAIT_S)
    assert proc.poll() is None  # a client is connected
    storage.close()

    assert proc.wait(WAIT_S) == 0
    assert not os.path.exists(storage.socket_path)
    reader = harness.client(config)  # starts a new service: the old one is gone for good
    assert reader.service_epoch == storage.service_epoch + 1
    assert list(reader.read(handle)) == records


def test_a_service_whose_socket_directory_was_removed_still_exits_once_idle(tmp_path: Path, harness: Harness) -> None:
    """A /tmp cleaner or a harness removing its temporary directory takes the socket and the start
    lock away: no client can reach the service any more, so once idle it exits, never lingers."""
    config = local_config(tmp_path)
    storage = harness.client(config, idle_timeout_ms=200)
    proc = storage.service_process
    assert proc is not None
    writer = storage.create_writer("op", KeyGroupRange(0, 3))
    append_all(writer, make_records(range(4), "gone", 10))
    writer.persist_durably(0).result(WAIT_S)
    storage.close()
    shutil.rmtree(harness.socket_dir)

    assert proc.wait(WAIT_S) == 0


def test_sigterm_stops_the_service_cleanly_and_a_bad_config_is_refused(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path)
    storage = harness.client(config)
    proc = storage.service_process
    assert proc is not None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(WAIT_S) == 0
    assert not os.path.exists(storage.socket_path)

    refused = subprocess.run(
        [sys.executable, "-m", "dstl.service", "--socket", storage.socket_path],
        cwd=ROOT,
        input=b'{"base_path": 1}',
        capture_output=True,
        timeout=WAIT_S,
    )
    assert (
        refused.returncode == 2
        and b"refused to start" in refused.stderr
        and b"base_path must be str, got 1" in refused.stderr
    )


def test_a_closing_service_fails_its_clients_calls(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path)
    service = harness.serve(config)
    storage = harness.client(config, start=False)
    writer = storage.create_writer("op", KeyGroupRange(0, 3))
    writer.append(0, b"x")
    service.close()
    with pytest.raises(ServiceUnavailableError, match=f"changelog service {service.socket_path} unavailable"):
        writer.last_appended_sqn()
    writer.close()  # quiet: the service closed it already


def test_a_persist_callback_may_call_its_writer(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path)
    harness.serve(config)
    storage = harness.client(config, start=False)
    first = storage.create_writer("first", KeyGroupRange(0, 3))
    second = storage.create_writer("second", KeyGroupRange(4, 7))
    first.append(0, b"a")
    second.append(4, b"b")
    persist = first.persist_durably(0)  # waits for the second writer: no timer flushes here
    seen: list[tuple[int, int]] = []
    called = threading.Event()

    def callback(future: Any) -> None:
        seen.append((future.result().upto, first.last_appended_sqn()))  # a request from the callback
        called.set()

    persist.add_done_callback(callback)
    second.persist_durably(0).result(WAIT_S)
    assert called.wait(WAIT_S) and seen == [(1, 1)]


def test_bad_changes_and_bad_calls_raise_the_errors_of_a_local_writer(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path, persist_delay_ms=1.0)
    storage = harness.client(config)
    outside = storage.create_writer("outside", KeyGroupRange(0, 3))
    outside.append(7, b"key group 7 is not ours")
    with pytest.raises(ConfigurationError, match="owns key groups \\[0, 3\\] but key group 7 was appended"):
        outside.last_appended_sqn()

    typed = storage.create_writer("typed", KeyGroupRange(0, 3))
    typed.append(0, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=f"changelog writer {typed.log_id}: bad change appended: .*str"):
        typed.persist_durably(0)
    with pytest.raises(ConfigurationError, match="not key group and data pairs"):
        typed.append_many([1])

    writer = storage.create_writer("ok", KeyGroupRange(0, 3))
    writer.append(1, b"x")
    with pytest.raises(ConfigurationError, match="outside \\[0, 1\\]"):
        writer.persist_durably(5).result(WAIT_S)
    assert writer.persist_durably(0).result(WAIT_S).upto == 1

    writer.close()
    writer.close()
    writer.truncate(1)  # as a local writer: nothing is held any more
    with pytest.raises(WriterClosedError, match="is closed"):
        writer.persist_durably(0)
    storage.close()
    with pytest.raises(WriterClosedError, match="storage is closed"):
        storage.create_writer("late", KeyGroupRange(0, 3))
    with pytest.raises(WriterClosedError):
        outside.last_appended_sqn()
