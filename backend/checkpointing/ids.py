"""The checkpoint-id counter: ids that no two runs of a job directory share (Flink's HA counter).

Why durable: a run that dies may leave writes in flight (a ``_metadata`` or fence PUT its client
gave up on, which an object store can still complete). If the next run used the same id again,
such a late write would land on the new run's checkpoint: a late fence hides it from the next
recovery, a late ``_metadata`` replaces it. Flink keeps its counter in ZooKeeper or Kubernetes; an
object store has no compare-and-set, so a run reserves a block of ids instead, by writing a new
object ``_ids/<start>-<end>`` (never overwritten), and takes ids from a block only once that write
is known to have succeeded. The next run starts after every id it sees: the ``chk-<n>``
directories (fenced ones included) and the ends of ``_ids/*``.

- A reservation whose write failed may still land: its block is skipped, never used, and the
  failure fails the checkpoint that needed an id (the next one reserves the block after it).
- Reserved lazily, by the first automatic id: a caller bringing its own ids (the Spark driver,
  whose checkpoint id is a batch id, unique by Spark's own offset log) writes no reservation.
- A run that stops cleanly shrinks its reservation to the ids it used (a new ``_ids/<start>-<last>``,
  then the delete of the block), so ids stay consecutive across clean restarts; after a crash
  the next run starts after the whole block.
- Recovery keeps the reservation with the highest end and deletes the others, which lie below it
  (``backend.checkpointing.store``).
"""

from __future__ import annotations

import json
import logging

from backend.checkpointing.metadata import id_block_path
from backend.core.errors import CheckpointError
from dstl.api import DfsFiles
from dstl.errors import ConfigurationError, StorageClosedError

__all__ = ["ID_BLOCK_SIZE", "CheckpointIdCounter"]

_log = logging.getLogger(__name__)

#: ids one reservation covers: one PUT per this many checkpoints of a run
ID_BLOCK_SIZE = 1_000_000


class CheckpointIdCounter:
    """Hands out checkpoint ids, each after every id used or seen, automatic ones from a reserved block."""

    def __init__(self, files: DfsFiles, block_size: int = ID_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ConfigurationError(f"block_size must be >= 1, got {block_size}")
        self.files = files
        self.block_size = block_size
        #: the highest id used, seen by recovery, or lying in a block whose reservation failed
        self.last = -1
        #: the block automatic ids come from, once its reservation is known to be written
        self.block: tuple[int, int] | None = None

    def seen(self, checkpoint_id: int) -> None:
        """Recovery saw ``checkpoint_id`` (a checkpoint directory or a reservation's end)."""
        self.last = max(self.last, checkpoint_id)

    def take(self, checkpoint_id: int | None = None) -> int:
        """The next id, or ``checkpoint_id`` if it is after every id used or seen. Raises
        ``CheckpointError`` if the id is not after them, or if the reservation of a new block failed."""
        if checkpoint_id is not None:
            if checkpoint_id <= self.last:
                raise CheckpointError(f"checkpoint id {checkpoint_id} is not after the last one ({self.last})")
            self.last = checkpoint_id
            return checkpoint_id
        following = max(1, self.last + 1)
        if self.block is None or not self.block[0] <= following <= self.block[1]:
            self._reserve(following)
        self.last = following
        return following

    def _reserve(self, start: int) -> None:
        end = start + self.block_size - 1
        path = id_block_path(start, end)
        try:
            self._write(start, end)
        except StorageClosedError:
            raise  # refused before it started: nothing can land
        except Exception as exc:
            self.last = end  # it may land later: never use this block
            raise CheckpointError(
                f"reserving checkpoint ids {start}..{end} ({path}) failed ({exc}); "
                "the next checkpoint reserves the block after it"
            ) from exc
        previous, self.block = self.block, (start, end)
        if previous is not None:  # below the new one: no longer needed to keep ids unique
            self.files.delete_later(id_block_path(*previous))

    def close(self, discard: bool = False) -> None:
        """Shrink the reservation to the ids used, or with ``discard`` delete it (a cancelled job
        whose checkpoints are deleted: it leaves nothing, as Flink drops a terminated job's HA
        data). Best effort: if it fails, the next run starts after the whole block. Call only once
        no write of this run can still be started."""
        if self.block is None:
            return
        (start, end), self.block = self.block, None
        if discard:
            try:
                self.files.delete(id_block_path(start, end))
            except Exception as exc:
                _log.warning("could not delete the checkpoint id reservation %s..%s: %s", start, end, exc)
            return
        if self.last >= end:
            return
        try:
            self._write(start, self.last)
            self.files.delete(id_block_path(start, end))
        except Exception as exc:
            _log.warning("could not shrink the checkpoint id reservation %s..%s: %s", start, end, exc)

    def _write(self, start: int, end: int) -> None:
        self.files.put(id_block_path(start, end), json.dumps({"start": start, "end": end}).encode())
