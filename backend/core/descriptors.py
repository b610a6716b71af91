"""State descriptors: what a user declares (name, kind, serializers, TTL) and what a handle records.

The descriptor's metadata (kind, serializer ids, TTL) is stored in every ``KeyedStateHandle``,
so a restore can refuse a state registered again with another kind or serializer instead of
silently misreading its bytes. ``declared`` is what the caller declared beyond the serializers
(the Spark adapter: the Spark types of the schemas, which the serializer ids do not keep, such as
int and long both stored as ``int64``), recorded with the metadata so that the caller can apply
its own rules to a change; the backend's own rules ignore it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from backend.core.serializers import Serializer
from dstl.errors import ConfigurationError

V = TypeVar("V")
K = TypeVar("K")
V_in = TypeVar("V_in", contravariant=True)
ACC = TypeVar("ACC")
OUT = TypeVar("OUT", covariant=True)


class AggregateFunction(Protocol[V_in, ACC, OUT]):
    def create_accumulator(self) -> ACC: ...
    def add(self, value: V_in, accumulator: ACC) -> ACC: ...
    def get_result(self, accumulator: ACC) -> OUT: ...


@dataclass(frozen=True)
class StateTtl:
    """Processing-time TTL, refreshed on every write (Flink's OnCreateAndWrite, NeverReturnExpired)."""

    ttl_ms: int

    def __post_init__(self) -> None:
        if self.ttl_ms <= 0:
            raise ConfigurationError(f"ttl_ms must be positive, got {self.ttl_ms}")


@dataclass(frozen=True)
class StateDescriptor(Generic[V]):
    name: str
    serializer: Serializer[V]
    ttl: StateTtl | None = None
    declared: tuple[str, ...] = ()
    kind: str = field(default="value", init=False)

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 255:
            raise ConfigurationError(f"state name must be 1..255 characters, got {self.name!r}")

    def metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "kind": self.kind,
            "serializer": self.serializer.id,
            "ttl_ms": self.ttl.ttl_ms if self.ttl else None,
        }
        if self.declared:
            meta["declared"] = list(self.declared)
        return meta


@dataclass(frozen=True)
class ValueStateDescriptor(StateDescriptor[V]):
    kind: str = field(default="value", init=False)


@dataclass(frozen=True)
class ListStateDescriptor(StateDescriptor[V]):
    kind: str = field(default="list", init=False)


@dataclass(frozen=True)
class MapStateDescriptor(StateDescriptor[V], Generic[K, V]):
    user_key_serializer: Serializer[K] | None = None
    kind: str = field(default="map", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.user_key_serializer is None:
            raise ConfigurationError(f"map state {self.name!r} needs a user_key_serializer")

    def metadata(self) -> dict[str, Any]:
        meta = super().metadata()
        assert self.user_key_serializer is not None
        meta["user_key_serializer"] = self.user_key_serializer.id
        return meta


@dataclass(frozen=True)
class ReducingStateDescriptor(StateDescriptor[V]):
    reduce: Callable[[V, V], V] | None = None
    kind: str = field(default="value", init=False)  # stored like a value state

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reduce is None:
            raise ConfigurationError(f"reducing state {self.name!r} needs a reduce function (reduce=)")


@dataclass(frozen=True)
class AggregatingStateDescriptor(StateDescriptor[Any]):
    """``serializer`` serializes the accumulator."""

    aggregate: AggregateFunction[Any, Any, Any] | None = None
    kind: str = field(default="value", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.aggregate is None:
            raise ConfigurationError(f"aggregating state {self.name!r} needs an aggregate function (aggregate=)")
