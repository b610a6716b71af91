"""The failure paths of a lazy restore, with real parts: a faulty file system in front of the local
DFS (``benchmarks.support.faulty_fs``) refuses reads of the chunks after the storage's retries, and
a chunk damaged on disk. An access, a batch or a hydration step that cannot read what it needs
fails naming the chunk and the key group, leaves nothing partial visible (the previous key stays
current, nothing of the key is in the tables) and works once the storage is back."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import assign_key_group
from backend.core.serializers import serialize_key
from backend.core.tablekeys import ckey
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig, StateChangelogStorage
from dstl.errors import CorruptDataError, StorageError
from materializer.chunks import read_chunk_index
from materializer.errors import CorruptChunkError
from materializer.periodic import restore
from tests.materializer.backends import Backends, Env, assert_state_equals, model_keys
from tests.materializer.test_lazy_restore import checkpoint_1, lazily_restored, stored_keys
from tests.support.materializer_crash_child import LIST, MAP, MAX_P, VALUE, Model

B = ChangelogKeyedStateBackend
#: a key that batch B changed after the materialization: its log records are pending
KEY = 5


class Faulty:
    def __init__(self, tmp: Path) -> None:
        self.plan = FaultPlan()
        base = faulty_base_path(tmp / "dfs", self.plan)
        self.storage = StateChangelogStorage(ChangelogConfig(base_path=base, persist_delay_ms=0, retry_delay_ms=1))
        self.env = Env(tmp, self.storage, Backends(tmp, self.storage))

    def refuse_chunk_reads(self) -> Fault:
        return self.plan.add(Fault(op="get", path="shared/*"))


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[Faulty]:
    f = Faulty(tmp_path)
    try:
        yield f
    finally:
        f.env.backends.close_all()
        f.storage.close()
        f.plan.close()


def key_group(key: Any) -> int:
    return assign_key_group(serialize_key(key), MAX_P)


def read(b: B, key: Any) -> tuple[Any, ...]:
    b.set_current_key(key)
    return b.get_state(VALUE).value(), b.get_state(LIST).get(), dict(b.get_state(MAP).items())


def expected(model: Model, key: Any) -> tuple[Any, ...]:
    return model.value.get(key), model.lists.get(key, []), model.maps.get(key, {})


def test_an_access_whose_blocks_cannot_be_read_fails_naming_the_chunk_and_key_group(faulty: Faulty) -> None:
    handle, model = checkpoint_1(faulty.env)
    (b,) = lazily_restored(faulty.env, [handle], 1)
    assert read(b, 1) == expected(model, 1)
    loaded = stored_keys(b, VALUE.name)
    faulty.refuse_chunk_reads()
    with pytest.raises(StorageError) as failure:
        b.set_current_key(KEY)
    message = str(failure.value)
    chunk = next(c for c in handle.materialized if c["key_groups"][0] == key_group(KEY))
    assert chunk["path"] in message and f"key group {key_group(KEY)}" in message
    assert b.current_key == 1  # the previous key stays current: nothing of KEY is visible
    assert stored_keys(b, VALUE.name) == loaded
    assert b.get_state(VALUE).value() == model.value[1]
    faulty.plan.clear()  # the storage is back: the same access works, with KEY's logged changes
    assert read(b, KEY) == expected(model, KEY)
    assert model.lists[KEY] == [KEY, -KEY]  # a change of the log, applied once


def test_a_batch_whose_blocks_cannot_be_read_fails_before_its_work_and_works_again(faulty: Faulty) -> None:
    handle, model = checkpoint_1(faulty.env)
    (b,) = lazily_restored(faulty.env, [handle], 1)
    keys = list(range(0, 60, 5))
    faulty.refuse_chunk_reads()
    ran = False
    with pytest.raises(StorageError, match="key group"), b.batch(keys):
        ran = True
    assert not ran and stored_keys(b, VALUE.name) == 0
    assert gc.isenabled()  # the load paused the garbage collector: back on after it failed
    faulty.plan.clear()
    with b.batch(keys):
        assert [read(b, k) for k in keys] == [expected(model, k) for k in keys]


def test_a_hydration_step_that_cannot_read_fails_and_the_next_one_resumes(faulty: Faulty) -> None:
    handle, model = checkpoint_1(faulty.env)
    (b,) = lazily_restored(faulty.env, [handle], 1)
    assert read(b, KEY) == expected(model, KEY)
    fault = faulty.refuse_chunk_reads()  # the reads ahead fail too
    with pytest.raises(StorageError, match=r"key groups \[\d+, \d+\]"):
        b.hydrate_step(3)
    assert faulty.plan.hits(fault) > 0 and not b.fully_local
    with pytest.raises(StorageError):
        b.hydrate_step(3)
    faulty.plan.clear()
    b.hydrate()
    assert b.fully_local
    assert_state_equals([b], model, model_keys(model))


def test_a_restore_that_cannot_read_the_chunk_indexes_fails(faulty: Faulty) -> None:
    handle, _ = checkpoint_1(faulty.env)
    faulty.refuse_chunk_reads()
    b = faulty.env.backends.new()
    with pytest.raises(StorageError, match="the index of key groups"):
        restore(b, [handle], mode="lazy")


def damage_block_of(env: Env, handle: KeyedStateHandle, key: Any) -> str:
    """Flip a byte inside the block of the value state holding ``key``; returns the chunk's path."""
    chunk = next(c for c in handle.materialized if c["key_groups"][0] == key_group(key))
    path = env.tmp / "dfs" / chunk["path"]
    data = bytearray(path.read_bytes())
    base = int(chunk.get("offset", 0))
    index = read_chunk_index(chunk["path"], chunk["size"], lambda o, n: bytes(data[base + o : base + o + n]))
    section = index.table(VALUE.name)
    assert section is not None
    (block,) = section.blocks_for(ckey(key_group(key), serialize_key(key)))
    data[base + block.offset + block.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return str(chunk["path"])


def test_a_damaged_block_is_refused_naming_the_chunk_and_the_key_group(env: Env) -> None:
    handle, model = checkpoint_1(env)
    (b,) = lazily_restored(env, [handle], 1)
    path = damage_block_of(env, handle, KEY)
    with pytest.raises(CorruptChunkError) as failure:
        b.set_current_key(KEY)
    assert isinstance(failure.value, CorruptDataError)
    assert path in str(failure.value) and f"key group {key_group(KEY)}" in str(failure.value)
    assert "checksum" in str(failure.value)
    other = next(k for k in model.value if key_group(k) != key_group(KEY))
    assert read(b, other) == expected(model, other)  # the other chunks still serve
    with pytest.raises(CorruptChunkError):  # the hydration checks the whole chunk too
        b.hydrate()


def test_a_missing_chunk_fails_the_access_as_a_restore_error(env: Env) -> None:
    handle, _ = checkpoint_1(env)
    (b,) = lazily_restored(env, [handle], 1)
    for chunk in handle.materialized:
        (env.tmp / "dfs" / chunk["path"]).unlink(missing_ok=True)
    with pytest.raises(StateRestoreError, match="is missing"):
        b.set_current_key(KEY)
