"""``ChangelogConfig`` to JSON and back, and its fingerprint: how a configuration reaches the service.

Why it is shaped so: the service is a separate process, started by whichever worker needs it
first, so its configuration must travel as data. JSON of the nested dataclasses
(``HedgingPolicy``, ``S3Options``) is checked field by field against the dataclasses' own
annotations on the way back (unknown or missing fields, wrong types: ``ConfigurationError``
naming the field), then validated by the dataclasses themselves. The JSON includes the S3
secrets, so it only ever travels on the service's stdin, never in a file or a command line.

The fingerprint is the SHA-256 of the canonical JSON (sorted keys, no spaces, floats where the
dataclass says float: ``persist_delay_ms=10`` and ``10.0`` are one configuration). Workers with
one configuration share one service (the socket is named by the fingerprint), workers with
another never do, and ``HELLO`` refuses a service that serves a different one. Credentials are
part of it: a worker with a rotated credential reaches a new service, started with the new
credential, and the service of the old one exits once idle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from dstl.config import ChangelogConfig, HedgingPolicy, S3Options
from dstl.errors import ConfigurationError

__all__ = ["config_from_json", "config_to_json", "dumps_config", "fingerprint", "loads_config"]

#: the nested dataclasses a field may hold, by the name its annotation uses
_NESTED: dict[str, type[Any]] = {"HedgingPolicy": HedgingPolicy, "S3Options": S3Options}
#: JSON types accepted for each scalar annotation (``bool`` is not an ``int`` here)
_SCALARS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "None": (type(None),),
}


def _annotation(field: dataclasses.Field[Any]) -> list[str]:
    return [part.strip() for part in str(field.type).split("|")]


def _to_json(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            value = _to_json(value)
        elif "float" in _annotation(field) and type(value) is int:
            value = float(value)
        out[field.name] = value
    return out


def config_to_json(config: ChangelogConfig) -> dict[str, Any]:
    """The configuration as a JSON-ready dict (nested dicts for ``hedging`` and ``s3``)."""
    return _to_json(config)


def _from_json(cls: type[Any], value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise ConfigurationError(f"config JSON: {where or 'the configuration'} must be an object, got {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigurationError(f"config JSON: unknown field(s) {', '.join(where + u for u in unknown)}")
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        if name not in value:
            raise ConfigurationError(f"config JSON: missing field {where}{name}")
        parts = _annotation(field)
        item = value[name]
        if len(parts) == 1 and parts[0] in _NESTED:
            kwargs[name] = _from_json(_NESTED[parts[0]], item, f"{where}{name}.")
            continue
        allowed = tuple(t for p in parts for t in _SCALARS[p])
        if not isinstance(item, allowed) or (type(item) is bool and bool not in allowed):
            raise ConfigurationError(f"config JSON: {where}{name} must be {' | '.join(parts)}, got {item!r}")
        kwargs[name] = float(item) if type(item) is int and "float" in parts and "int" not in parts else item
    return cls(**kwargs)


def config_from_json(value: Any) -> ChangelogConfig:
    """The configuration of a ``config_to_json`` dict; anything malformed raises ``ConfigurationError``."""
    config: ChangelogConfig = _from_json(ChangelogConfig, value, "")
    return config


def dumps_config(config: ChangelogConfig) -> str:
    """The canonical JSON text of ``config`` (what is fingerprinted and sent to the service)."""
    try:
        return json.dumps(config_to_json(config), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError as exc:  # inf or NaN: not JSON
        raise ConfigurationError(f"config JSON: {exc}") from None


def loads_config(text: str) -> ChangelogConfig:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigurationError(f"config JSON: not JSON: {exc}") from None
    return config_from_json(value)


def fingerprint(config: ChangelogConfig) -> str:
    """SHA-256 (hex) of the canonical JSON of ``config``."""
    return hashlib.sha256(dumps_config(config).encode()).hexdigest()
