"""A worker's waits on its service end: closing the storage settles every outstanding persist, a
service that stops answering (SIGSTOP, a script that never replies) is declared lost, a service
that is only slow under backpressure is not, and a connection thread that fails says so.

What a user relies on: nothing hangs; every call, persist and gated append fails with an error
naming the operation, the writer and the socket once the connection is lost ("no answer for N s"
when the service stopped answering); and a healthy but backpressured service fails no call.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig, HedgingPolicy, KeyGroupRange
from dstl.errors import WriterClosedError
from dstl.service import Liveness, RemoteChangelogStorage, ServiceUnavailableError, service_socket_path
from dstl.service.protocol import OpenWriter, read_message
from dstl.storage import StateChangelogStorage
from tests.dstl.service.harness import FLOOD_CAP, WAIT_S, Harness, accept_hello, local_config, wait_until


def test_closing_the_storage_fails_every_outstanding_persist_exactly_once(
    tmp_path: Path, harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """``close`` (not the reader thread) ends the connection while a persist is outstanding, over
    and over: the reader's end of stream and the closing thread race to fail it."""
    config = local_config(tmp_path)
    harness.serve(config)
    local = StateChangelogStorage(config, owns_files=False)
    try:
        for i in range(30):
            storage = RemoteChangelogStorage(config, socket_dir=harness.socket_dir, start=False, local=local)
            writer = storage.create_writer(f"op{i}", KeyGroupRange(0, 9))
            storage.create_writer(f"holder{i}", KeyGroupRange(10, 19))  # holds the flush back
            writer.append(0, b"x")
            persist = writer.persist_durably(0)
            writer.last_appended_sqn()  # the PERSIST reached the service
            storage.close()
            error = persist.exception(WAIT_S)
            assert isinstance(error, WriterClosedError) and not isinstance(error, ServiceUnavailableError)
            assert str(error) == (
                f"changelog service {storage.socket_path}: persist_durably of writer {writer.log_id}: "
                "the RemoteChangelogStorage was closed"
            )
    finally:
        local.close()
    assert "a persist callback failed" not in caplog.text  # no future was settled twice


def test_a_stopped_service_is_declared_lost_and_every_wait_fails(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path, preemptive_persist_threshold=64 * 1024)
    storage = harness.client(config, liveness=Liveness(quiet_s=0.5, answer_s=0.5))
    proc = storage.service_process
    assert proc is not None
    persisting = storage.create_writer("persisting", KeyGroupRange(0, 9))
    calling = storage.create_writer("calling", KeyGroupRange(10, 19))  # holds the flush back
    appending = storage.create_writer("appending", KeyGroupRange(20, 29))
    persisting.append(0, b"x")
    persist = persisting.persist_durably(0)
    calling.last_appended_sqn()  # the PERSIST reached the service
    appended: list[BaseException] = []

    def append_until_it_fails() -> None:
        try:
            for _ in range(2_000_000):  # far more than every buffer on the way: the gate stops it
                appending.append(20, b"y" * 100)
        except BaseException as exc:
            appended.append(exc)

    os.kill(proc.pid, signal.SIGSTOP)
    try:
        appender = threading.Thread(target=append_until_it_fails, daemon=True)
        appender.start()
        with pytest.raises(ServiceUnavailableError) as exc_info:
            calling.last_appended_sqn()
        appender.join(WAIT_S)
        assert not appender.is_alive()
        failures = [
            (exc_info.value, f"last_appended_sqn of writer {calling.log_id}"),
            (persist.exception(WAIT_S), f"persist_durably of writer {persisting.log_id}"),
            (appended[0], f"append of writer {appending.log_id}"),
        ]
        for error, what in failures:
            assert isinstance(error, ServiceUnavailableError)
            assert f"changelog service {storage.socket_path} unavailable: {what} failed: no answer for " in str(error)
        assert storage.lost is not None and "a liveness probe got no answer within 0.5 s" in storage.lost
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    # the worker goes on with a new connection to the (resumed) service
    writer = storage.create_writer("after", KeyGroupRange(0, 9))
    writer.append(0, b"z")
    assert writer.last_appended_sqn() == 1


