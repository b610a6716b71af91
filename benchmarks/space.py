"""``space``: DFS space amplification with periodic materialization and 2 retained checkpoints.

Two runs, each on its own local-directory DFS, a backend with ``num_retained=2`` and a
``PeriodicMaterializer`` whose clock is the checkpoint counter (``interval_ms=MATERIALIZE_EVERY``,
no size trigger; the first materialization is jittered as usual, with a seeded rng):

a. ``value``: a fixed set of int keys (500k; quick 100k) holding counters; each checkpoint
   increments 5% of them (random keys, read-modify-write ``update(value() + 1)``).
b. ``window``: a sliding window: each checkpoint inserts a window of new keys (20k; quick 5k),
   each with a random 32-bit aggregate, and clears the keys of the oldest window, so ``WINDOWS``
   windows are live.

Each step: the changes, ``poll()`` (a due materialization runs to completion before the
checkpoint, so the checkpoint references it), a checkpoint (completed), then the cleanup that
stands in for the shared-state registry: every file under ``dstl/`` and ``shared/`` that the 2
newest completed handles do not reference is deleted (the storage itself already deletes log
files that are truncated and unconfirmed). DFS bytes (every file under the base directory) are
recorded after the checkpoint and after the cleanup. At the end, both retained checkpoints are
restored into fresh backends (the newest must hold exactly the live entries), which checks that
the cleanup deleted nothing a retained checkpoint needs.

``amplification_*`` = DFS bytes after the final cleanup / compressed size of the live state, which
is the final (key, value) entries read from the backend's tables and encoded as ONE chunk
(``materializer.chunks.encode_chunk`` over key groups [0, 127], zstd level 1, the materializer's
level). The mean and max over the steady state (after the first materialization) are reported
too, since the final value depends on where in the materialization cycle the run stops.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.checkpointing.cleanup import delete_unreferenced, referenced_files
from backend.core.descriptors import ValueStateDescriptor
from backend.core.handles import KeyedStateHandle
from backend.core.serializers import Int64Serializer
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from benchmarks.common import BenchResult, progress, save_figure
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage
from materializer.chunks import encode_chunk
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, restore

ALL = KeyGroupRange(0, 127)
RETAINED = 2
MATERIALIZE_EVERY = 10  # checkpoints
WINDOWS = 10
UPDATE_FRACTION = 0.05
DESCRIPTOR = ValueStateDescriptor("v", Int64Serializer())


@dataclass
class _Trace:
    before: list[int] = field(default_factory=list)  # DFS bytes after each checkpoint
    after: list[int] = field(default_factory=list)  # ... and after its cleanup
    materialized_at: list[int] = field(default_factory=list)  # checkpoint ids
    deleted_files: int = 0


def _dfs_bytes(root: Path) -> int:
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            total += os.path.getsize(os.path.join(directory, name))
    return total


def _cleanup(storage: StateChangelogStorage, retained: list[KeyedStateHandle]) -> int:
    return len(delete_unreferenced(storage.files, retained))


def _live_size(backend: ChangelogKeyedStateBackend) -> tuple[int, int]:
    """(one-chunk compressed bytes, entries) of what the backend's tables hold now."""
    backend.flush()
    sections: dict[str, list[tuple[bytes, bytes]]] = {}
    for name, db in backend.tables.databases().items():
        entries = list(backend.tables.scan_prefix(db, b""))
        if entries:
            sections[name] = entries
    return len(encode_chunk(ALL, 0, sections)), sum(map(len, sections.values()))


