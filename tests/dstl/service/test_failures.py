"""Finding and starting the changelog service, and what goes wrong there: no service, a service
that dies or hangs on start, two workers starting one at once, the files next to the socket, a
service of another configuration, one that never answers HELLO, one that ends the connection.

What a user relies on: exactly one service per configuration and host, started from the worker
with no secret on its command line and a private log; and every failure is an error that names
the socket and says what happened.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

import dstl
from dstl import KeyGroupRange, S3Options
from dstl.atomic import is_temporary
from dstl.errors import ConfigurationError, DeadlineExceededError
from dstl.service import RemoteChangelogStorage, ServiceUnavailableError, service_socket_path
from dstl.service.configjson import dumps_config
from dstl.service.protocol import Error, OpenWriter, encode, read_message
from dstl.uploaders.fsspec import FsspecUploader
from tests.dstl.service.harness import (
    WAIT_S,
    Harness,
    accept_hello,
    append_all,
    local_config,
    make_records,
    stop_process,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[3]

# -- starting a service ------------------------------------------------------------------------------


def test_no_service_and_start_false_names_the_socket(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path)
    with pytest.raises(ServiceUnavailableError) as exc_info:
        harness.client(config, start=False)
    assert f"no changelog service listens on {service_socket_path(config, harness.socket_dir)}" in str(exc_info.value)


def broken_installation(directory: Path, init: str) -> None:
    (directory / "dstl").mkdir()
    (directory / "dstl" / "__init__.py").write_text(init)


def test_a_service_that_dies_on_start_is_reported_with_its_log(
    tmp_path: Path, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = local_config(tmp_path)
    broken_installation(tmp_path, "raise RuntimeError('broken installation for this test')\n")
    monkeypatch.chdir(tmp_path)  # ``python -m dstl.service`` imports this dstl first
    with pytest.raises(ServiceUnavailableError) as exc_info:
        harness.client(config)
    message = str(exc_info.value)
    path = service_socket_path(config, harness.socket_dir)
    assert f"the changelog service for {path} exited with status 1 before it was ready" in message
    assert f"last lines of {path}.log" in message and "broken installation for this test" in message


def test_a_service_that_never_gets_ready_is_killed_at_the_start_deadline(
    tmp_path: Path, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = local_config(tmp_path)  # dfs_timeout_ms has no say: starting has a timeout of its own
    broken_installation(tmp_path, "import threading\nthreading.Event().wait()\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ServiceUnavailableError, match="did not become ready within 500 ms \\(killed\\)"):
        harness.client(config, start_timeout_ms=500)


def test_lines_the_service_prints_before_ready_are_skipped(
    tmp_path: Path, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Path(dstl.__file__).parent
    broken_installation(
        tmp_path,
        "print('a library greets stdout on import', flush=True)\n"
        f"__path__ = [{str(real)!r}]\n"
        f"exec(compile(open({str(real / '__init__.py')!r}).read(), 'dstl/__init__.py', 'exec'))\n",
    )
    monkeypatch.chdir(tmp_path)
    storage = harness.client(local_config(tmp_path))
    assert storage.service_process is not None and storage.service_pid == storage.service_process.pid


STARTER = """
import sys
from dstl.service import RemoteChangelogStorage
from dstl.service.configjson import loads_config
config = loads_config(sys.stdin.readline())
sys.stdin.readline()  # go
storage = RemoteChangelogStorage(config, socket_dir=sys.argv[1], idle_timeout_ms=int(sys.argv[2]))
print(storage.service_pid, storage.service_process is not None, flush=True)
sys.stdin.read()
storage.close()
"""


def test_two_workers_starting_at_once_start_one_service(tmp_path: Path, socket_dir: Path) -> None:
    config = local_config(tmp_path)
    path = service_socket_path(config, socket_dir)
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", STARTER, str(socket_dir), "300"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    pids: list[int] = []
    try:
        for worker in workers:  # both are up and waiting
            assert worker.stdin is not None
            worker.stdin.write(dumps_config(config) + "\n")
            worker.stdin.flush()
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        lines = [worker.stdout.readline().split() for worker in workers if worker.stdout is not None]
        pids = [int(pid) for pid, _ in lines]
        assert pids[0] == pids[1] and sorted(started for _, started in lines) == ["False", "True"]
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.close()
            assert worker.wait(WAIT_S) == 0
        wait_until(lambda: not os.path.exists(path), "the service to exit once idle")
    finally:
        for worker in workers:
            stop_process(worker)
        if pids and os.path.exists(path):
            os.kill(pids[0], signal.SIGKILL)


def test_the_service_gets_no_secret_on_its_command_line_and_logs_privately(tmp_path: Path, harness: Harness) -> None:
    secret = "not-on-the-command-line-4f1c"
    config = local_config(tmp_path, s3=S3Options(access_key_id="AKIA", secret_access_key=secret))
    storage = harness.client(config)
    assert storage.service_process is not None
    cmdline = Path(f"/proc/{storage.service_pid}/cmdline").read_bytes()
    assert b"dstl.service" in cmdline and secret.encode() not in cmdline
    log = os.stat(f"{storage.socket_path}.log")
    assert stat.S_IMODE(log.st_mode) == 0o600


def listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(path) == 0


def test_a_service_whose_ready_line_nobody_reads_serves_on(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path)
    path = service_socket_path(config, harness.socket_dir)
    read_end, write_end = os.pipe()
    os.close(read_end)  # its starter is gone: READY meets a broken pipe
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dstl.service", "--socket", path],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=write_end,
            stderr=subprocess.PIPE,
        )
    finally:
        os.close(write_end)
    harness.processes.append(proc)
    assert proc.stdin is not None and proc.stderr is not None
    proc.stdin.write(dumps_config(config).encode())
    proc.stdin.close()
    wait_until(lambda: listening(path) or proc.poll() is not None, "the service to listen")
    storage = harness.client(config, start=False)
    writer = storage.create_writer("op", KeyGroupRange(0, 3))
    records = make_records(range(4), "served", 10)
    append_all(writer, records)
    assert list(storage.read(writer.persist_durably(0).result(WAIT_S))) == records
    storage.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(WAIT_S) == 0
    assert b"nobody reads the READY line" in proc.stderr.read()


# -- the files next to the socket -----------------------------------------------------------------------


def test_a_temporary_directory_too_deep_for_a_socket_falls_back_to_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default socket directory is under the temporary directory; one whose path leaves no room
    for a socket (a deep TMPDIR) falls back to /tmp, where it did fail every worker's first task."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    path = service_socket_path(local_config(tmp_path))
    assert path.startswith(f"/tmp/dstl-svc-{os.getuid()}/") and len(os.fsencode(path)) <= 107


def test_the_socket_and_the_files_next_to_it_are_checked(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path)
    with pytest.raises(ConfigurationError, match="more than the 107 a Unix socket allows"):
        service_socket_path(config, "/tmp/" + "d" * 100)
    open_dir = harness.socket_dir / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(ConfigurationError, match="that no one else may write to"):
        RemoteChangelogStorage(config, socket_dir=open_dir)

    path = service_socket_path(config, harness.socket_dir)
    Path(f"{path}.epoch").write_text("41\n")
    os.mkdir(path)
    with pytest.raises(ConfigurationError, match="exists and is not a socket"):
        harness.serve(config)
    os.rmdir(path)
    service = harness.serve(config)
    assert service.epoch == 43  # each start takes the next epoch, failed ones too
    with pytest.raises(ConfigurationError, match=f"a changelog service already listens on {path}"):
        harness.serve(config)


def test_a_bad_epoch_file_counts_as_zero_and_epochs_are_synced(
    tmp_path: Path, harness: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = local_config(tmp_path)
    path = service_socket_path(config, harness.socket_dir)
    synced: list[str] = []
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    caplog.set_level(logging.WARNING, logger="dstl.service.launch")
    for content, problem in ((b"garbage", "holds 'garbage', not an epoch number"), (b"\xff\xfe", "is unreadable")):
        Path(f"{path}.epoch").write_bytes(content)
        service = harness.serve(config)
        assert service.epoch == 1  # the start goes on
        assert f"changelog service epoch file {path}.epoch {problem}" in caplog.text
        assert Path(f"{path}.epoch").read_text() == "1\n"
        written, directory = [p for p in synced if p.startswith(str(harness.socket_dir))]
        assert is_temporary(written) and written.startswith(f"{harness.socket_dir}/.{Path(path).name}.epoch.")
        assert directory == str(harness.socket_dir)  # the rename is made durable too
        service.close()
        synced.clear()


# -- services that answer wrongly -------------------------------------------------------------------------


def test_a_service_of_another_configuration_is_refused_at_hello(tmp_path: Path, harness: Harness) -> None:
    mine, other = local_config(tmp_path / "mine"), local_config(tmp_path / "other")
    harness.serve(other, path=service_socket_path(mine, harness.socket_dir))
    with pytest.raises(ConfigurationError, match="serves another configuration"):
        harness.client(mine, start=False)


def test_a_silent_service_fails_hello_at_its_deadline(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path, dfs_timeout_ms=300)
    path = service_socket_path(config, harness.socket_dir)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)  # accepts (the kernel does) and never answers
        with pytest.raises(DeadlineExceededError) as exc_info:
            harness.client(config, start=False)
    assert str(exc_info.value) == f"changelog service {path}: hello: no reply within 300 ms"


def test_the_reason_a_service_gives_for_ending_the_connection_is_the_error_cause(
    tmp_path: Path, harness: Harness
) -> None:
    """An ERROR with request id 0 (a protocol error, a refusal) is what every failure reports."""
    config = local_config(tmp_path)
    path = service_socket_path(config, harness.socket_dir)
    requests: list[object] = []

    def script(listener: socket.socket) -> None:
        conn, stream = accept_hello(listener)
        with conn, stream:
            got = read_message(stream)
            requests.append(got[1] if got is not None else None)
            conn.sendall(encode(Error("ProtocolError", "scripted: this request broke the protocol"), 0))

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        thread = threading.Thread(target=script, args=(listener,), daemon=True)
        thread.start()
        storage = harness.client(config, start=False)
        with pytest.raises(ServiceUnavailableError) as exc_info:
            storage.create_writer("op", KeyGroupRange(0, 3))
        thread.join(WAIT_S)
    assert requests == [OpenWriter("op", KeyGroupRange(0, 3))]
    cause = "the service ended the connection: ProtocolError: scripted: this request broke the protocol"
    assert f"changelog service {path} unavailable: create_writer failed: {cause}" in str(exc_info.value)
    assert storage.lost == cause


class CloseFails(FsspecUploader):
    async def close(self) -> None:
        await super().close()
        raise OSError("the store refused to close")


def test_a_failed_final_close_is_kept_for_the_exit_status(tmp_path: Path, harness: Harness) -> None:
    """``python -m dstl.service`` exits with status 1 when ``close_error`` is set."""
    config = local_config(tmp_path)
    service = harness.serve(config, uploader=CloseFails(config.base_path))
    with pytest.raises(OSError, match="the store refused to close"):
        service.close()
    assert isinstance(service.close_error, OSError)
