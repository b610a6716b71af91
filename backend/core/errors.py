"""The errors of keyed state, its snapshots and checkpoints: all under ``dstl.errors.ChangelogError``.

One module for the whole backend so that every layer above (state, materializer, checkpointing,
tools, Spark) raises and catches the same classes. Where an error was a ``ValueError`` or a
``RuntimeError`` before it joined the hierarchy, it still is one, so existing handlers keep working.
"""

from __future__ import annotations

from dstl.errors import ChangelogError, ConfigurationError, CorruptDataError


class SerializationError(ChangelogError, ValueError):
    """A value could not be serialized, or bytes could not be deserialized.

    ``SerializationError(serializer_id, problem)`` names the serializer (every serializer here
    does); ``SerializationError(message)`` is for formats that are not serializers, such as
    change records, and has ``serializer_id`` None.
    """

    def __init__(self, serializer_id: str, problem: str | None = None) -> None:
        if problem is None:
            super().__init__(serializer_id)
            self.serializer_id: str | None = None
            self.problem = serializer_id
        else:
            super().__init__(f"serializer {serializer_id}: {problem}")
            self.serializer_id = serializer_id
            self.problem = problem


class SerializerMismatchError(SerializationError):
    """State was written with one serializer (``recorded_id``) and is being read with another."""

    def __init__(self, recorded_id: str, actual_id: str, what: str = "state") -> None:
        super().__init__(actual_id, f"{what} was written with serializer {recorded_id!r}, cannot read it with this one")
        self.recorded_id = recorded_id
        self.actual_id = actual_id


class NoCurrentKeyError(ChangelogError, RuntimeError):
    """Keyed state was used before ``set_current_key``."""

    def __init__(self) -> None:
        super().__init__("keyed state used without a current key: call set_current_key(key) first")


class NoneElementError(ChangelogError, ValueError):
    """``None`` was added to a list state: a list element cannot be addressed, so ``None`` cannot
    mean "remove" there as it does for value and map state (``update(None)`` empties the list)."""

    def __init__(self, state: str) -> None:
        super().__init__(
            f"list state {state!r} cannot hold None: None is never stored, and a list element cannot be "
            "removed by writing None (use clear() or update(None) to empty the list)"
        )
        self.state = state


class StateRestoreError(ChangelogError, ValueError):
    """A snapshot cannot be restored here: corrupt or foreign handle, or incompatible state."""


class SchemaEvolutionError(StateRestoreError):
    """A state's schema changed in a way its stored values cannot be read through
    (``backend.core.serializers.evolution``): names the state, the field, both types and why."""

    def __init__(self, state: str, field: str, old: str, new: str, why: str) -> None:
        where = f"state {state!r}" + (f" field {field!r}" if field else "")
        super().__init__(f"{where} was stored as {old} and is registered as {new}: {why}")
        self.state, self.field, self.old, self.new = state, field, old, new


class CheckpointError(ChangelogError):
    """A checkpoint cannot be completed, read or restored (the message names the file or path)."""


class BackendClosedError(ChangelogError, RuntimeError):
    """The backend was closed while something still read its local tables (a materialization
    uploading in the background): that reader stops instead of reading closed tables."""


class LocalStateError(ChangelogError):
    """A write of the local state tables failed: their directory is full (its file system, a
    quota, the process' file size limit, or the tables' map size) or its disk failed.

    The transaction was not applied and the operation that needed it (a spill of the write-back
    caches, a checkpoint, a state's deletion, a restore) fails; a backend's changes stay in memory,
    so reads, the changelog and later checkpoints agree. ``full``: the write failed for want of
    room (not for another disk error).
    """

    def __init__(self, operation: str, directory: str, cause: str, *, full: bool) -> None:
        what = "is full" if full else "could not be written"
        super().__init__(
            f"{operation} failed: the local state directory {directory} {what} ({cause}); nothing of the "
            "transaction was written: make room there, or give the backend another local directory, and retry"
        )
        self.operation = operation
        self.directory = directory
        self.cause = cause
        self.full = full


__all__ = [
    "BackendClosedError",
    "ChangelogError",
    "CheckpointError",
    "ConfigurationError",
    "CorruptDataError",
    "LocalStateError",
    "NoCurrentKeyError",
    "NoneElementError",
    "SchemaEvolutionError",
    "SerializationError",
    "SerializerMismatchError",
    "StateRestoreError",
]
