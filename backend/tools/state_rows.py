"""``dstl state read``: the entries of a restored subtask's tables as decoded rows, and their writers.

One row per entry, like Spark's state data source: ``operator, state, kind, key_group, key,
user_key, value, ttl_expiry_ms``. Keys are decoded with the canonical key encoding
(``backend.core.serializers.KeySerializer``), values with the serializer ids the snapshot recorded
(``serializer_for_id``, which refuses pickle). What must not or cannot be decoded (``pickle/1``,
a serializer this build does not know, malformed bytes) is dumped as ``{"$raw": hex}``; nothing
is ever unpickled. Timers are rows of the state ``_timers`` (user key: the time domain, value:
the timestamp). Expired TTL entries are shown as stored, with their expiry.

A state whose schema changed has a table per schema version (``backend.state.versions``) until a
full materialization folds them: its rows come from all of them, in table-key order, a key's from
the newest table holding it (as the state API reads it), and an older version's values are
converted to the current schema (``versions.decoders``), so every row shows the current schema.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from backend.core import records as rec
from backend.core.errors import SerializationError, StateRestoreError
from backend.core.serializers import KeySerializer, Serializer, serializer_for_id
from backend.core.tablekeys import key_group_of, key_of, parse_timer_user_key, split_table_key
from backend.state import versions
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from backend.state.timers import EVENT_TIME, TIMERS_DB
from backend.tools.errors import CliError

#: the name under which timers are reported
TIMERS_STATE = "_timers"

Warn = Callable[[str], None]
Emit = Callable[[dict[str, Any]], None]


def jsonable(value: Any) -> Any:
    """A decoded value as JSON: tuples become lists, bytes ``{"$bytes": hex}``, NaN and
    infinities ``{"$float": "nan"}``."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$bytes": bytes(value).hex()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return {"$repr": repr(value)}


def raw(data: bytes) -> dict[str, str]:
    """Bytes that are not decoded (pickle, unknown serializer, malformed): ``{"$raw": hex}``."""
    return {"$raw": bytes(data).hex()}


class _Decoder:
    """Decodes one serializer's bytes, or dumps them as hex when it must not or cannot.
    ``convert``: how to read them instead (an older schema version's bytes in today's schema)."""

    def __init__(self, serializer_id: Any, what: str, warn: Warn, convert: versions.Decode | None = None) -> None:
        self.serializer: Serializer[Any] | None = None
        self.convert = convert
        self._what = what
        self._warn = warn
        self._warned = False
        if not isinstance(serializer_id, str):
            warn(f"{what}: no serializer id recorded; values dumped as hex")
            return
        try:
            self.serializer = serializer_for_id(serializer_id)  # never allow_pickle
        except SerializationError:
            why = "pickle is never unpickled" if "pickle/" in serializer_id else "unknown to this build"
            warn(f"{what}: serializer {serializer_id} ({why}); values dumped as hex")

    def __call__(self, data: bytes) -> Any:
        if self.serializer is None:
            return raw(data)
        try:
            return jsonable((self.convert or self.serializer.deserialize)(bytes(data)))
        except SerializationError as exc:
            if not self._warned:
                self._warn(f"{self._what}: undecodable bytes dumped as hex ({exc})")
                self._warned = True
            return raw(data)


class StateReader:
    """Rows of one state of one operator: (key group, key, user key, value, TTL expiry)."""

    def __init__(self, uid: str, name: str, meta: dict[str, Any], warn: Warn) -> None:
        self.uid, self.name = uid, name
        self.kind = str(meta.get("kind"))
        self.ttl = bool(meta.get("ttl_ms"))
        self.value = _Decoder(meta.get("serializer"), f"state {name!r} of {uid!r}", warn)
        self.user_key = (
            _Decoder(meta.get("user_key_serializer"), f"user keys of state {name!r}", warn)
            if self.kind == "map"
            else None
        )
        self._warn = warn
        #: the tables of its schema versions, newest first, each with the decoder of its values
        self.tables = [(versions.table_name(name, versions.version_of(meta)), self.value), *self._older(meta)]

    def _older(self, meta: dict[str, Any]) -> list[tuple[str, _Decoder]]:
        """The live older versions' tables, their values read in today's schema (or dumped as hex
        when today's serializer is not known here or the change cannot be read)."""
        live = [m for m in versions.older_of(meta) if not m.get("dropped")]
        if not live:
            return []
        what = f"older schema versions of state {self.name!r} of {self.uid!r}"
        today = self.value.serializer
        try:
            if today is None:
                raise SerializationError(str(meta.get("serializer")), "not known to this build")
            found = versions.decoders(self.name, live, today)
        except (SerializationError, StateRestoreError) as exc:
            self._warn(f"{what}: not converted ({exc}); values dumped as hex")
            return [
                (versions.table_name(self.name, versions.version_of(m)), _Decoder(None, what, _quiet)) for m in live
            ]
        return [(table, _Decoder(meta.get("serializer"), what, self._warn, decode)) for table, decode in found]

    def _split_ttl(self, stored: bytes) -> tuple[int | None, bytes]:
        if not self.ttl:
            return None, stored
        expiry, data = rec.split_expiry(stored)
        return expiry, data

    def row(self, table_key: bytes, stored: bytes, value: _Decoder | None = None) -> dict[str, Any]:
        """The row of an entry of a table of the state (``value``: that table's decoder, the
        current version's by default)."""
        decode = value or self.value
        ck, user_key = split_table_key(table_key)
        row: dict[str, Any] = {
            "operator": self.uid, "state": self.name, "kind": self.kind, "key_group": key_group_of(ck),
            "key": decode_key(key_of(ck)), "user_key": None, "value": None, "ttl_expiry_ms": None,
        }  # fmt: skip
        try:
            if self.kind == "list":
                elements = []
                for element in rec.decode_list(stored):
                    expiry, data = self._split_ttl(element)
                    decoded = decode(data)
                    elements.append({"value": decoded, "ttl_expiry_ms": expiry} if self.ttl else decoded)
                row["value"] = elements
                return row
            row["ttl_expiry_ms"], data = self._split_ttl(stored)
            row["value"] = decode(data)
            if self.user_key is not None:
                row["user_key"] = self.user_key(user_key)
        except SerializationError as exc:  # framing of a list or a TTL prefix
            self._warn(f"state {self.name!r}: malformed stored value dumped as hex ({exc})")
            row["value"] = raw(stored)
        return row


