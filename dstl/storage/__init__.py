"""The changelog storage of a process: writers, batched uploads, file ownership, reading handles.

``StateChangelogStorage`` (``storage.py``) is the facade every caller uses, a
``dstl.api.ChangelogStorage``; its parts are one module each: ``loop`` (the asyncio loop thread
and closing), ``files`` (the ``dstl.api.DfsFiles`` of the storage: every file call, retried, and
deletion in the background), ``registry`` (writers and file reference counts), ``throttle``
(bytes in flight, pre-emptive persists) and ``reader`` (handles read back with read-ahead).
"""

from __future__ import annotations

from dstl.storage.storage import StateChangelogStorage

__all__ = ["StateChangelogStorage"]
