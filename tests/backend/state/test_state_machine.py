"""A stateful model test of ``ChangelogKeyedStateBackend``: several subtasks against a dict model.

Keys from a small pool (ints and strs) are routed to the subtask owning their key group. Rules
change value, list, map and reducing state, TTL states under a controlled clock, and event- and
processing-time timers (the model fires them in time order); flush a subtask; take checkpoints
that complete (the model is copied per checkpoint) or abort, possibly with writes while the
snapshot is in flight; and restore a random completed checkpoint at a new parallelism, each new
subtask from ALL handles of that checkpoint. After every restore the union of the subtasks must
equal the model at that checkpoint, and the machine continues on the restored subtasks. Every
rule also runs inside batches (``ChangelogKeyedStateBackend.batch``: state read ahead for keys
named up front, keys outside them too, spills and checkpoints inside them): both modes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import itertools
import operator
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from backend.core.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtl,
    ValueStateDescriptor,
)
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import assign_key_group, key_group_ranges, subtask_for_key_group
from backend.core.serializers import Int64Serializer, StrSerializer, serialize_key
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from backend.state.timers import EVENT_TIME, PROCESSING_TIME
from dstl import ChangelogConfig, StateChangelogStorage
from tests.support.state_models import apply_list_op

WAIT_S = 30.0
MAX_P = 128
OP = "op"
TTL_MS = 10
START_PARALLELISM = 2

KEY_POOL = [0, 1, 7, -3, 2**40, "a", "b", "", "zz", "key-9"]
KEYS = st.sampled_from(KEY_POOL)
USER_KEYS = st.sampled_from(["x", "y", "z", ""])
VALUES = st.integers(-1_000, 1_000)
STAMPS = st.integers(0, 60)
DOMAINS = st.sampled_from([EVENT_TIME, PROCESSING_TIME])

VALUE = ValueStateDescriptor("value", Int64Serializer())
LIST = ListStateDescriptor("list", Int64Serializer())
MAP = MapStateDescriptor("map", Int64Serializer(), user_key_serializer=StrSerializer())
SUM = ReducingStateDescriptor("sum", Int64Serializer(), reduce=operator.add)
TTL_VALUE = ValueStateDescriptor("ttl-value", Int64Serializer(), ttl=StateTtl(TTL_MS))
TTL_LIST = ListStateDescriptor("ttl-list", Int64Serializer(), ttl=StateTtl(TTL_MS))
TTL_MAP = MapStateDescriptor("ttl-map", Int64Serializer(), ttl=StateTtl(TTL_MS), user_key_serializer=StrSerializer())
TIMERS_TABLE = "__timers__"


@dataclass
class Model:
    value: dict[Any, int] = field(default_factory=dict)
    lists: dict[Any, list[int]] = field(default_factory=dict)
    maps: dict[Any, dict[str, int]] = field(default_factory=dict)
    sums: dict[Any, int] = field(default_factory=dict)
    ttl_value: dict[Any, tuple[int, int]] = field(default_factory=dict)  # key -> (value, expiry)
    ttl_lists: dict[Any, list[tuple[int, int]]] = field(default_factory=dict)
    ttl_maps: dict[Any, dict[str, tuple[int, int]]] = field(default_factory=dict)
    timers: dict[Any, set[tuple[int, int]]] = field(default_factory=dict)  # key -> {(domain, ts)}


class Subtask:
    def __init__(self, backend: ChangelogKeyedStateBackend) -> None:
        self.b = backend
        self.value = backend.get_state(VALUE)
        self.list = backend.get_state(LIST)
        self.map = backend.get_state(MAP)
        self.sum = backend.get_state(SUM)
        self.ttl_value = backend.get_state(TTL_VALUE)
        self.ttl_list = backend.get_state(TTL_LIST)
        self.ttl_map = backend.get_state(TTL_MAP)
        self.fired: list[tuple[Any, int]] = []

    def on_timer(self, key: Any, timestamp: int) -> None:
        assert self.b.current_key == key, "on_timer must run with the timer's key as the current key"
        self.sum.add(1)  # state access inside on_timer counts the firings per key
        self.fired.append((key, timestamp))


class BackendMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="state-machine-"))
        self.storage = StateChangelogStorage(ChangelogConfig.local(self.tmp / "dfs", persist_delay_ms=0))
        self.clock = [1_000]
        self.watermark = 0
        self.cache_limit = 1_000
        self.dirs = itertools.count()
        self.subtasks: list[Subtask] = []
        self.model = Model()
        self.checkpoint_ids = itertools.count(1)
        self.completed: list[tuple[list[KeyedStateHandle], Model]] = []
        self.pending: tuple[int, list[concurrent.futures.Future[KeyedStateHandle]], Model] | None = None
        self.stamps = itertools.count(10_000)
        self.open_batches: list[contextlib.AbstractContextManager[None]] = []

    # -- plumbing -------------------------------------------------------------------------

    def _backends(self, parallelism: int) -> list[ChangelogKeyedStateBackend]:
        return [
            ChangelogKeyedStateBackend(
                OP,
                rng,
                self.tmp / f"local-{next(self.dirs)}",
                storage=self.storage,
                max_parallelism=MAX_P,
                clock=lambda: self.clock[0],
                cache_limit=self.cache_limit,
            )
            for rng in key_group_ranges(MAX_P, parallelism)
        ]

    def at(self, key: Any) -> Subtask:
        kg = assign_key_group(serialize_key(key), MAX_P)
        sub = self.subtasks[subtask_for_key_group(MAX_P, len(self.subtasks), kg)]
        sub.b.set_current_key(key)
        return sub

    def teardown(self) -> None:
        try:
            self._end_batches()
            for sub in self.subtasks:
                sub.b.close()
            self.storage.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def now(self) -> int:
        return self.clock[0]

    @initialize(cache_limit=st.sampled_from([2, 5, 1_000]))
    def start(self, cache_limit: int) -> None:
        self.cache_limit = cache_limit
        self.subtasks = [Subtask(b) for b in self._backends(START_PARALLELISM)]

    # -- batches: the rules below run inside them too ----------------------------------------

    @precondition(lambda self: not self.open_batches)
    @rule(keys=st.lists(KEYS, unique=True))
    def begin_batch(self, keys: list[Any]) -> None:
        """A micro-batch naming its keys: each subtask reads its keys' state ahead."""
        for sub in self.subtasks:
            owned = [k for k in keys if sub.b.key_group_of(k) in sub.b.key_group_range]
            batch = sub.b.batch(owned)
            batch.__enter__()
            self.open_batches.append(batch)

    @precondition(lambda self: self.open_batches)
    @rule()
    def end_batch(self) -> None:
        self._end_batches()

    def _end_batches(self) -> None:
        batches, self.open_batches = self.open_batches, []
        for batch in batches:
            batch.__exit__(None, None, None)

    # -- value, list, map, reducing and TTL state: one rule per state, the operation drawn -----

    @rule(key=KEYS, op=st.sampled_from(["update", "clear", "update(None)"]), value=VALUES)
    def value_op(self, key: Any, op: str, value: int) -> None:
        state, model = self.at(key).value, self.model.value
        if op == "update":
            state.update(value)
            model[key] = value
        elif op == "clear":
            state.clear()
            model.pop(key, None)
        else:
            state.update(None)
            model.pop(key, None)

    @rule(keys=st.lists(KEYS, min_size=1, unique=True), user_key=USER_KEYS)
    def burst(self, keys: list[Any], user_key: str) -> None:
        """A burst of events: many keys change at once, each to a value never written before."""
        for key in keys:
            sub, stamp = self.at(key), next(self.stamps)
            sub.value.update(stamp)
            self.model.value[key] = stamp
            sub.list.add(stamp)
            self.model.lists.setdefault(key, []).append(stamp)
            sub.map.put(user_key, stamp)
            self.model.maps.setdefault(key, {})[user_key] = stamp

    @rule(key=KEYS, op=st.sampled_from(["add", "add_all", "update", "clear"]), values=st.lists(VALUES, max_size=3))
    def list_op(self, key: Any, op: str, values: list[int]) -> None:
        state, model = self.at(key).list, self.model.lists
        apply_list_op(state, model, key, op, values)

    @rule(
        key=KEYS,
        op=st.sampled_from(["put", "put_all", "remove", "clear"]),
        user_key=USER_KEYS,
        entries=st.dictionaries(USER_KEYS, VALUES, max_size=3),
    )
    def map_op(self, key: Any, op: str, user_key: str, entries: dict[str, int]) -> None:
        state, model = self.at(key).map, self.model.maps
        if op == "put":
            value = sum(entries.values())
            state.put(user_key, value)
            model.setdefault(key, {})[user_key] = value
        elif op == "put_all":
            state.put_all(entries)
            model.setdefault(key, {}).update(entries)
        elif op == "remove":
            state.remove(user_key)
            model.get(key, {}).pop(user_key, None)
        else:
            state.clear()
            model.pop(key, None)
        if not model.get(key, True):
            del model[key]

    @rule(key=KEYS, clear=st.booleans(), value=VALUES)
    def sum_op(self, key: Any, clear: bool, value: int) -> None:
        state = self.at(key).sum
        if clear:
            state.clear()
            self.model.sums.pop(key, None)
        else:
            state.add(value)
            self.model.sums[key] = self.model.sums.get(key, 0) + value

    @rule(
        key=KEYS,
        op=st.sampled_from(["value", "list-add", "list-update", "map-put", "map-remove"]),
        user_key=USER_KEYS,
        values=st.lists(VALUES, min_size=1, max_size=2),
    )
    def ttl_op(self, key: Any, op: str, user_key: str, values: list[int]) -> None:
        sub, m, expiry = self.at(key), self.model, self.now + TTL_MS
        if op == "value":
            sub.ttl_value.update(values[0])
            m.ttl_value[key] = (values[0], expiry)
        elif op == "list-add":
            sub.ttl_list.add(values[0])
            m.ttl_lists.setdefault(key, []).append((values[0], expiry))
        elif op == "list-update":
            sub.ttl_list.update(values)
            m.ttl_lists[key] = [(v, expiry) for v in values]
        elif op == "map-put":
            sub.ttl_map.put(user_key, values[0])
            m.ttl_maps.setdefault(key, {})[user_key] = (values[0], expiry)
        else:
            sub.ttl_map.remove(user_key)
            m.ttl_maps.get(key, {}).pop(user_key, None)

    # -- time and timers ----------------------------------------------------------------------

    @rule(key=KEYS, register=st.booleans(), domain=DOMAINS, timestamp=STAMPS, data=st.data())
    def timer_op(self, key: Any, register: bool, domain: int, timestamp: int, data: st.DataObject) -> None:
        sub = self.at(key)
        if domain == PROCESSING_TIME:
            timestamp += self.now - 10  # processing time is the clock; some timers are due at once
        if register:
            if domain == EVENT_TIME:
                sub.b.register_event_time_timer(timestamp)
            else:
                sub.b.register_processing_time_timer(timestamp)
            self.model.timers.setdefault(key, set()).add((domain, timestamp))
            return
        timers = sorted(self.model.timers.get(key, set()))
        if timers and data.draw(st.booleans(), label="delete an existing timer"):
            domain, timestamp = data.draw(st.sampled_from(timers), label="timer")
        if domain == EVENT_TIME:
            sub.b.delete_event_time_timer(timestamp)
        else:
            sub.b.delete_processing_time_timer(timestamp)
        self._drop_timer(key, domain, timestamp)

    def _drop_timer(self, key: Any, domain: int, timestamp: int) -> None:
        timers = self.model.timers.get(key, set())
        timers.discard((domain, timestamp))
        if not timers:
            self.model.timers.pop(key, None)

    def _fire(self, domain: int, time: int) -> None:
        for sub in self.subtasks:
            sub.fired = []
            if domain == EVENT_TIME:
                count = sub.b.advance_watermark(time, sub.on_timer)
            else:
                count = sub.b.advance_processing_time(time, sub.on_timer)
            assert count == len(sub.fired)
            stamps = [ts for _, ts in sub.fired]
            assert stamps == sorted(stamps), f"timers fired out of time order: {sub.fired}"
        fired = sorted((repr(k), ts) for sub in self.subtasks for k, ts in sub.fired)
        due = sorted(
            (repr(k), ts) for k, timers in self.model.timers.items() for d, ts in timers if d == domain and ts <= time
        )
        assert fired == due
        for sub in self.subtasks:
            for key, ts in sub.fired:
                self._drop_timer(key, domain, ts)
                self.model.sums[key] = self.model.sums.get(key, 0) + 1

    @rule(domain=DOMAINS, delta=st.integers(0, 15))
    def advance(self, domain: int, delta: int) -> None:
        if domain == EVENT_TIME:
            self.watermark += delta
            self._fire(EVENT_TIME, self.watermark)
        else:
            self.clock[0] += delta  # TTL and processing time share the clock
            self._fire(PROCESSING_TIME, self.now)

    # -- reads --------------------------------------------------------------------------------

    def check_key(self, key: Any) -> None:
        sub, m, now = self.at(key), self.model, self.now
        assert sub.value.value() == m.value.get(key)
        assert sub.list.get() == m.lists.get(key, [])
        entries = m.maps.get(key, {})
        assert dict(sub.map.items()) == entries
        assert sub.map.is_empty() == (not entries)
        for user_key in ["x", "y", "z", ""]:
            assert sub.map.get(user_key) == entries.get(user_key)
        assert sub.sum.get() == m.sums.get(key)
        ttl_value = m.ttl_value.get(key)
        assert sub.ttl_value.value() == (ttl_value[0] if ttl_value and ttl_value[1] > now else None)
        assert sub.ttl_list.get() == [v for v, expiry in m.ttl_lists.get(key, []) if expiry > now]
        live = {uk: v for uk, (v, expiry) in m.ttl_maps.get(key, {}).items() if expiry > now}
        assert dict(sub.ttl_map.items()) == live
        timers = m.timers.get(key, set())
        assert sub.b.timers.timestamps(EVENT_TIME) == sorted(ts for d, ts in timers if d == EVENT_TIME)
        assert sub.b.timers.timestamps(PROCESSING_TIME) == sorted(ts for d, ts in timers if d == PROCESSING_TIME)
        assert sub.b.list_timers() == sorted(timers)

    @rule(key=KEYS)
    def read_key(self, key: Any) -> None:
        self.check_key(key)

    @rule()
    def check_all(self) -> None:
        for key in KEY_POOL:
            self.check_key(key)

    def check_stored(self) -> None:
        """Summed over subtasks, the local tables hold exactly the model: nothing duplicated or foreign."""
        m = self.model
        expected = {
            VALUE.name: len(m.value),
            LIST.name: len(m.lists),
            MAP.name: sum(map(len, m.maps.values())),
            SUM.name: len(m.sums),
            TIMERS_TABLE: sum(map(len, m.timers.values())),
        }
        actual = dict.fromkeys(expected, 0)
        for sub in self.subtasks:
            sub.b.flush()
            for name in expected:
                actual[name] += len(list(sub.b.tables.scan_prefix(sub.b.tables.database(name), b"")))
        assert actual == expected

    # -- flush, checkpoints, restore ----------------------------------------------------------

    @rule(index=st.integers(0, 7))
    def flush(self, index: int) -> None:
        self.subtasks[index % len(self.subtasks)].b.flush()

    def _snapshot(self) -> tuple[int, list[concurrent.futures.Future[KeyedStateHandle]], Model]:
        cid = next(self.checkpoint_ids)
        return cid, [sub.b.snapshot(cid) for sub in self.subtasks], copy.deepcopy(self.model)

    def _finish(
        self, cid: int, futures: list[concurrent.futures.Future[KeyedStateHandle]], model: Model, complete: bool
    ) -> None:
        handles = [f.result(timeout=WAIT_S) for f in futures]
        for sub in self.subtasks:
            if complete:
                sub.b.notify_checkpoint_complete(cid)
            else:
                sub.b.notify_checkpoint_aborted(cid)
        if complete:  # a restart reads the handles back from JSON
            self.completed.append(([KeyedStateHandle.loads(h.dumps()) for h in handles], model))

    @precondition(lambda self: self.pending is None)
    @rule(complete=st.booleans())
    def checkpoint(self, complete: bool) -> None:
        self._finish(*self._snapshot(), complete=complete)

    @precondition(lambda self: self.pending is None)
    @rule()
    def begin_checkpoint(self) -> None:
        """Snapshot now; the checkpoint completes or aborts later, after more changes."""
        self.pending = self._snapshot()

    @precondition(lambda self: self.pending is not None)
    @rule(complete=st.booleans())
    def end_checkpoint(self, complete: bool) -> None:
        assert self.pending is not None
        pending, self.pending = self.pending, None
        self._finish(*pending, complete=complete)

    @precondition(lambda self: self.completed)
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.completed) - 1), label="checkpoint")
        self._restore(index, data)

    @precondition(lambda self: self.completed)
    @rule(data=st.data())
    def restore_latest(self, data: st.DataObject) -> None:
        self._restore(len(self.completed) - 1, data)

    @precondition(lambda self: self.pending is None)
    @rule(restarts=st.integers(1, 3), data=st.data())
    def rescale(self, restarts: int, data: st.DataObject) -> None:
        """An autoscaler at work: a few times, a burst of events, a checkpoint, a restart from it."""
        for _ in range(restarts):
            self.burst(data.draw(st.lists(KEYS, unique=True), label="burst"), data.draw(USER_KEYS, label="user key"))
            self.checkpoint(complete=True)
            self._restore(len(self.completed) - 1, data)

    def _restore(self, index: int, data: st.DataObject) -> None:
        parallelism = data.draw(st.integers(1, 8), label="parallelism")
        if self.pending is not None:  # the job fails before the checkpoint completes
            pending, self.pending = self.pending, None
            self._finish(*pending, complete=False)
        handles, model = self.completed[index]
        self._end_batches()
        old, self.subtasks = self.subtasks, []
        for sub in old:
            sub.b.close()
        backends = self._backends(parallelism)
        try:
            for b in backends:
                b.restore(handles)
        finally:
            self.subtasks = [Subtask(b) for b in backends]
        self.model = copy.deepcopy(model)
        self.check_all()
        self.check_stored()


MACHINE_SETTINGS = settings(stateful_step_count=40, deadline=None)


TestStateMachine = BackendMachine.TestCase
TestStateMachine.settings = MACHINE_SETTINGS
