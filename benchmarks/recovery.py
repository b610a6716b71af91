"""``recovery``: restore time of a materialized snapshot plus the log after it, vs a full snapshot.

1. A backend (log on, local directory storage, one ``ValueState[int]``, int keys) holds N keys
   (2M; quick 400k), is materialized (``PeriodicMaterializer.trigger()`` + ``wait()``) and
   checkpointed; then M distinct random keys (200k; quick 40k) are updated, with a completed
   checkpoint every ``CHECKPOINT_EVERY`` updates, so that the last handle = the chunks + the log
   of those M changes. A fresh backend restores it (``materializer.periodic.restore``), timed:
   ``records_per_s`` = (materialized entries + logged changes) / restore seconds. A logged change
   is one key's new value: a value state logs one SET_BATCH record per key group and checkpoint,
   which ``restore()`` counts as one record, so its entries are counted instead.
2. The "equivalent full snapshot": a second backend fed the same final values, materialized with
   nothing logged after it, checkpointed; its restore is timed the same way.
   ``log_vs_full_ratio`` = restore seconds (snapshot + log) / restore seconds (full snapshot).
3. The floor: the same number of records as part 1 restores, done with nothing of ours:
   ``floor_records_per_s`` = records / seconds to zstd-1 decompress them (16-byte records: an
   8-byte big-endian key and an 8-byte value, compressed beforehand as frames of ``FLOOR_FRAME``
   records, each frame its keys then its values), cut each frame into its keys and values
   (``BytesIO.read`` mapped over the lengths, in C) and put them into a fresh LMDB environment
   (the flags of ours) with ``putmulti(append=True)``, one transaction, committed.
   ``floor_ratio`` = ``records_per_s`` / ``floor_records_per_s``.

Each restore runs ``ROUNDS`` times, the two kinds alternating, into an empty local directory (the
DFS files are in the OS page cache after the first round); the best of each kind counts.
Every restore is checked against the expected values of a sample of keys.

4. The lazy mode (``benchmarks.recovery_lazy``, whose docstring names its figures): the first batch
   after a crash (restore + 10,000 updates + checkpoint) with an eager and with a lazy restore, at
   three state sizes, on the local DFS and on S3 (moto behind the latency proxy);
   ``first_batch_growth_lazy`` (16S over S) and ``hydration_records_per_s``; the plot
   ``recovery_first_batch.png``.
"""

from __future__ import annotations

import io
import itertools
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import zstandard

from backend.core import records as rec
from backend.core.descriptors import ValueStateDescriptor
from backend.core.handles import KeyedStateHandle
from backend.core.serializers import Int64Serializer
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from benchmarks.common import BenchResult, progress
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, restore

ALL = KeyGroupRange(0, 127)
CHECKPOINT_EVERY = 50_000
ROUNDS = 3
#: records per zstd frame of the floor (part 3)
FLOOR_FRAME = 65_536
DESCRIPTOR = ValueStateDescriptor("count", Int64Serializer())


def _materialize(backend: ChangelogKeyedStateBackend) -> PeriodicMaterializer:
    mat = PeriodicMaterializer(backend, MaterializationOptions(size_trigger_bytes=None))
    try:
        if not mat.trigger():
            raise RuntimeError("materialization did not start")
        mat.wait()
        if mat.metrics.completed != 1:
            raise RuntimeError(f"materialization failed: {mat.metrics}")
    finally:
        mat.close()
    return mat


def _load(backend: ChangelogKeyedStateBackend, keys: int, value: Callable[[int], int]) -> None:
    state = backend.get_state(DESCRIPTOR)
    set_key = backend.set_current_key
    for k in range(keys):
        set_key(k)
        state.update(value(k))
        if k % 200_000 == 199_999:
            backend.flush()


def _checkpoint(backend: ChangelogKeyedStateBackend, cid: int) -> KeyedStateHandle:
    handle = backend.snapshot(cid).result(300)
    backend.notify_checkpoint_complete(cid)
    return handle


def _log_changes(storage: StateChangelogStorage, handle: KeyedStateHandle) -> tuple[int, int]:
    """(records, changes) in the handle's log: a SET_BATCH record holds one change per key."""
    records = changes = 0
    for entry in handle.changelog:
        for _, data in storage.read(entry.log, entry.key_groups):
            op, _sid, _ck, rest = rec.parse_record(data)
            records += 1
            changes += len(rec.split_batch(op, rest)) if op in rec.BATCH_OPS else 1
    return records, changes