def test_a_service_that_never_answers_a_request_is_declared_lost(tmp_path: Path, harness: Harness) -> None:
    """A scripted service reads OPEN_WRITER and never answers it, nor the liveness probe: the
    client gives up and closes the connection, so a real service would close the writer."""
    config = local_config(tmp_path)  # its dfs_timeout_ms, 60 s, bounds HELLO only
    path = service_socket_path(config, harness.socket_dir)
    outcome: list[BaseException] = []

    def worker() -> None:
        try:
            storage = harness.client(config, start=False, liveness=Liveness(quiet_s=0.2, answer_s=0.2))
            storage.create_writer("op", KeyGroupRange(0, 3))
        except BaseException as exc:
            outcome.append(exc)

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)  # the probe waits in the backlog: nobody accepts it
        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        conn, stream = accept_hello(listener)
        with conn, stream:
            got = read_message(stream)
            assert got is not None and got[1] == OpenWriter("op", KeyGroupRange(0, 3))
            thread.join(WAIT_S)
            (error,) = outcome
            assert isinstance(error, ServiceUnavailableError)
            assert f"changelog service {path} unavailable: create_writer failed: no answer for " in str(error)
            assert read_message(stream) is None  # the client closed the connection


def test_a_backpressured_service_answers_another_writers_call_late_but_answers(
    tmp_path: Path, harness: Harness
) -> None:
    """One writer's appends hold the service's connection thread in the storage (upload held):
    another writer's call waits behind them far past ``dfs_timeout_ms``, the liveness probes find
    the service alive meanwhile, and the call succeeds once the upload is released."""
    with FaultPlan() as plan:
        config = ChangelogConfig(
            base_path=faulty_base_path(tmp_path / "dfs", plan),
            persist_delay_ms=1.0,
            preemptive_persist_threshold=16 * 1024,
            max_in_flight_bytes=64 * 1024,
            upload_timeout_ms=30_000,
            dfs_timeout_ms=200,
            hedging=HedgingPolicy.disabled(),
        )
        service = harness.serve(config)
        storage = harness.client(config, start=False, liveness=Liveness(quiet_s=0.05, answer_s=WAIT_S))
        flooding = storage.create_writer("flooding", KeyGroupRange(0, 15))
        calling = storage.create_writer("calling", KeyGroupRange(16, 31))
        plan.add(Fault(op="put", action="stall"))
        errors: list[BaseException] = []
        stop = threading.Event()

        def flood() -> None:
            # Until told to stop: how much a service and its socket absorb before they push back
            # depends on thread scheduling, so a fixed number of appends may never reach the gate.
            try:
                i = 0
                while not stop.is_set() and i < FLOOD_CAP:
                    flooding.append(i % 16, i.to_bytes(4, "little") * 25)
                    i += 1
            except BaseException as exc:
                errors.append(exc)

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        try:
            assert plan.wait_stalled(1, WAIT_S)
            assert service.storage is not None
            metrics = service.storage.metrics

            def backpressured() -> bool:
                assert flooder.is_alive() and not errors, f"the flood ended before any backpressure: {errors}"
                return metrics.backpressure_waits > 0 and flooding.backpressure_waits > 0

            wait_until(backpressured, "backpressure")
        except BaseException:
            stop.set()  # no flood up to the cap after a failed assertion
            raise

        calling.append(16, b"behind the flood")
        outcome: list[Any] = []
        answered = threading.Event()

        def call() -> None:
            try:
                outcome.append(calling.last_appended_sqn())
            except BaseException as exc:
                outcome.append(exc)
            finally:
                answered.set()

        threading.Thread(target=call, daemon=True).start()
        assert not answered.wait(5 * config.dfs_timeout_ms / 1000)  # a per-call deadline would have failed it
        probes = storage.liveness_probes
        wait_until(lambda: storage.liveness_probes >= probes + 2, "the liveness rule to find the service alive")
        assert not answered.is_set() and storage.lost is None

        stop.set()
        plan.release()
        assert answered.wait(WAIT_S) and outcome == [1]
        flooder.join(WAIT_S)
        assert not flooder.is_alive() and not errors, errors


class Unmeasurable:
    def __len__(self) -> int:
        raise RuntimeError("cannot be measured")


def test_a_failing_sender_declares_the_connection_lost_with_its_cause(
    tmp_path: Path, harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    config = local_config(tmp_path)
    harness.serve(config)
    storage = harness.client(config, start=False)
    writer = storage.create_writer("op", KeyGroupRange(0, 3))
    caplog.set_level(logging.ERROR, logger="dstl.service.connection")
    writer.append(0, Unmeasurable())  # type: ignore[arg-type]
    wait_until(lambda: storage.lost is not None, "the sender to fail")
    cause = "the sender failed: RuntimeError('cannot be measured')"
    assert storage.lost == cause
    with pytest.raises(ServiceUnavailableError, match=re.escape(f"of writer {writer.log_id} failed: {cause}")):
        writer.last_appended_sqn()
    assert "the sender of the connection to" in caplog.text
