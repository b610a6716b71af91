"""The key context: which key the keyed state of a subtask currently reads and writes.

``KeyContext`` turns a key into its ckey (``backend.core.tablekeys``) and key group, and checks
that the subtask owns it. ``ChangelogKeyedStateBackend`` *is* a key context (it inherits from it)
rather than holding one, because ``set_current_key`` and every state read and write are the hot
path: the state wrappers read ``current_ckey`` and ``current_kg`` straight off the backend, one
attribute lookup each, with no object in between.

``StateHost`` is what a state table and the timer service need from the backend that owns them
(the current key, the clock, the LMDB tables, the flush). They depend on this protocol, not on the
backend class, so the backend can import them without an import cycle.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, Protocol

import mmh3

from backend.core.errors import NoCurrentKeyError
from backend.core.keygroups import assign_key_group, check_max_parallelism
from backend.core.serializers import KeySerializer, Serializer
from backend.core.serializers.keys import INT_KEY_BYTES, INT_KEY_OFFSET, INT_KEY_TAG, pack_int_key, serialize_key
from backend.core.tablekeys import CKEY_HEAD, MAX_KEY_BYTES, key_group_of, key_of
from backend.state.lmdb_tables import LmdbTables
from dstl.errors import ConfigurationError
from dstl.types import KeyGroupRange

__all__ = ["KeyContext", "StateHost", "require_key"]

_murmur3 = mmh3.hash
_ckey_head = CKEY_HEAD.pack


def require_key(ck: bytes) -> bytes:
    """``ck`` if a key is set (a non-empty ckey), else raise ``NoCurrentKeyError``."""
    if not ck:
        raise NoCurrentKeyError()
    return ck


class StateHost(Protocol):
    """What a state table or the timer service needs from the backend that owns it."""

    #: the current key's ckey (b"" before any key is set) and key group (-1 before)
    current_ckey: bytes
    current_kg: int
    max_parallelism: int
    tables: LmdbTables
    #: the backend's clock, in milliseconds (TTL and processing time)
    now_ms: Callable[[], int]
    #: cache sizes past which the next write flushes to LMDB; -1 forces the next write to flush
    flush_threshold: int
    kg_flush_threshold: int
    #: whether changes are logged (a value table then keeps the bytes it logged for the spill)
    log_enabled: bool

    def flush(self) -> int: ...

    def set_current_ckey(self, ck: bytes) -> Any: ...


class KeyContext:
    """The current key of a subtask's keyed state: its ckey, key group and value."""

    def __init__(
        self, key_group_range: KeyGroupRange, max_parallelism: int, key_serializer: Serializer[Any] | None
    ) -> None:
        check_max_parallelism(max_parallelism)
        if key_group_range.end >= max_parallelism or len(key_group_range) == 0:
            raise ConfigurationError(
                f"key_group_range {key_group_range} does not fit max_parallelism {max_parallelism}"
            )
        self.key_group_range = key_group_range
        self.max_parallelism = max_parallelism
        self.key_serializer: Serializer[Any] = key_serializer or KeySerializer()
        self._serialize_key = self.key_serializer.serialize
        self._canonical_keys = self._serialize_key is serialize_key
        self._kg_start, self._kg_end = key_group_range.start, key_group_range.end
        # An int key's canonical bytes are always INT_KEY_BYTES long, so its ckey head depends on
        # the key group alone: one table, None where this subtask does not own the key group.
        self._int_key_heads: list[bytes | None] = [
            _ckey_head(kg, INT_KEY_BYTES) if kg in key_group_range else None for kg in range(max_parallelism)
        ]
        self.current_ckey = b""
        self.current_kg = -1
        self.current_key: Any = None
        #: int and str keys of the running batch -> (ckey, key group), computed once for the batch
        #: (``ChangelogKeyedStateBackend.batch``); empty outside a batch
        self._known: dict[Any, tuple[bytes, int]] = {}

    def key_group_of(self, key: Any) -> int:
        """The key group ``key`` belongs to (whether or not this subtask owns it)."""
        return assign_key_group(self.key_serializer.serialize(key), self.max_parallelism)

    def set_current_key(self, key: Any) -> None:
        """Make ``key`` the key that state reads and writes address; it must be in an owned key group."""
        # The hot path of every keyed access: assign_key_group and tablekeys.ckey are inlined, and
        # so is the int case of the canonical key serializer (the same try/pack as
        # ``serialize_key``), with the ckey head of an int key taken from the per-key-group table
        # (an index instead of a struct pack and a range check). In a batch, an int or str key
        # the batch named is one dict lookup (only those types: 1 == True == 1.0 in a dict).
        if self._known and (type(key) is int or type(key) is str):
            known = self._known.get(key)
            if known is not None:
                self.current_ckey, self.current_kg = known
                self.current_key = key
                return
        if type(key) is int and self._canonical_keys:
            try:
                data = pack_int_key(INT_KEY_TAG, key + INT_KEY_OFFSET)
            except struct.error:  # more than 64 bits
                pass
            else:
                kg = _murmur3(data, 0, False) % self.max_parallelism
                head = self._int_key_heads[kg]
                if head is None:
                    self._bad_key(key, kg, data)
                self.current_ckey = head + data
                self.current_kg = kg
                self.current_key = key
                return
        data = self._serialize_key(key)
        kg = _murmur3(data, 0, False) % self.max_parallelism
        if kg < self._kg_start or kg > self._kg_end or len(data) > MAX_KEY_BYTES:
            self._bad_key(key, kg, data)
        self.current_ckey = _ckey_head(kg, len(data)) + data
        self.current_kg = kg
        self.current_key = key

    def _bad_key(self, key: Any, kg: int, data: bytes) -> NoReturn:
        if len(data) > MAX_KEY_BYTES:
            raise ValueError(f"key {key!r} serializes to {len(data)} bytes, more than {MAX_KEY_BYTES}")
        rng = self.key_group_range
        raise ValueError(f"key {key!r} is in key group {kg}, which this subtask [{rng.start}, {rng.end}] does not own")

    def set_current_key_in_group(self, key: Any, key_group: int) -> None:
        """``set_current_key`` with a key group computed elsewhere (by Spark's SQL hash in the JVM,
        which also partitions the rows); the key group must stay the same for a key forever."""
        data = self._serialize_key(key)
        if key_group < self._kg_start or key_group > self._kg_end or len(data) > MAX_KEY_BYTES:
            self._bad_key(key, key_group, data)
        self.current_ckey = _ckey_head(key_group, len(data)) + data
        self.current_kg = key_group
        self.current_key = key

    def ckeys_of(self, keys: Iterable[Any], key_groups: Iterable[int] | None = None) -> list[bytes]:
        """The ckeys of ``keys`` (checked as ``set_current_key`` checks them; with ``key_groups``,
        as ``set_current_key_in_group``), in order; the current key stays what it was. Remembers
        those of int and str keys for ``set_current_key`` until ``forget_keys``."""
        saved = self.current_ckey, self.current_kg, self.current_key
        ckeys: list[bytes] = []
        known: dict[Any, tuple[bytes, int]] = {}
        # the class's methods, not the hooks a lazy restore sets on the instance (``backend.state.lazy``):
        # naming a key here loads nothing
        try:
            if key_groups is None:
                # set_current_key's int path inlined (one step per key, its bytes freed at once: a
                # list at a time in C-level maps measured slower, its lists of fresh objects
                # falling out of the CPU caches); any other key takes set_current_key itself
                canonical, heads, max_parallelism = self._canonical_keys, self._int_key_heads, self.max_parallelism
                for key in keys:
                    if type(key) is int and canonical:
                        try:
                            data = pack_int_key(INT_KEY_TAG, key + INT_KEY_OFFSET)
                        except struct.error:  # more than 64 bits
                            pass
                        else:
                            kg = _murmur3(data, 0, False) % max_parallelism
                            head = heads[kg]
                            if head is None:
                                self._bad_key(key, kg, data)
                            ck = head + data
                            ckeys.append(ck)
                            known[key] = (ck, kg)
                            continue
                    KeyContext.set_current_key(self, key)
                    ckeys.append(self.current_ckey)
                    if type(key) is int or type(key) is str:
                        known[key] = (self.current_ckey, self.current_kg)
            else:
                for key, key_group in zip(keys, key_groups, strict=True):
                    KeyContext.set_current_key_in_group(self, key, key_group)
                    ckeys.append(self.current_ckey)
        finally:
            self.current_ckey, self.current_kg, self.current_key = saved
        if key_groups is None:
            if self._known:
                self._known.update(known)
            else:  # the usual case (a batch's start): take the dict instead of copying it
                self._known = known
        return ckeys

    def forget_keys(self) -> None:
        """``set_current_key`` computes every key again (the batch ended)."""
        self._known = {}

    def set_current_ckey(self, ck: bytes) -> Any:
        """Make the key of ckey ``ck`` current (a timer firing, a restored entry); returns the key."""
        self.current_ckey = ck
        self.current_kg = key_group_of(ck)
        self.current_key = self.key_serializer.deserialize(key_of(ck))
        return self.current_key
