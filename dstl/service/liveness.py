"""Telling a service that is slow from one that stopped answering: the client's liveness rule.

Why it is shaped so: a worker waits on its service in three ways (a control call's reply, a
persist's future, the socket draining under an append gated by backpressure), and none of them may
wait forever on a service that stopped (SIGSTOP, swapped out, hung) yet keeps its socket open. A
deadline per wait cannot tell that service from a healthy one whose storage applies backpressure:
the service reads a connection's frames in order on one thread, which blocks in the storage
(``handler``), so one writer's request may wait behind another writer's appends for as long as the
uploads take. So the rule is about the service, not about one request:

- *Probe when nothing moves.* When the connection has something awaited (a request without its
  reply, or bytes not yet sent) and no byte has moved either way for ``quiet_s``, the client opens
  a second connection and says ``PING``. The service answers ``PONG`` from that connection's own
  thread, which never touches the storage: a service busy with backpressure answers, a stopped one
  does not.
- *No answer within* ``answer_s`` (or an answer from another service than the connection's)
  declares the connection lost: every outstanding call, future and gated append fails at once with
  ``ServiceUnavailableError`` saying "no answer for N s". An answer proves the service alive and
  the wait goes on; a healthy service bounds its own storage's waits by its upload timeouts.

Both bounds default to ``dfs_timeout_ms`` (``Liveness.of``): a service that stops answering is
detected within about two of them.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from dstl.config import ChangelogConfig
from dstl.errors import ConfigurationError
from dstl.service.protocol import Message, Ping, encode, read_message

__all__ = ["Liveness", "probe"]


@dataclass(frozen=True)
class Liveness:
    """How long a connection may wait with nothing moving before it probes (``quiet_s``), and how
    long the probe waits for its answer (``answer_s``), in seconds."""

    quiet_s: float
    answer_s: float

    def __post_init__(self) -> None:
        if not (self.quiet_s > 0 and self.answer_s > 0):
            raise ConfigurationError(f"liveness bounds must be positive, got {self}")

    @classmethod
    def of(cls, config: ChangelogConfig) -> Liveness:
        """The default: ``dfs_timeout_ms`` for both."""
        seconds = config.dfs_timeout_ms / 1000
        return cls(seconds, seconds)


def probe(socket_path: str, answer_s: float, track: Callable[[socket.socket | None], None]) -> Message:
    """Connect to ``socket_path`` anew, say PING, return the first reply (``Pong``, or the ``Error``
    of a service that refuses the connection). ``OSError`` or ``ProtocolError`` if none came within
    ``answer_s``. ``track`` is told the probe's socket while it is open (closing the connection
    shuts it down), then None."""
    deadline = time.monotonic() + answer_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    track(sock)
    try:
        sock.settimeout(answer_s)
        sock.connect(socket_path)
        sock.sendall(encode(Ping(), 1))
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        with sock.makefile("rb") as stream:
            got = read_message(stream)
        if got is None:
            raise ConnectionError("the service closed the probe's connection without an answer")
        return got[1]
    finally:
        track(None)
        sock.close()
