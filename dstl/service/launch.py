"""Finding or starting the changelog service of a configuration: its socket, the files beside it, the start lock.

Why it is shaped so:

- *One service per host and configuration.* The socket is ``<dir>/<fingerprint prefix>.v<protocol>.sock``
  (``service_socket_path``): workers with one configuration share a service, workers with
  another never do. The directory (default ``<tmp>/dstl-svc-<uid>``) must be ours and writable
  by no one else: whoever can write there could replace the socket and receive every change.
- *The start lock* (``flock`` on ``<socket>.lock``) is held to start a service, to connect and
  say ``HELLO``, and by a service to exit idle, so two workers never start two services and a
  client never reaches a service that is about to exit (``reach_service``).
- *Epochs.* Each start takes the next integer from ``<socket>.epoch`` under that lock (written
  whole and durably: ``dstl.atomic``); the service puts it in its log
  ids, so a restarted service is recognisable in them (their uuid alone keeps them unique). An
  epoch file that cannot be read or holds no number counts as 0, with a warning: it never stops
  a service from starting.
- *Start on demand.* If nothing listens, ``python -m dstl.service`` is spawned in a session of
  its own (signals to a worker's process group do not reach it), the configuration on its stdin (it may hold S3
  secrets; the command line holds none), its stderr appended to ``<socket>.log`` (mode 600); the
  starter reads its stdout lines until ``READY`` for at most ``start_timeout_ms`` (120 s by
  default: a cold interpreter importing the storage's dependencies, not a DFS call) and
  otherwise kills it and raises ``ServiceUnavailableError`` with the log's tail. A thread reaps
  the child when it exits.

The service (``server``) and the client (``client``) both use these helpers; nothing here
imports either of them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

from dstl.atomic import write_atomically
from dstl.config import ChangelogConfig
from dstl.errors import ConfigurationError, ServiceUnavailableError
from dstl.service.configjson import dumps_config, fingerprint
from dstl.service.protocol import PROTOCOL_VERSION

__all__ = [
    "START_TIMEOUT_MS",
    "default_socket_dir",
    "next_epoch",
    "prepare_socket_dir",
    "reach_service",
    "service_socket_path",
    "spawn_service",
    "start_lock",
    "try_connect",
]

#: AF_UNIX paths hold at most 107 bytes on Linux (108 with the terminating NUL)
SOCKET_PATH_MAX = 107
_LOG_TAIL_LINES = 20
_LOG_MAX_BYTES = 1 << 20
#: how long a service started on demand may take to print READY, by default
START_TIMEOUT_MS = 120_000  # an interpreter importing the storage stack takes tens of seconds on a loaded host

_log = logging.getLogger(__name__)


# -- the files of a service -------------------------------------------------------------------


#: where the sockets go when the temporary directory's path is too long for one (AF_UNIX)
_SHORT_TMP = "/tmp"


def default_socket_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"dstl-svc-{os.getuid()}")


def service_socket_path(config: ChangelogConfig, socket_dir: str | os.PathLike[str] | None = None) -> str:
    """The socket of the service for ``config``: ``<dir>/<fingerprint prefix>.v<protocol>.sock``
    under ``socket_dir`` or ``<tmp>/dstl-svc-<uid>``. Named by the config's fingerprint, so that
    workers with different configurations never share a service; short, because AF_UNIX paths
    are limited. A given ``socket_dir`` that makes it too long is refused (``ConfigurationError``);
    the default falls back to ``/tmp/dstl-svc-<uid>`` when ``TMPDIR`` is too long (a deep
    temporary directory, as notebooks and test harnesses make: every worker of that environment
    computes the same fallback)."""
    name = f"{fingerprint(config)[:24]}.v{PROTOCOL_VERSION}.sock"
    directory = os.fspath(socket_dir) if socket_dir is not None else default_socket_dir()
    path = os.path.join(os.path.abspath(directory), name)
    if socket_dir is None and len(os.fsencode(path)) > SOCKET_PATH_MAX and os.path.isdir(_SHORT_TMP):
        path = os.path.join(_SHORT_TMP, f"dstl-svc-{os.getuid()}", name)
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise ConfigurationError(
            f"changelog service socket path {path} is {len(os.fsencode(path))} bytes, more than the "
            f"{SOCKET_PATH_MAX} a Unix socket allows: choose a shorter socket_dir"
        )
    return path


def prepare_socket_dir(socket_path: str) -> None:
    """Create the socket's directory (mode 700); refuse one that another user owns or may write to
    (whoever can write there could replace the socket and receive every change)."""
    directory = os.path.dirname(socket_path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConfigurationError(
            f"changelog service directory {directory} must be a directory owned by uid {os.getuid()} that "
            f"no one else may write to (found uid {st.st_uid}, mode {stat.filemode(st.st_mode)})"
        )


@contextlib.contextmanager
def start_lock(socket_path: str, timeout_s: float) -> Iterator[None]:
    """The start lock of a service (``flock`` on ``<socket>.lock``): held to start a service, to
    connect and say HELLO, and by a service to exit idle. ``ServiceUnavailableError`` after
    ``timeout_s``."""
    fd = os.open(f"{socket_path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ServiceUnavailableError(
                        f"changelog service {socket_path}: its start lock {socket_path}.lock was held "
                        f"for more than {timeout_s:g} s"
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def next_epoch(socket_path: str) -> int:
    """Increment and return the epoch in ``<socket>.epoch``, durably; call under the start lock. A
    missing file counts as 0, and so, with a warning, does one that is unreadable or holds no number."""
    path = f"{socket_path}.epoch"
    try:
        with open(path, encoding="ascii") as f:
            text = f.read(64).strip()
    except FileNotFoundError:
        text = "0"
    except (OSError, UnicodeDecodeError) as exc:
        _log.warning("changelog service epoch file %s is unreadable (%s): counting from 0", path, exc)
        text = "0"
    if not (text.isascii() and text.isdigit() and len(text) <= 18):
        _log.warning("changelog service epoch file %s holds %r, not an epoch number: counting from 0", path, text)
        text = "0"
    epoch = int(text) + 1
    write_atomically(path, f"{epoch}\n")
    return epoch


def try_connect(path: str, timeout_s: float | None) -> socket.socket | None:
    """A connected socket, or None if nothing listens on ``path`` (``timeout_s`` bounds the connect)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except OSError as exc:
        sock.close()
        raise ServiceUnavailableError(f"cannot connect to the changelog service {path}: {exc}") from None
    sock.settimeout(None)
    return sock


