"""Chunk packs: a materialization's chunks in few files, and the materializations a task starts
together in one file (``materializer.packs``), each chunk read back by its range.

Every handle is checked by restoring it (at other parallelisms too) and comparing with a dict
model. The storage owns no files, as a Spark worker's: only such backends may share a pack.
Failures come from the upload callable a materializer is given (no code of ours is patched);
nothing waits by sleeping.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import key_group_ranges
from dstl import ConfigurationError, CorruptDataError, DfsFiles, StateChangelogStorage
from materializer.options import MaterializationOptions
from materializer.packs import SharedPack
from materializer.periodic import PeriodicMaterializer, restore
from tests.materializer.backends import (
    NEVER,
    WAIT_S,
    Env,
    FlakyUpload,
    assert_state_equals,
    checkpoint,
    environment,
    model_keys,
    owner,
)
from tests.support.materializer_crash_child import LIST, MAP, MAX_P, VALUE, Model, apply_to_model, batch_a, batch_b

B = Any


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    with environment(tmp_path, owns_files=False) as e:
        yield e


def subtasks_with(env: Env, parallelism: int, model: Model, ops: Sequence[Any]) -> list[B]:
    subtasks = [env.backends.new(rng) for rng in key_group_ranges(MAX_P, parallelism)]
    for key, value, element, (user_key, entry) in ops:
        b = owner(subtasks, key)
        if value is None:
            b.get_state(VALUE).clear()
        else:
            b.get_state(VALUE).update(value)
        b.get_state(LIST).add(element)
        b.get_state(MAP).put(user_key, entry)
    apply_to_model(model, ops)
    return subtasks


def materializers(subtasks: Sequence[B]) -> list[PeriodicMaterializer]:
    return [
        PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None)) for b in subtasks
    ]


def start_together(ms: Sequence[PeriodicMaterializer], pack: SharedPack) -> None:
    try:
        for m in ms:
            assert m.trigger(pack)
    finally:
        pack.seal()
    for m in ms:
        m.wait(WAIT_S)


def restores_to(env: Env, handles: Sequence[KeyedStateHandle], model: Model, parallelisms: Sequence[int]) -> None:
    handles = [KeyedStateHandle.loads(h.dumps()) for h in handles]
    for parallelism in parallelisms:
        restored = [env.backends.new(rng) for rng in key_group_ranges(MAX_P, parallelism)]
        for b in restored:
            restore(b, handles)
        assert_state_equals(restored, model, model_keys(model))
        for b in restored:
            env.backends.close(b)


def materialized_alone(env: Env, model: Model, ops: Sequence[Any], **options: Any) -> KeyedStateHandle:
    """One subtask holding ``ops``, materialized once (``options``: more of its materializer's),
    then checkpointed: the handle, read back from JSON."""
    (b,) = subtasks_with(env, 1, model, ops)
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, **options))
    assert m.trigger()
    m.wait(WAIT_S)
    m.close()
    return KeyedStateHandle.loads(checkpoint(b, 1).dumps())


def test_one_materialization_writes_its_chunks_into_files_of_at_most_pack_bytes(env: Env) -> None:
    model = Model()
    one_file = materialized_alone(env, model, batch_a() + batch_b())
    assert len({c["path"] for c in one_file.materialized}) == 1 < len(one_file.materialized)
    largest = max(c["size"] for c in one_file.materialized)

    handle = materialized_alone(env, Model(), batch_a() + batch_b(), pack_bytes=2 * largest)
    files: dict[str, int] = {}
    for chunk in handle.materialized:
        files[chunk["path"]] = max(files.get(chunk["path"], 0), chunk["offset"] + chunk["size"])
    assert 1 < len(files) < len(handle.materialized)
    assert all(size <= 2 * largest for size in files.values())
    assert {p: len(env.storage.files.get(p)) for p in files} == files  # nothing else in them
    restores_to(env, [handle], model, parallelisms=(1, 3))


def test_materializations_started_together_share_one_file_and_each_restores(env: Env) -> None:
    model = Model()
    subtasks = subtasks_with(env, 3, model, batch_a() + batch_b())
    ms = materializers(subtasks)
    start_together(ms, SharedPack(env.storage.files.put, 1 << 20))
    assert [m.metrics.completed for m in ms] == [1, 1, 1]
    handles = [checkpoint(b, 1) for b in subtasks]
    paths = {c["path"] for h in handles for c in h.materialized}
    assert len(paths) == 1 and env.storage.files.list("shared") == sorted(paths)
    spans = sorted((c["offset"], c["size"]) for h in handles for c in h.materialized)
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(spans))  # back to back, no overlap
    restores_to(env, handles, model, parallelisms=(1, 2, 4))
    for m in ms:
        m.close()


def test_a_member_that_fails_before_it_contributes_does_not_hold_up_the_others(env: Env) -> None:
    model = Model()
    subtasks = subtasks_with(env, 2, model, batch_a())
    failing = FlakyUpload(env.storage, failing={1})  # its first own file fails
    alone = PeriodicMaterializer(
        subtasks[0], MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, pack_bytes=1), upload=failing
    )
    other = PeriodicMaterializer(subtasks[1], MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
    start_together([alone, other], SharedPack(env.storage.files.put, 1 << 20))
    assert (alone.metrics.failed, other.metrics.completed) == (1, 1)
    handles = [checkpoint(b, 1) for b in subtasks]
    assert handles[0].materialized == () and handles[1].materialized
    restores_to(env, handles, model, parallelisms=(1, 2))
    for m in (alone, other):
        m.close()


def test_a_failed_shared_upload_fails_every_member_and_the_next_attempt_succeeds(env: Env) -> None:
    model = Model()
    subtasks = subtasks_with(env, 2, model, batch_a())
    ms = materializers(subtasks)
    upload = FlakyUpload(env.storage, failing={1})
    start_together(ms, SharedPack(upload, 1 << 20))
    assert upload.calls == 1  # one file for both
    assert [(m.metrics.failed, m.metrics.completed) for m in ms] == [(1, 0), (1, 0)]
    assert env.storage.files.list("shared") == []
    failed = [checkpoint(b, 1) for b in subtasks]
    assert all(h.materialized == () for h in failed)
    restores_to(env, failed, model, parallelisms=(1,))  # the log was kept for the failed attempt

    start_together(ms, SharedPack(upload, 1 << 20))  # the key groups are still dirty: both start again
    assert upload.calls == 2
    assert [m.metrics.completed for m in ms] == [1, 1]
    handles = [checkpoint(b, 2) for b in subtasks]
    restores_to(env, handles, model, parallelisms=(1, 3))
    for m in ms:
        m.close()


def test_a_shared_file_stays_within_its_bound_and_the_rest_goes_to_files_of_their_own(env: Env) -> None:
    model = Model()
    subtasks = subtasks_with(env, 3, model, batch_a() + batch_b())
    ms = materializers(subtasks)
    uploads: list[int] = []

    def upload(path: str, data: bytes) -> None:
        uploads.append(len(data))
        env.storage.files.put(path, data)

    start_together(ms, SharedPack(upload, 1))  # room for the first contribution only
    assert [m.metrics.completed for m in ms] == [1, 1, 1]
    handles = [checkpoint(b, 1) for b in subtasks]
    files = {c["path"] for h in handles for c in h.materialized}
    assert len(files) == 3 and len(uploads) == 1  # the shared file took the first; the others went alone
    restores_to(env, handles, model, parallelisms=(1, 2))
    for m in ms:
        m.close()


def test_a_sealed_pack_without_members_writes_nothing(env: Env) -> None:
    pack = SharedPack(env.storage.files.put, 1 << 20)
    pack.seal()
    with pytest.raises(RuntimeError, match="sealed"):
        pack.join()
    assert env.storage.files.list("shared") == []


def test_members_wait_for_the_seal_and_upload_once(env: Env) -> None:
    """Contributions that arrive before the starter seals the pack are uploaded together after it."""
    uploads: list[tuple[str, bytes]] = []
    pack = SharedPack(lambda path, data: uploads.append((path, data)), 1 << 20)
    pack.join()
    pack.join()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(pack.contribute, b"abc")
        second = pool.submit(pack.contribute, b"defg")
        done, _ = concurrent.futures.wait([first, second], timeout=0.2)
        assert not done and uploads == []  # not sealed yet: nobody uploads
        pack.seal()
        results = [first.result(WAIT_S), second.result(WAIT_S)]
    ((path, data),) = uploads
    assert len(data) == 7
    for (where, offset), part in zip(results, (b"abc", b"defg"), strict=True):
        assert where == path and data[offset : offset + len(part)] == part


def test_a_storage_that_deletes_its_files_cannot_share_a_pack(tmp_path: Path) -> None:
    with environment(tmp_path, owns_files=True) as owning:
        (b,) = subtasks_with(owning, 1, Model(), batch_a())
        m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
        with pytest.raises(ConfigurationError, match="owns_files"):
            m.trigger(SharedPack(owning.storage.files.put, 1 << 20))
        m.close()


class CountingReads:
    """The storage a restore reads through, counting its reads of chunk files (``shared/``)."""

    def __init__(self, storage: StateChangelogStorage) -> None:
        self.storage = storage
        self.reads: list[tuple[str, int, int]] = []
        self.files = _CountingFiles(storage.files, self.reads)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.storage, name)


class _CountingFiles:
    """A storage's files, recording each read in ``reads``."""

    def __init__(self, files: DfsFiles, reads: list[tuple[str, int, int]]) -> None:
        self._files, self.reads = files, reads

    def read_range(self, path: str, offset: int, length: int, timeout: float | None = None) -> bytes:
        self.reads.append((path, offset, length))
        return self._files.read_range(path, offset, length, timeout=timeout)

    def get(self, path: str, timeout: float | None = None) -> bytes:
        self.reads.append((path, 0, -1))
        return self._files.get(path, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._files, name)


def test_a_restore_reads_the_chunks_of_a_pack_it_owns_with_one_request(env: Env) -> None:
    model = Model()
    handle = materialized_alone(env, model, batch_a() + batch_b())
    (path,) = {c["path"] for c in handle.materialized}
    assert len(handle.materialized) > 2
    for parallelism in (1, 2):
        restored = [env.backends.new(rng) for rng in key_group_ranges(MAX_P, parallelism)]
        for r in restored:
            reads = CountingReads(env.storage)
            restore(r, [handle], source=reads)  # type: ignore[arg-type]
            assert [p for p, _, _ in reads.reads if p.startswith("shared/")] == [path]  # one span each
        assert_state_equals(restored, model, model_keys(model))


def test_a_truncated_pack_fails_the_restore_naming_the_file(env: Env) -> None:
    handle = materialized_alone(env, Model(), batch_a())
    (path,) = {c["path"] for c in handle.materialized}
    file = env.tmp / "dfs" / path
    file.write_bytes(file.read_bytes()[:-20])
    with pytest.raises(CorruptDataError) as info:
        restore(env.backends.new(), [handle])
    assert path in str(info.value)
