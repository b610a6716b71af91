"""``MaterializationPoint``: the consistent cut a materialization reads, and its hold on the tables.

A materialization takes its cut on the operator's thread (``begin_materialization``: an LMDB read
transaction and the log's SQN with no write in between) and reads it in a background thread,
which may still run when the backend is closed: under Spark a worker drops a backend whose state
another worker has moved on from, without waiting for its upload. Closing LMDB under a running
read would free memory the reader is using, so every read of the cut holds the point's guard
(``reading``) and the backend ends the cut under the same guard (``release``): a close waits for
at most the read in progress (local, short; never an upload), and a read after it raises
``BackendClosedError``, so the materialization fails cleanly instead.

The point also names what it covers in terms another backend can check (``log_id``,
``log_sqn``): the state after that log up to that SQN. A backend of another process that carries
that log can take the finished materialization instead of starting its own
(``ChangelogKeyedStateBackend.adopt_materialization``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from backend.core.errors import BackendClosedError
from backend.state.folding import Fold
from dstl.types import KeyGroupRange

__all__ = ["MaterializationPoint"]


@dataclass(eq=False)
class MaterializationPoint:
    """A consistent cut for a materialization: every change up to ``sqn`` is in ``txn``'s view.

    ``dirty``: key groups changed since the previous materialization began; ``previous``: the
    chunk entries of that materialization (re-referenced where their key groups are clean);
    ``rewrite_all``: the state came (partly) from restored logs, so no previous chunk is complete,
    or ``folds`` fold older schema versions (``backend.state.folding``: their tables are left out
    of ``databases``, their entries were copied into today's tables, converted).
    ``log_id``/``log_sqn``: the log and SQN the cut covers, as a lineage that carries that log
    names them: the backend's own log at ``sqn``, or, if its own log has nothing yet, the last
    carried log up to its end.
    """

    sqn: int
    txn: Any
    databases: dict[str, Any]
    dirty: frozenset[int]
    previous: tuple[dict[str, Any], ...]
    key_group_range: KeyGroupRange
    log_bytes: int
    rewrite_all: bool = False
    log_id: str = ""
    log_sqn: int = 0
    folds: tuple[Fold, ...] = ()
    released: bool = False
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextmanager
    def reading(self) -> Iterator[Any]:
        """The read transaction, for one read: ``release`` waits until the read ends. Raises
        ``BackendClosedError`` if the cut was released (the backend closed)."""
        with self._guard:
            if self.released:
                raise BackendClosedError(f"the tables of key groups {self.key_group_range} were closed")
            yield self.txn

    def release(self) -> None:
        """End the read transaction (idempotent), after any read in progress."""
        with self._guard:
            if not self.released:
                self.released = True
                self.txn.abort()