def decode_key(data: bytes) -> Any:
    try:
        return jsonable(KeySerializer.deserialize_key(bytes(data)))
    except SerializationError:
        return raw(data)


def timer_row(uid: str, table_key: bytes) -> dict[str, Any]:
    ck, user_key = split_table_key(table_key)
    domain, timestamp = parse_timer_user_key(user_key)
    return {
        "operator": uid, "state": TIMERS_STATE, "kind": "timer", "key_group": key_group_of(ck),
        "key": decode_key(key_of(ck)), "user_key": "event_time" if domain == EVENT_TIME else "processing_time",
        "value": timestamp, "ttl_expiry_ms": None,
    }  # fmt: skip


def readers(
    uid: str, states: dict[str, dict[str, Any]], want: Sequence[str], warn: Warn
) -> dict[str, StateReader | None]:
    """The decoder of each wanted state (None: the timers), made once per operator so that a
    warning about a serializer is given once, not once per subtask."""
    return {name: None if name == TIMERS_STATE else StateReader(uid, name, states[name], warn) for name in want}


def state_rows(backend: ChangelogKeyedStateBackend, want: dict[str, StateReader | None]) -> Iterator[dict[str, Any]]:
    """Every row of the states in ``want`` (see ``readers``), state by state, in table order (key
    group, then key bytes)."""
    txn, databases = backend.consistent_view()
    try:
        for reader in want.values():
            if reader is None:
                db = databases.get(TIMERS_DB)
                for table_key, _ in txn.cursor(db=db) if db is not None else ():
                    yield timer_row(backend.operator_id, bytes(table_key))
                continue
            tables = [(databases[t], decode) for t, decode in reader.tables if t in databases]
            for table_key, stored, rank in versions.newest_entries(txn, [db for db, _ in tables]):
                yield reader.row(table_key, stored, tables[rank][1])
    finally:
        txn.abort()


def _quiet(_: str) -> None:
    """A warning already given once for the whole state."""


#: parquet columns; key, user_key and value hold the JSON text of the decoded value
PARQUET_COLUMNS = ("operator", "state", "kind", "key_group", "key", "user_key", "value", "ttl_expiry_ms")


# -- writers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def jsonl_writer(out: IO[Any]) -> Iterator[Emit]:
    """Rows as JSON lines."""

    def emit(row: dict[str, Any]) -> None:
        out.write(json.dumps(row, ensure_ascii=False) + "\n")

    yield emit
    out.flush()


@contextlib.contextmanager
def parquet_writer(out: IO[Any]) -> Iterator[Emit]:
    """Rows as a parquet file (pyarrow, imported only here); key, user_key and value as JSON text."""
    try:
        pa = importlib.import_module("pyarrow")
        pq = importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise CliError("--format parquet needs pyarrow: pip install pyarrow") from None
    json_text = pa.string()
    schema = pa.schema(
        [("operator", pa.string()), ("state", pa.string()), ("kind", pa.string()), ("key_group", pa.int32()),
         ("key", json_text), ("user_key", json_text), ("value", json_text), ("ttl_expiry_ms", pa.int64())]
    )  # fmt: skip
    batch: list[dict[str, Any]] = []
    writer = pq.ParquetWriter(out, schema)

    def flush() -> None:
        columns = {c: [r[c] for r in batch] for c in PARQUET_COLUMNS}
        for c in ("key", "user_key", "value"):
            columns[c] = [None if v is None else json.dumps(v, ensure_ascii=False) for v in columns[c]]
        writer.write_table(pa.table(columns, schema=schema))
        batch.clear()

    def emit(row: dict[str, Any]) -> None:
        batch.append(row)
        if len(batch) >= 10_000:
            flush()

    try:
        yield emit
        flush()
    finally:
        writer.close()
