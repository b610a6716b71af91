"""``PeriodicMaterializer``: failed and crashed uploads.

Every restore goes through ``materializer.periodic.restore`` into fresh backends of several
parallelisms, and the union of the subtasks is compared with a dict model: what a restarted job
sees. Uploads are failed by the ``upload`` callable the materializer accepts, or crashed by
killing a child process in the middle of its upload; nothing here waits by sleeping.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.checkpointing.cleanup import delete_unreferenced
from backend.core.handles import KeyedStateHandle
from materializer.options import MaterializationOptions
from materializer.periodic import MaterializationError, PeriodicMaterializer
from tests.materializer.backends import (
    NEVER,
    WAIT_S,
    Backends,
    Env,
    FlakyUpload,
    check_restores,
    checkpoint,
    first_keys_in_key_group,
    materialize,
    new_storage,
)
from tests.support.materializer_crash_child import (
    MAX_P,
    OPERATOR,
    Model,
    apply_to_backend,
    apply_to_model,
    batch_a,
    batch_b,
    checkpoint_1_model,
)

PROJECT_ROOT = Path(__file__).resolve().parents[2]


# -- 3. failed uploads ---------------------------------------------------------------------------


def test_failed_upload_deletes_partial_chunks_and_the_retry_succeeds(env: Env) -> None:
    b = env.backends.new()
    upload = FlakyUpload(env.storage, failing={3})
    m = PeriodicMaterializer(
        b,
        MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=8, pack_bytes=1),
        upload=upload,
    )  # one chunk per upload
    model = checkpoint_1_model()
    apply_to_backend(b, batch_a())
    apply_to_backend(b, batch_b())

    assert m.trigger()
    m.wait(WAIT_S)  # two chunks uploaded, the third fails
    assert upload.calls == 3
    assert (m.metrics.failed, m.metrics.completed) == (1, 0)
    assert env.storage.files.list("shared") == []  # the two partial chunks are gone
    failed = checkpoint(b, 1)
    assert failed.materialized == ()
    check_restores(env, failed, model)  # the log was not truncated for the failed attempt

    assert m.trigger()  # the key groups are still dirty: not skipped as unchanged
    m.wait(WAIT_S)
    assert (m.metrics.failed, m.metrics.completed) == (1, 1)
    assert m.metrics.chunks_uploaded == MAX_P // 8
    handle = checkpoint(b, 2)
    assert sorted(env.storage.files.list("shared")) == sorted(c["path"] for c in handle.materialized)
    check_restores(env, handle, model, parallelisms=(1, 2, 4))
    m.close()


def test_failed_incremental_upload_keeps_the_previous_chunks_and_the_changed_key_groups_dirty(env: Env) -> None:
    b = env.backends.new()
    upload = FlakyUpload(env.storage, failing=set())
    m = PeriodicMaterializer(
        b,
        MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=1, pack_bytes=1),
        upload=upload,
    )  # one chunk per upload
    model = Model()
    ops = [(k, k, k, ("x", k)) for k in range(400)]
    apply_to_backend(b, ops)
    apply_to_model(model, ops)
    materialize(m)
    previous = set(env.storage.files.list("shared"))
    uploaded = m.metrics.chunks_uploaded

    changed = sorted({b.key_group_of(k) for k in (0, 1, 2, 5)})
    assert len(changed) >= 3
    ops = [(k, 7, 7, ("z", 7)) for kg in changed for k in first_keys_in_key_group(kg, 2)]
    apply_to_backend(b, ops)
    apply_to_model(model, ops)
    upload.failing = {upload.calls + 2}  # the second changed chunk fails
    assert m.trigger()
    m.wait(WAIT_S)
    assert m.metrics.failed == 1
    assert set(env.storage.files.list("shared")) == previous  # the first changed chunk was deleted again

    assert m.trigger()
    m.wait(WAIT_S)
    assert m.metrics.completed == 2
    assert m.metrics.chunks_uploaded == uploaded + len(changed)  # every changed key group, none more
    handle = checkpoint(b, 1)
    check_restores(env, handle, model, parallelisms=(1, 4))
    m.close()


def test_too_many_consecutive_failures_raise_naming_operator_and_count(env: Env) -> None:
    b = env.backends.new()
    upload = FlakyUpload(env.storage, failing={1, 2, 4, 5, 6})
    m = PeriodicMaterializer(
        b,
        MaterializationOptions(
            interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=MAX_P, max_failures_allowed=2
        ),
        upload=upload,
    )
    model = Model()

    def write(round_: int) -> None:
        ops = [(k, round_, round_, ("x", round_)) for k in range(round_, round_ + 5)]
        apply_to_backend(b, ops)
        apply_to_model(model, ops)

    for round_ in range(3):  # fail, fail, succeed: the count of failures in a row resets
        write(round_)
        materialize(m)
    assert (m.metrics.failed, m.metrics.completed) == (2, 1)
    for round_ in range(3, 5):  # fail, fail: as many in a row as allowed
        write(round_)
        materialize(m)
    assert m.metrics.failed == 4
    write(5)
    assert m.trigger()
    with pytest.raises(MaterializationError, match=rf"operator {OPERATOR}\b.* failed 3 times") as info:
        m.wait(WAIT_S)
    assert "injected upload failure" in str(info.value)
    assert m.metrics.failed == 5
    handle = checkpoint(b, 1)  # the last good materialization plus the log still restore
    check_restores(env, handle, model)
    m.close()


def test_failure_restores_the_size_trigger(env: Env) -> None:
    """A failed materialization's logged bytes count again: the size trigger retries at once."""
    b = env.backends.new()
    upload = FlakyUpload(env.storage, failing={1})
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=500), upload=upload)
    apply_to_backend(b, batch_a())
    b.flush()
    assert b.log_bytes_since_materialization >= 500
    assert m.poll() is True
    m.wait(WAIT_S)
    assert m.metrics.failed == 1
    assert b.log_bytes_since_materialization >= 500
    assert m.poll() is True
    m.wait(WAIT_S)
    assert m.metrics.completed == 1
    assert b.log_bytes_since_materialization == 0
    m.close()


