"""``serializer_for_id``: the built-in serializer an id names, rebuilt from state metadata.

A restore reads serializer ids from storage, so parsing them is parsing untrusted text: unknown
names and versions are refused, and ``pickle/1`` only with an explicit ``allow_pickle``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from backend.core.errors import SerializationError
from backend.core.serializers.base import Serializer
from backend.core.serializers.composite import OptionalSerializer, RowSerializer, TupleSerializer
from backend.core.serializers.keys import KeySerializer
from backend.core.serializers.values import (
    BoolSerializer,
    BytesSerializer,
    Float64Serializer,
    Int64Serializer,
    JsonSerializer,
    PickleSerializer,
    StrSerializer,
)

__all__ = ["serializer_for_id"]

_SIMPLE: dict[str, Callable[[], Serializer[Any]]] = {
    s.id: s
    for s in (
        Int64Serializer,
        Float64Serializer,
        StrSerializer,
        BytesSerializer,
        BoolSerializer,
        JsonSerializer,
        KeySerializer,
    )
}
_NAME = re.compile(r"[a-z][a-z0-9_]*/[0-9]+")
_JSON_DECODER = json.JSONDecoder()


def serializer_for_id(serializer_id: str, *, allow_pickle: bool = False) -> Serializer[Any]:
    """The built-in serializer with this id, composites (tuple, row, optional) included.

    ``"pickle/1"`` is refused unless ``allow_pickle=True``: metadata read from storage must not be
    able to turn unpickling on. Unknown ids (or unknown versions) raise ``SerializationError``.
    """
    try:
        serializer, pos = _parse_id(serializer_id, 0, allow_pickle)
        if pos != len(serializer_id):
            raise ValueError(f"unexpected {serializer_id[pos:]!r}")
    except (ValueError, IndexError) as exc:
        if isinstance(exc, SerializationError):
            raise
        raise SerializationError(serializer_id, f"unknown or malformed serializer id: {exc}") from None
    return serializer


def _parse_id(text: str, pos: int, allow_pickle: bool) -> tuple[Serializer[Any], int]:
    match = _NAME.match(text, pos)
    if match is None:
        raise ValueError(f"expected a serializer name at {text[pos:]!r}")
    name, pos = match.group(), match.end()
    if name in _SIMPLE:
        return _SIMPLE[name](), pos
    if name == PickleSerializer.id:
        if not allow_pickle:
            raise SerializationError(text, "refusing to unpickle (pass allow_pickle=True only for trusted storage)")
        return PickleSerializer(), pos
    if name not in ("tuple/1", "row/1", "optional/1"):
        raise ValueError(f"unknown serializer {name!r}")
    if text[pos] != "(":
        raise ValueError(f"expected '(' after {name!r}")
    pos += 1
    args: list[tuple[str, Serializer[Any]]] = []
    while text[pos] != ")":
        if args:
            if text[pos] != ",":
                raise ValueError(f"expected ',' at {text[pos:]!r}")
            pos += 1
        field = ""
        if name == "row/1":
            field, pos = _JSON_DECODER.raw_decode(text, pos)
            if not isinstance(field, str) or text[pos] != ":":
                raise ValueError(f"expected a quoted field name and ':' in {text!r}")
            pos += 1
        inner, pos = _parse_id(text, pos, allow_pickle)
        args.append((field, inner))
    pos += 1
    if name == "tuple/1":
        return TupleSerializer([s for _, s in args]), pos
    if name == "row/1":
        return RowSerializer(args), pos
    if len(args) != 1:
        raise ValueError(f"optional/1 takes one serializer, got {len(args)}")
    return OptionalSerializer(args[0][1]), pos
