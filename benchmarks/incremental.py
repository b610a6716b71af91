"""``incremental``: bytes uploaded by a materialization after changes in few key groups.

A backend (log on, local directory storage, one ``ValueState[int]``) holds N int keys (1M; quick
200k) over 128 key groups, one chunk per key group (``chunk_key_groups=1``, the default), and is
materialized in full. Then every key of 2 key groups (1% of 128 = 1.28, rounded up; the
conservative choice) gets a new value and the backend is materialized again:
``incremental_ratio`` = bytes the second materialization uploaded / bytes of the first (full) one
(``metrics.last_incremental_size`` / ``last_full_size``). A third round with 1 changed key group
is reported as well. Each changed round is followed by a completed checkpoint, as in a job.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from backend.core.descriptors import ValueStateDescriptor
from backend.core.serializers import Int64Serializer
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from benchmarks.common import BenchResult, progress
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer

ALL = KeyGroupRange(0, 127)
CHANGED_ROUNDS = ((5, 77), (42,))  # key groups whose keys change before the 2nd and the 3rd materialization


def _materialize(mat: PeriodicMaterializer) -> dict[str, Any]:
    before = mat.metrics.completed
    if not mat.trigger():
        raise RuntimeError("materialization did not start")
    mat.wait()
    m = mat.metrics
    if m.completed != before + 1:
        raise RuntimeError(f"materialization failed: {m}")
    return {
        "full_bytes": m.last_full_size,
        "uploaded_bytes": m.last_incremental_size,
        "seconds": round(m.last_duration_ms / 1000, 4),
        "chunks_uploaded_total": m.chunks_uploaded,
        "chunks_reused_total": m.chunks_reused,
    }


def run(quick: bool, out_dir: Path) -> BenchResult:
    keys = 200_000 if quick else 1_000_000
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, StateChangelogStorage(ChangelogConfig.local(Path(tmp) / "dfs")) as st:
        backend = ChangelogKeyedStateBackend("bench", ALL, Path(tmp) / "local", storage=st)
        mat = PeriodicMaterializer(backend, MaterializationOptions(size_trigger_bytes=None))
        try:
            state = backend.get_state(ValueStateDescriptor("count", Int64Serializer()))
            progress(f"incremental: loading {keys:,} keys")
            by_group: dict[int, list[int]] = {}
            for k in range(keys):
                backend.set_current_key(k)
                state.update(k)
                by_group.setdefault(backend.current_kg, []).append(k)
                if k % 200_000 == 199_999:
                    backend.flush()
            backend.snapshot(1).result(300)
            backend.notify_checkpoint_complete(1)
            progress("incremental: full materialization")
            rounds.append({"changed_key_groups": [], "changed_keys": keys, **_materialize(mat)})
            for i, groups in enumerate(CHANGED_ROUNDS, start=2):
                changed = [k for kg in groups for k in by_group.get(kg, [])]
                for k in changed:
                    backend.set_current_key(k)
                    state.update(k + i * keys)
                backend.snapshot(i).result(300)
                backend.notify_checkpoint_complete(i)
                progress(f"incremental: materialization after changing key groups {list(groups)}")
                rounds.append({"changed_key_groups": list(groups), "changed_keys": len(changed), **_materialize(mat)})
        finally:
            mat.close()
            backend.close()
    full = rounds[0]["full_bytes"]
    for r in rounds:
        r["ratio"] = round(r["uploaded_bytes"] / full, 5)
    two, one = rounds[1], rounds[2]
    metrics = {
        "keys": keys,
        "incremental_ratio": two["ratio"],
        "incremental_ratio_1_key_group": one["ratio"],
        "full_bytes": full,
        "incremental_bytes": two["uploaded_bytes"],
        "incremental_bytes_1_key_group": one["uploaded_bytes"],
        "full_seconds": rounds[0]["seconds"],
        "incremental_seconds": two["seconds"],
    }
    chunks = rounds[-1]["chunks_uploaded_total"], rounds[-1]["chunks_reused_total"]
    return BenchResult(
        name="incremental",
        metrics=metrics,
        table=[
            ("keys", f"{keys:,} over 128 key groups, one chunk per key group"),
            ("full materialization", f"{full:,} bytes in {rounds[0]['seconds']:.3f} s"),
            (
                "2 key groups changed",
                f"{two['uploaded_bytes']:,} bytes uploaded ({two['changed_keys']:,} keys) in {two['seconds']:.3f} s; "
                f"ratio {two['ratio']:.4f}  (target <= 0.05)",
            ),
            (
                "1 key group changed",
                f"{one['uploaded_bytes']:,} bytes uploaded ({one['changed_keys']:,} keys) in {one['seconds']:.3f} s; "
                f"ratio {one['ratio']:.4f}",
            ),
            ("chunks uploaded / reused", f"{chunks[0]} / {chunks[1]} over the 3 materializations"),
        ],
        details={"rounds": rounds},
    )