def _sizes(handle: KeyedStateHandle) -> tuple[int, int]:
    chunks = sum(int(c["size"]) for c in handle.materialized)
    log = sum(e.log.size for e in handle.changelog)
    return chunks, log


def _restore(
    tmp: Path, storage: StateChangelogStorage, handle: KeyedStateHandle, name: str, expected: dict[int, int]
) -> tuple[float, int]:
    """Seconds of one restore into a fresh directory and the count restore() returned; checks sampled keys."""
    local = tmp / f"restore-{name}"
    backend = ChangelogKeyedStateBackend("bench", ALL, local, storage=storage)
    try:
        start = time.perf_counter()
        applied = restore(backend, [handle])
        seconds = time.perf_counter() - start
        state = backend.get_state(DESCRIPTOR)
        for k, v in expected.items():
            backend.set_current_key(k)
            got = state.value()
            if got != v:
                raise AssertionError(f"restored {name}: key {k} has {got}, expected {v}")
    finally:
        backend.close()
        shutil.rmtree(local)  # the next round starts from an empty directory again
    return seconds, applied


def _floor_frames(records: int) -> list[tuple[int, bytes]]:
    """Part 3's input: ``records`` 16-byte records as zstd-1 frames of (count, keys then values)."""
    compressor = zstandard.ZstdCompressor(level=1)
    frames = []
    for first in range(0, records, FLOOR_FRAME):
        count = min(FLOOR_FRAME, records - first)
        keys = b"".join(k.to_bytes(8, "big") for k in range(first, first + count))
        values = b"".join((k * 7).to_bytes(8, "little") for k in range(first, first + count))
        frames.append((count, compressor.compress(keys + values)))
    return frames


def _floor(tmp: Path, frames: list[tuple[int, bytes]]) -> float:
    """Seconds of part 3's work: decompress, cut and bulk-load ``frames`` into a fresh LMDB."""
    local = tmp / "floor"
    local.mkdir()
    try:
        start = time.perf_counter()
        env = lmdb.open(
            str(local), map_size=1 << 34, max_dbs=4096, sync=False, metasync=False, readahead=False, writemap=False
        )
        decompressor = zstandard.ZstdDecompressor()
        with env.begin(write=True) as txn:
            cursor = txn.cursor(db=env.open_db(b"floor", txn=txn))
            for count, frame in frames:
                raw = io.BytesIO(decompressor.decompress(frame))
                keys = list(map(raw.read, itertools.repeat(8, count)))
                values = list(map(raw.read, itertools.repeat(8, count)))
                cursor.putmulti(zip(keys, values, strict=True), append=True)
        env.close()
        return time.perf_counter() - start
    finally:
        shutil.rmtree(local)


