"""The per-executor changelog service: one ``StateChangelogStorage`` shared by the Python workers of a host.

FLIP-158 writes one file per flush for all the writers of a TaskManager; under Spark those
writers live in several worker processes, so they share a storage in a process of their own.
The service (``server.ChangelogService``, ``python -m dstl.service``) owns the storage and listens
on a Unix socket named by the configuration's fingerprint; ``handler`` serves each connection.
Workers use a ``client.RemoteChangelogStorage``, which finds or starts the service (``launch``),
streams appends to it over one connection (``connection``, its unsent changes in ``outbox``, its
liveness rule in ``liveness``) and reads straight from the DFS. The wire format is ``framing``
(frames), ``appends`` (the binary APPEND message) and ``protocol`` (the control messages);
``configjson`` is how a configuration travels. Its errors are classes of ``dstl.errors``, re-exported
here. The service is a transport around the ordinary storage, not a second implementation.
"""

from __future__ import annotations

from dstl.errors import FencedWriterError, ProtocolError, ServiceUnavailableError
from dstl.service.client import RemoteChangelogStorage, RemoteChangelogWriter
from dstl.service.launch import service_socket_path
from dstl.service.liveness import Liveness
from dstl.service.server import ChangelogService

__all__ = [
    "ChangelogService",
    "FencedWriterError",
    "Liveness",
    "ProtocolError",
    "RemoteChangelogStorage",
    "RemoteChangelogWriter",
    "ServiceUnavailableError",
    "service_socket_path",
]
