"""Helpers of the changelog service tests: records to append, a scripted service's first steps, the
``Harness`` that stops and closes every service and client of a test, and the S3 environment
(a bucket of the session's moto server behind a fault proxy).

Services run either in this process (``Harness.serve``: a ``ChangelogService`` on its own
threads, still a real Unix socket, for tests that look at the service's storage or put a
``faulty://`` store behind it) or as the process a ``RemoteChangelogStorage`` starts on demand.
``WAIT_S`` only bounds a hang: a passing test never waits that long. The fixtures that hand these
to tests are in ``conftest.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.support.fault_plan import FaultPlan
from benchmarks.support.fault_proxy import FaultProxy
from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY
from dstl import ChangelogConfig, S3Options
from dstl.service import ChangelogService, RemoteChangelogStorage, service_socket_path
from dstl.service.protocol import Hello, Welcome, encode, read_message
from tests.support import polling

WAIT_S = 30.0
#: appends of 100 bytes after which a flood that met no backpressure fails its test (bounded memory)
FLOOD_CAP = 2_000_000

Records = list[tuple[int, bytes]]


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    polling.wait_until(predicate, what, WAIT_S)


def accept_hello(listener: socket.socket) -> tuple[socket.socket, Any]:
    """A scripted service's first steps: accept a client, read its HELLO, answer WELCOME (epoch 1)."""
    conn, _ = listener.accept()
    conn.settimeout(WAIT_S)
    stream = conn.makefile("rb")
    got = read_message(stream)
    assert got is not None and isinstance(got[1], Hello)
    conn.sendall(encode(Welcome(1, os.getpid()), got[0]))
    return conn, stream


def make_records(key_groups: range, tag: str, count: int) -> Records:
    return [(key_groups[i % len(key_groups)], f"{tag}:{i}:{'x' * (i % 29)}".encode()) for i in range(count)]


def append_all(writer: Any, records: Records) -> None:
    for kg, data in records:
        writer.append(kg, data)


def stop_process(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(WAIT_S)


@dataclass
class Harness:
    """Services and clients of one test, stopped and closed at teardown."""

    socket_dir: Path
    services: list[ChangelogService] = field(default_factory=list)
    clients: list[RemoteChangelogStorage] = field(default_factory=list)
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def serve(self, config: ChangelogConfig, path: str | None = None, **options: Any) -> ChangelogService:
        """A service in this process, on the socket clients of ``config`` look for unless ``path``."""
        options.setdefault("idle_timeout_ms", None)
        service = ChangelogService(config, path or service_socket_path(config, self.socket_dir), **options)
        service.start()
        self.services.append(service)
        return service

    def client(self, config: ChangelogConfig, **options: Any) -> RemoteChangelogStorage:
        """A worker's storage; starts a service process on demand unless ``start=False``."""
        options.setdefault("socket_dir", self.socket_dir)
        storage = RemoteChangelogStorage(config, **options)
        self.clients.append(storage)
        if storage.service_process is not None:
            self.processes.append(storage.service_process)
        return storage

    def close(self) -> None:
        for storage in self.clients:
            storage.close()
        for service in self.services:
            service.close()
        for proc in self.processes:
            stop_process(proc)


def local_config(tmp_path: Path, **overrides: Any) -> ChangelogConfig:
    """A local DFS; no timer flushes unless asked: a flush happens when every writer persists."""
    overrides.setdefault("persist_delay_ms", 600_000.0)
    return ChangelogConfig.local(tmp_path / "dfs", **overrides)


def log_files(config: ChangelogConfig) -> list[str]:
    root = Path(config.base_path) / "dstl"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


@dataclass
class S3Env:
    """A bucket, a fault proxy in front of moto (rules apply under ``<bucket>/job1``) and its plan."""

    endpoint_url: str
    bucket: str
    proxy: FaultProxy
    plan: FaultPlan

    def config(self, *, through_proxy: bool = True, **overrides: Any) -> ChangelogConfig:
        s3 = S3Options(
            endpoint_url=self.proxy.url if through_proxy else self.endpoint_url,
            region=REGION,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
        )
        return ChangelogConfig(base_path=f"s3://{self.bucket}/job1", s3=s3, **overrides)