# -- 4. a crash in the middle of a materialization's upload --------------------------------------


def run_crashing_child(tmp: Path) -> tuple[KeyedStateHandle, str]:
    """Run the child until it hangs in its upload, SIGKILL it; return its handle and partial chunk."""
    handle_path, marker = tmp / "checkpoint-1.json", tmp / "uploading"
    cmd = [sys.executable, "-m", "tests.support.materializer_crash_child"]
    cmd += [str(tmp / "child"), str(handle_path), str(marker)]
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60.0
        while not marker.exists():
            try:
                code = proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                assert time.monotonic() < deadline, "the child never reached its upload"
                continue
            pytest.fail(f"the child exited with {code} before its upload: {proc.communicate()[1]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    return KeyedStateHandle.loads(handle_path.read_text()), marker.read_text()


def test_crash_during_materialization_upload(tmp_path: Path) -> None:
    handle, partial = run_crashing_child(tmp_path)
    model = checkpoint_1_model()
    assert handle.materialized and handle.changelog  # chunks of batch A, the log of batch B

    storage = new_storage(tmp_path / "child" / "dfs")
    backends = Backends(tmp_path, storage)
    env = Env(tmp_path, storage, backends)
    try:
        check_restores(env, handle, model, parallelisms=(1, 2))

        referenced = handle.referenced_files()
        shared, logs = set(storage.files.list("shared")), set(storage.files.list("dstl"))
        assert referenced <= shared | logs
        assert shared - referenced == {partial}  # what the crash left behind: the partial upload

        deleted = delete_unreferenced(storage.files, [handle])  # orphan cleanup after the crash
        assert set(deleted) == (shared | logs) - referenced
        assert set(storage.files.list("shared")) | set(storage.files.list("dstl")) == referenced
        check_restores(env, handle, model, parallelisms=(1, 4))
    finally:
        backends.close_all()
        storage.close()
