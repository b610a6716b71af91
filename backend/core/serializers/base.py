"""What a serializer is: the ``Serializer`` protocol, the id check, and equality by id.

Why explicit ids and versions: state outlives the code that wrote it. Every serializer has a
stable ``id`` that names its byte format and its version (``"int64/1"``,
``"tuple/1(int64/1,str/1)"``); state metadata records the ids, and a restore compares them with
the serializers the new code registers (``check_serializer_id``), so that a changed schema is
refused with a clear error instead of silently misreading bytes. A format change gets a new
version, never a new meaning for an old id.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from backend.core.errors import SerializerMismatchError

__all__ = ["Serializer", "SerializerBase", "check_serializer_id"]

T = TypeVar("T")


class Serializer(Protocol[T]):
    """Turns values of type ``T`` into bytes and back. ``id`` names the byte format and version."""

    @property
    def id(self) -> str: ...

    def serialize(self, value: T) -> bytes: ...

    def deserialize(self, data: bytes) -> T: ...


def check_serializer_id(serializer: Serializer[Any], recorded_id: str, what: str = "state") -> None:
    """Raise ``SerializerMismatchError`` unless ``serializer`` writes the format ``recorded_id``."""
    if serializer.id != recorded_id:
        raise SerializerMismatchError(recorded_id, serializer.id, what)


class SerializerBase:
    """Equality, hashing and repr by ``id``: two serializers with the same id read the same bytes.

    ``serialized_size`` (optional, a class attribute): every value ``serialize`` returns has
    exactly this many bytes; with ``serialize_column`` (the values' serializations back to back)
    a checkpoint logs a key group's values as one column. Trusted only where one class defines
    ``serialize`` and these together (a subclass overriding ``serialize`` alone is not)."""

    __slots__ = ()
    id: str
    serialized_size: int | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SerializerBase) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"
