"""The errors of the checkpoint protocol, under ``backend.core.errors.CheckpointError``.

One home, so that a caller catching a checkpoint's outcome imports them from one place and the
protocol's modules (coordinator, ownership) depend on each other less.
"""

from __future__ import annotations

from backend.core.errors import CheckpointError

__all__ = ["CommitOutcomeUnknownError", "DirectoryOwnedError", "OwnershipLostError"]


class CommitOutcomeUnknownError(CheckpointError):
    """A checkpoint's ``_metadata`` was written but could not be settled as committed: counted as
    failed, yet a restart may resume from it, so the caller must not release its files (a runtime
    forgets the pending checkpoint without telling its subtasks it was aborted)."""


class DirectoryOwnedError(CheckpointError):
    """A claim on a job directory was refused: another run or query holds it (the message names it)."""


class OwnershipLostError(CheckpointError):
    """This run may commit, write and delete nothing more in the job directory: a newer run took it
    over, or a commit's check could not be made (``Ownership.relinquish``)."""