class _Run:
    """One backend on its own DFS directory, checkpointing, materializing and cleaning up."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.tmp, self.name = tmp, name
        self.root = tmp / f"{name}-dfs"
        self.storage = StateChangelogStorage(ChangelogConfig.local(self.root))
        self.backend = ChangelogKeyedStateBackend(
            name, ALL, tmp / f"{name}-local", storage=self.storage, num_retained=RETAINED
        )
        self.state = self.backend.get_state(DESCRIPTOR)
        self.now = 0.0
        self.mat = PeriodicMaterializer(
            self.backend,
            MaterializationOptions(interval_ms=MATERIALIZE_EVERY, size_trigger_bytes=None),
            clock_ms=lambda: self.now,
            rng=random.Random(3),
        )
        self.retained: list[KeyedStateHandle] = []
        self.trace = _Trace()

    def set(self, key: int, value: int | None) -> None:
        self.backend.set_current_key(key)
        if value is None:
            self.state.clear()
        else:
            self.state.update(value)

    def step(self, cid: int) -> None:
        self.now = float(cid)
        if self.mat.poll():
            self.mat.wait()
            self.trace.materialized_at.append(cid)
        handle = self.backend.snapshot(cid).result(300)
        self.backend.notify_checkpoint_complete(cid)
        self.retained = [*self.retained, handle][-RETAINED:]
        self.storage.flush()  # the storage's own background deletions
        self.trace.before.append(_dfs_bytes(self.root))
        self.trace.deleted_files += _cleanup(self.storage, self.retained)
        self.trace.after.append(_dfs_bytes(self.root))

    def referenced_bytes(self) -> tuple[int, int, int]:
        """(chunk bytes, log file bytes, chunk files) the retained handles reference."""
        paths = referenced_files(self.retained)
        chunks = [p for p in paths if p.startswith("shared/")]
        chunk_bytes = sum(os.path.getsize(self.root / p) for p in chunks)
        log_bytes = sum(os.path.getsize(self.root / p) for p in paths if p.startswith("dstl/"))
        return chunk_bytes, log_bytes, len(chunks)

    def verify(self, live_entries: int) -> None:
        """The cleanup deleted nothing needed: both retained checkpoints restore; the newest holds the live state."""
        for i, handle in enumerate(self.retained):
            fresh = ChangelogKeyedStateBackend(
                self.name, ALL, self.tmp / f"{self.name}-verify-{i}", storage=self.storage
            )
            try:
                restore(fresh, [handle])
                entries = fresh.tables.entry_count()
            finally:
                fresh.close()
            if handle is self.retained[-1] and entries != live_entries:
                raise AssertionError(
                    f"{self.name}: the newest checkpoint restores {entries} entries, not {live_entries}"
                )

    def close(self) -> None:
        self.mat.close()
        self.backend.close()
        self.storage.close()


def _summary(run: _Run, live: int, entries: int) -> dict[str, Any]:
    t = run.trace
    steady = t.after[t.materialized_at[0] - 1 :] if t.materialized_at else t.after
    m = run.mat.metrics
    chunk_bytes, log_bytes, chunk_files = run.referenced_bytes()
    return {
        "amplification": round(t.after[-1] / live, 3),
        "amplification_mean": round(sum(steady) / len(steady) / live, 3),
        "amplification_max": round(max(steady) / live, 3),
        "final_dfs_bytes": t.after[-1],
        "live_bytes": live,
        "live_entries": entries,
        "last_materialization_bytes": m.last_full_size,
        "materialization_vs_live": round(m.last_full_size / live, 3),
        "final_chunk_bytes": chunk_bytes,
        "final_chunk_files": chunk_files,
        "final_log_bytes": log_bytes,
        "materializations": m.completed,
        "materialized_at": t.materialized_at,
        "checkpoints": len(t.after),
        "files_deleted_by_cleanup": t.deleted_files,
        "dfs_bytes_after_checkpoint": t.before,
        "dfs_bytes_after_cleanup": t.after,
    }


def _value_run(tmp: Path, keys: int, steps: int) -> dict[str, Any]:
    run = _Run(tmp, "value")
    try:
        rng = random.Random(11)
        progress(f"space: value run: {keys:,} keys, {steps} checkpoints")
        for k in range(keys):
            run.set(k, 0)
        per_step = int(keys * UPDATE_FRACTION)
        for cid in range(1, steps + 1):
            for k in rng.sample(range(keys), per_step):
                run.backend.set_current_key(k)
                run.state.update(run.state.value() + 1)
            run.step(cid)
            if cid % 20 == 0:
                progress(f"space: value run: checkpoint {cid}, {run.trace.after[-1] / 1e6:.1f} MB")
        live, entries = _live_size(run.backend)
        run.verify(entries)
        return _summary(run, live, entries)
    finally:
        run.close()


def _window_run(tmp: Path, window: int, steps: int) -> dict[str, Any]:
    run = _Run(tmp, "window")
    rng = random.Random(12)
    try:
        progress(f"space: window run: windows of {window:,} keys, {WINDOWS} live, {steps} checkpoints")
        for cid in range(1, steps + 1):
            for k in range(cid * window, (cid + 1) * window):
                run.set(k, rng.getrandbits(32))
            oldest = cid - WINDOWS
            if oldest >= 1:
                for k in range(oldest * window, (oldest + 1) * window):
                    run.set(k, None)
            run.step(cid)
            if cid % 20 == 0:
                progress(f"space: window run: checkpoint {cid}, {run.trace.after[-1] / 1e6:.1f} MB")
        live, entries = _live_size(run.backend)
        if entries != WINDOWS * window:
            raise AssertionError(f"window run: {entries} live entries, expected {WINDOWS * window}")
        run.verify(entries)
        return _summary(run, live, entries)
    finally:
        run.close()


def _plot(path: Path, runs: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (name, s) in zip(axes, runs.items(), strict=True):
        xs = list(range(1, s["checkpoints"] + 1))
        mb = 1e6
        ax.plot(xs, [b / mb for b in s["dfs_bytes_after_checkpoint"]], color="0.7", lw=1, label="after checkpoint")
        ax.plot(xs, [b / mb for b in s["dfs_bytes_after_cleanup"]], color="C0", lw=1.5, label="after cleanup")
        ax.axhline(s["live_bytes"] / mb, color="C2", ls="--", lw=1, label="live state (final, one chunk)")
        for x in s["materialized_at"]:
            ax.axvline(x, color="C3", alpha=0.25, lw=0.8)
        ax.set_title(f"{name}: final amplification {s['amplification']:.2f}")
        ax.set_xlabel("checkpoint (red: materialization)")
        ax.set_ylabel("DFS MB")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"DFS bytes, {RETAINED} retained checkpoints, materialization every {MATERIALIZE_EVERY} checkpoints")
    save_figure(fig, path)


def run(quick: bool, out_dir: Path) -> BenchResult:
    keys = 100_000 if quick else 500_000
    window = 5_000 if quick else 20_000
    steps = 60 if quick else 120
    with tempfile.TemporaryDirectory() as tmpdir:
        value = _value_run(Path(tmpdir), keys, steps)
        win = _window_run(Path(tmpdir), window, steps)
    plot = out_dir / "space.png"
    _plot(plot, {"value": value, "window": win})
    metrics = {
        "amplification_value": value["amplification"],
        "amplification_window": win["amplification"],
        "amplification_value_mean": value["amplification_mean"],
        "amplification_value_max": value["amplification_max"],
        "amplification_window_mean": win["amplification_mean"],
        "amplification_window_max": win["amplification_max"],
        "live_bytes_value": value["live_bytes"],
        "live_bytes_window": win["live_bytes"],
        "final_dfs_bytes_value": value["final_dfs_bytes"],
        "final_dfs_bytes_window": win["final_dfs_bytes"],
        "denominator": "final live entries encoded as one chunk (encode_chunk, key groups [0, 127], level 1)",
    }
    mb = 1e6

    def row(s: dict[str, Any]) -> str:
        return (
            f"{s['amplification']:.3f} final, {s['amplification_mean']:.3f} mean, {s['amplification_max']:.3f} max  "
            f"({s['final_dfs_bytes'] / mb:.2f} MB DFS / {s['live_bytes'] / mb:.2f} MB live; "
            f"last materialization {s['last_materialization_bytes'] / mb:.2f} MB)"
        )

    def parts(s: dict[str, Any]) -> str:
        return (
            f"{s['final_chunk_files']} chunk files {s['final_chunk_bytes'] / mb:.2f} MB + "
            f"log files {s['final_log_bytes'] / mb:.2f} MB; one materialization = "
            f"{s['materialization_vs_live']:.3f} x live"
        )

    return BenchResult(
        name="space",
        metrics=metrics,
        table=[
            ("setup", f"{steps} checkpoints, materialize every {MATERIALIZE_EVERY}, {RETAINED} retained"),
            ("value run", f"{keys:,} keys, {UPDATE_FRACTION:.0%} updated per checkpoint"),
            ("window run", f"windows of {window:,} keys, {WINDOWS} live, one new per checkpoint"),
            ("amplification, value", row(value) + "  (target <= 1.5)"),
            ("amplification, window", row(win) + "  (target <= 3)"),
            ("final DFS, value", parts(value)),
            ("final DFS, window", parts(win)),
        ],
        details={"value": value, "window": win},
        plots=[str(plot)],
    )
