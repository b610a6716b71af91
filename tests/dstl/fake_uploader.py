"""An in-process ``Uploader`` for unit tests of the log's logic (batching, backpressure, ownership).

Objects live in a dict. When built with ``gated=True``, every ``put`` waits on an ``asyncio.Event``
that the test opens with ``open_gate(storage)``, so a test controls exactly when uploads finish.
``put_started`` is a ``threading.Event`` set when the first ``put`` begins; ``wait_for_puts(n)``
waits (from a test thread) until ``n`` puts have begun.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from dstl import ChangelogConfig, HedgingPolicy, StateChangelogStorage


class MemoryUploader:
    def __init__(self, *, gated: bool = False) -> None:
        self.objects: dict[str, bytes] = {}
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.put_started = threading.Event()
        self.puts = 0
        self._puts_changed = threading.Condition()

    async def put(self, path: str, data: bytes) -> None:
        with self._puts_changed:
            self.puts += 1
            self._puts_changed.notify_all()
        self.put_started.set()
        await self.gate.wait()
        self.objects[path] = bytes(data)

    async def get(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        try:
            data = self.objects[path]
        except KeyError:
            raise FileNotFoundError(path) from None
        return data[offset : None if length is None else offset + length]

    async def delete(self, path: str) -> None:
        self.objects.pop(path, None)

    def remove_empty_directory(self, path: str) -> bool:
        return True  # a dict has no directories

    async def list(self, prefix: str = "") -> list[str]:
        return sorted(p for p in self.objects if p.startswith(prefix))

    async def close(self) -> None:
        return None

    def wait_for_puts(self, count: int, timeout: float) -> bool:
        with self._puts_changed:
            return self._puts_changed.wait_for(lambda: self.puts >= count, timeout)

    def open_gate(self, storage: StateChangelogStorage) -> None:
        """Let every blocked and future ``put`` finish (runs ``gate.set`` on the storage's loop)."""

        async def open_() -> None:
            self.gate.set()

        storage.run(open_(), timeout=10)


def fake_storage(uploader: MemoryUploader, **overrides: Any) -> StateChangelogStorage:
    """A storage over ``uploader``; hedging off and a long attempt timeout so a closed gate never
    turns into retries, unless ``overrides`` say otherwise."""
    options: dict[str, Any] = {"hedging": HedgingPolicy.disabled(), "upload_timeout_ms": 60_000}
    options.update(overrides)
    return StateChangelogStorage(ChangelogConfig(base_path="memory://unused", **options), uploader=uploader)


async def barrier() -> None:
    """Run through ``storage.run``: returns once every call queued on the loop before it has run
    (writers hand requests to the loop with ``call_soon_threadsafe``, which is FIFO)."""
