"""The durable short-term log (DSTL): batched, hedged, checksummed changelog files on a DFS.

Knows bytes, key groups and sequence numbers; knows nothing of state types or Spark.
"""

from dstl.config import ChangelogConfig, HedgingPolicy, S3Options
from dstl.errors import (
    ChangelogError,
    CorruptChangelogError,
    StorageClosedError,
    UploadFailedError,
    WriterClosedError,
)
from dstl.storage import StateChangelogStorage
from dstl.types import ChangelogHandle, KeyGroupRange, SegmentRef, SequenceNumber
from dstl.writer import ChangelogWriter

__all__ = [
    "ChangelogConfig",
    "ChangelogError",
    "ChangelogHandle",
    "ChangelogWriter",
    "CorruptChangelogError",
    "HedgingPolicy",
    "KeyGroupRange",
    "S3Options",
    "SegmentRef",
    "SequenceNumber",
    "StateChangelogStorage",
    "StorageClosedError",
    "UploadFailedError",
    "WriterClosedError",
]