# -- start on demand ------------------------------------------------------------------------------


def _log_tail(log_path: str) -> str:
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError as exc:
        return f"(cannot read {log_path}: {exc})"
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _read_ready_line(proc: subprocess.Popen[bytes], deadline: float) -> bytes | None:
    """The service's ``READY`` line (other lines of its stdout are skipped); ``b""`` if its stdout
    ended first, None at the deadline."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.startswith(b"READY "):
                return line
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            chunk = os.read(fd, 4096)
            if not chunk:
                return b""
            buf = buf[-4096:] + chunk  # a line without end must not fill the memory


def spawn_service(
    config: ChangelogConfig, path: str, idle_timeout_ms: int, start_timeout_ms: int = START_TIMEOUT_MS
) -> subprocess.Popen[bytes]:
    """Start ``python -m dstl.service`` for ``path`` (under the start lock) and wait until it
    listens, at most ``start_timeout_ms``."""
    epoch = next_epoch(path)
    log_path = f"{path}.log"
    with contextlib.suppress(FileNotFoundError):
        if os.path.getsize(log_path) > _LOG_MAX_BYTES:
            os.unlink(log_path)
    command = [sys.executable, "-m", "dstl.service", "--socket", path, "--epoch", str(epoch)]
    command += ["--idle-timeout-ms", str(idle_timeout_ms)]
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(log_fd, 0o600)  # also a log an older start left readable
        proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_fd, start_new_session=True
        )
    finally:
        os.close(log_fd)
    # reap the child whenever it exits (Popen's waits may run concurrently)
    threading.Thread(target=proc.wait, name=f"dstl-svc-reap-{proc.pid}", daemon=True).start()
    assert proc.stdin is not None and proc.stdout is not None
    try:
        with contextlib.suppress(BrokenPipeError):  # it died: the ready line says so
            proc.stdin.write(dumps_config(config).encode())
            proc.stdin.close()
        line = _read_ready_line(proc, time.monotonic() + start_timeout_ms / 1000)
    finally:
        proc.stdout.close()
    if line is None or not line.startswith(b"READY "):
        if line is None:
            proc.kill()
            why = f"did not become ready within {start_timeout_ms} ms (killed)"
        try:
            proc.wait(start_timeout_ms / 1000)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if line is not None:
            why = f"exited with status {proc.returncode} before it was ready"
        raise ServiceUnavailableError(
            f"the changelog service for {path} {why}; last lines of {log_path}:\n{_log_tail(log_path)}"
        )
    return proc


@contextlib.contextmanager
def reach_service(
    config: ChangelogConfig,
    path: str,
    *,
    start: bool,
    idle_timeout_ms: int,
    start_timeout_ms: int = START_TIMEOUT_MS,
    started: Callable[[subprocess.Popen[bytes]], None],
) -> Iterator[socket.socket]:
    """Under the start lock: a socket connected to the service on ``path``, starting one if none
    listens (``start=False``: ``ServiceUnavailableError`` instead). ``started`` is told the process
    as soon as it is spawned, even if connecting to it then fails. The caller says HELLO inside the
    block, so the service cannot exit idle between the connect and the HELLO."""
    prepare_socket_dir(path)
    timeout_s = config.dfs_timeout_ms / 1000
    # a holder may be starting a service and saying HELLO: wait out its deadlines
    with start_lock(path, start_timeout_ms / 1000 + 2 * timeout_s + 5):
        sock = try_connect(path, timeout_s)
        if sock is None:
            if not start:
                raise ServiceUnavailableError(f"no changelog service listens on {path} (start=False)")
            started(spawn_service(config, path, idle_timeout_ms, start_timeout_ms))
            sock = try_connect(path, timeout_s)
            if sock is None:
                raise ServiceUnavailableError(f"the changelog service for {path} was ready but nothing listens")
        yield sock
