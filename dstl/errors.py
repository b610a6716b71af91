"""The one exception hierarchy of the project: every error we raise on purpose is a ``ChangelogError``.

Why one root: a caller (the CLI, a Spark task, a job's driver) can tell "the state backend refused
or failed, and says why" from a bug with one ``except``. The few branches say what went wrong,
not where: corrupt data, the DFS (storage), a closed writer, a bad configuration, the changelog
service's protocol. The subpackages of ``dstl`` (``dstl.storage``, ``dstl.service``) raise the
classes defined here; packages above ``dstl`` add their subclasses in their own errors module
(``backend.core.errors``, ``materializer.errors``, ``backend.tools.errors``), all under this
root. Every message names the file, object or option involved, so that an operator can find it.
"""

from __future__ import annotations


class ChangelogError(Exception):
    """Root of every error this project raises on purpose (log, state, checkpoints, tools)."""


class CorruptDataError(ChangelogError):
    """Stored bytes failed a check: bad magic, unknown version, checksum, truncation, lengths.

    ``path`` names the file (or handle) so that an operator can find and inspect it.
    """

    what = "file"

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"corrupt {self.what} {path}: {problem}")
        self.path = path
        self.problem = problem


class CorruptChangelogError(CorruptDataError):
    """A changelog file or handle failed a check."""

    what = "changelog file"


class ConfigurationError(ChangelogError, ValueError):
    """An option or argument is out of its range or inconsistent with another; names the option."""


class StorageError(ChangelogError):
    """A DFS operation failed for good (after its retries); names the operation and the object."""


class DeadlineExceededError(StorageError):
    """A DFS call got no answer within its deadline (``dfs_timeout_ms``) on its last attempt; the
    request was abandoned, so a write may still land later."""


class UploadFailedError(StorageError):
    """Every attempt to upload a changelog file failed; the persist future fails with this."""


class WriterClosedError(ChangelogError):
    """The writer (or its storage) was closed; nothing more can be appended or persisted."""


class StorageClosedError(WriterClosedError):
    """The storage is closed, or far enough into closing that nothing new may start on its loop.

    Raised instead of scheduling work on a loop that is about to stop, where it would never run
    and its caller would wait forever (e.g. a Spark progress listener racing a driver's shutdown).
    """


class ProtocolError(ChangelogError):
    """A frame or message of the changelog service's protocol (``dstl.service``) broke it:
    truncated, oversized, unknown kind, bad field."""


class TruncatedFrameError(ProtocolError):
    """The stream ended inside a frame: the peer died or closed while sending."""


class ServiceUnavailableError(StorageError, WriterClosedError):
    """The changelog service could not be reached, did not start, or its connection was lost.

    Also a ``WriterClosedError``: a writer whose connection is lost never reconnects (its SQNs and
    unpersisted changes died with that connection), so every later call of it raises."""


class FencedWriterError(WriterClosedError):
    """The writer's operator and key-group range were opened again by a newer attempt (a retried
    task); the older writer was closed and every request naming it fails."""


# -- what one upload attempt ended with (dstl.hedging): the causes an UploadFailedError names --


class AttemptTimedOut(TimeoutError):
    """An upload attempt got no answer within ``upload_timeout_ms`` (the uploader's own
    ``TimeoutError``, a socket's or an ``ETIMEDOUT``, is an error it raised: ``AttemptFailed``)."""


class AttemptFailed(Exception):
    """What an upload attempt's uploader raised, and after how long (the message says both)."""


__all__ = [
    "AttemptFailed",
    "AttemptTimedOut",
    "ChangelogError",
    "ConfigurationError",
    "CorruptChangelogError",
    "CorruptDataError",
    "DeadlineExceededError",
    "FencedWriterError",
    "ProtocolError",
    "ServiceUnavailableError",
    "StorageClosedError",
    "StorageError",
    "TruncatedFrameError",
    "UploadFailedError",
    "WriterClosedError",
]