def run(quick: bool, out_dir: Path) -> BenchResult:
    keys = 400_000 if quick else 2_000_000
    updates = 40_000 if quick else 200_000
    rng = random.Random(7)
    changed = rng.sample(range(keys), updates)
    final = {k: keys + i for i, k in enumerate(changed)}  # distinct new values

    def final_value(k: int) -> int:
        return final.get(k, k)

    sample = rng.sample(range(keys), 2000) + changed[:2000]
    expected = {k: final_value(k) for k in sample}

    with (
        tempfile.TemporaryDirectory() as tmpdir,
        StateChangelogStorage(ChangelogConfig.local(Path(tmpdir) / "dfs")) as st,
    ):
        tmp = Path(tmpdir)
        # 1. snapshot + log
        progress(f"recovery: loading {keys:,} keys, materializing")
        backend = ChangelogKeyedStateBackend("bench", ALL, tmp / "log", storage=st)
        _load(backend, keys, lambda k: k)
        _checkpoint(backend, 1)
        _materialize(backend)
        _checkpoint(backend, 2)
        progress(f"recovery: {updates:,} updates after the materialization")
        state = backend.get_state(DESCRIPTOR)
        cid = 2
        handle: KeyedStateHandle | None = None
        for i, k in enumerate(changed, start=1):
            backend.set_current_key(k)
            state.update(final[k])
            if i % CHECKPOINT_EVERY == 0 or i == updates:
                cid += 1
                handle = _checkpoint(backend, cid)
        assert handle is not None
        backend.close()
        log_chunks, log_bytes = _sizes(handle)
        log_entries = sum(int(c["entries"]) for c in handle.materialized)
        log_records, log_changes = _log_changes(st, handle)

        # 2. the equivalent full snapshot
        progress(f"recovery: full snapshot of the same {keys:,} final values")
        full_backend = ChangelogKeyedStateBackend("bench", ALL, tmp / "full", storage=st)
        _load(full_backend, keys, final_value)
        _checkpoint(full_backend, 1)
        _materialize(full_backend)
        full_handle = _checkpoint(full_backend, 2)
        full_backend.close()
        full_chunks, full_log = _sizes(full_handle)
        full_entries = sum(int(c["entries"]) for c in full_handle.materialized)

        frames = _floor_frames(log_entries + log_changes)
        times: dict[str, list[float]] = {"log": [], "full": [], "floor": []}
        for r in range(ROUNDS):  # alternating, against the machine's noise; the best of each counts
            seconds, log_applied = _restore(tmp, st, handle, "log", expected)
            times["log"].append(seconds)
            seconds, full_applied = _restore(tmp, st, full_handle, "full", expected)
            times["full"].append(seconds)
            times["floor"].append(_floor(tmp, frames))
            progress(
                f"recovery: round {r + 1}/{ROUNDS}: snapshot + log {times['log'][-1]:.3f} s, full {seconds:.3f} s, "
                f"floor {times['floor'][-1]:.3f} s"
            )
        log_s, full_s, floor_s = min(times["log"]), min(times["full"]), min(times["floor"])

        from benchmarks import recovery_lazy  # it imports this module's loaders

        lazy = recovery_lazy.run_lazy(tmp, st, quick, out_dir)
        plot, lazy_times = lazy.pop("_plot"), lazy.pop("_times")

    total = log_entries + log_changes
    records_per_s = total / log_s
    ratio = log_s / full_s
    metrics: dict[str, Any] = {
        "keys": keys,
        "updates_after_materialization": updates,
        "records_per_s": round(records_per_s),
        "log_vs_full_ratio": round(ratio, 3),
        "floor_records_per_s": round(total / floor_s),
        "floor_ratio": round(floor_s / log_s, 3),
        "restore_s_log": round(log_s, 3),
        "restore_s_full": round(full_s, 3),
        "materialized_entries_log": log_entries,
        "log_records": log_records,
        "log_changes": log_changes,
        "restore_returned_log": log_applied,
        "bytes_chunks_log": log_chunks,
        "bytes_log": log_bytes,
        "materialized_entries_full": full_entries,
        "restore_returned_full": full_applied,
        "bytes_chunks_full": full_chunks,
        "bytes_log_full": full_log,
        "records_per_s_full": round(full_entries / full_s),
        **lazy,
    }
    mib = 1 << 20
    return BenchResult(
        name="recovery",
        metrics=metrics,
        table=[
            ("keys", f"{keys:,}, then {updates:,} changed keys logged (checkpoint every {CHECKPOINT_EVERY:,})"),
            (
                "snapshot + log",
                f"{log_s:.3f} s; {log_entries:,} entries ({log_chunks / mib:.1f} MiB chunks) + "
                f"{log_changes:,} changes in {log_records:,} records ({log_bytes / mib:.2f} MiB log)",
            ),
            ("full snapshot", f"{full_s:.3f} s; {full_entries:,} entries ({full_chunks / mib:.1f} MiB chunks)"),
            ("records/s (snapshot + log)", f"{records_per_s:,.0f}  (target >= 1,000,000)"),
            ("records/s (full snapshot)", f"{full_entries / full_s:,.0f}"),
            (
                "floor: records/s, ratio",
                f"{total / floor_s:,.0f} (zstd-1 + putmulti, nothing of ours); ours / floor "
                f"{floor_s / log_s:.3f}  (goal >= 0.8)",
            ),
            ("log/full restore ratio", f"{ratio:.3f}  (target <= 1.3)"),
            *recovery_lazy.table(metrics),
        ],
        details={
            "rounds": ROUNDS,
            "checkpoint_every": CHECKPOINT_EVERY,
            "restore_seconds": times,
            "lazy_seconds": lazy_times,
        },
        plots=[plot] if plot else [],
    )
