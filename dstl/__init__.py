"""The durable short-term log (DSTL): batched, hedged, checksummed changelog files on a DFS.

Knows bytes, key groups and sequence numbers; knows nothing of state types or Spark.
"""

from dstl.api import ChangelogStorage, DfsFiles, StateChangelogWriter
from dstl.config import ChangelogConfig, HedgingPolicy, S3Options
from dstl.errors import (
    ChangelogError,
    ConfigurationError,
    CorruptChangelogError,
    CorruptDataError,
    StorageClosedError,
    StorageError,
    UploadFailedError,
    WriterClosedError,
)
from dstl.storage import StateChangelogStorage
from dstl.types import ChangelogHandle, KeyGroupRange, Note, NotedHandle, SegmentRef, SequenceNumber
from dstl.uploaders import Uploader, make_uploader
from dstl.writer import ChangelogWriter, WriterStorage

__all__ = [
    "ChangelogConfig",
    "ChangelogError",
    "ChangelogHandle",
    "ChangelogStorage",
    "ChangelogWriter",
    "ConfigurationError",
    "CorruptChangelogError",
    "CorruptDataError",
    "DfsFiles",
    "HedgingPolicy",
    "KeyGroupRange",
    "Note",
    "NotedHandle",
    "S3Options",
    "SegmentRef",
    "SequenceNumber",
    "StateChangelogStorage",
    "StateChangelogWriter",
    "StorageClosedError",
    "StorageError",
    "UploadFailedError",
    "Uploader",
    "WriterClosedError",
    "WriterStorage",
    "make_uploader",
]
