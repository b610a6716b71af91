"""The lazy mode of ``recovery``: the first batch after a crash, eager vs lazy restore, against state size.

At three state sizes S, 4S and 16S (1M, 4M, 16M keys; quick 250k, 1M, 4M) a backend (the
``recovery`` part 1 setup: one ``ValueState[int]``, int keys, log on) is loaded, checkpointed,
materialized, then ``LOG_CHANGES`` random keys are changed (a checkpoint every
``CHECKPOINT_EVERY``), and the backend is dropped without ``close`` (a crash: only its last
completed checkpoint counts). The same checkpoint is restored from two stores: the local DFS it
was written to, and S3: its files copied as they are into moto's S3 server, read through the
latency proxy with the ``hedging`` benchmark's profile (FLIP-158's S3 latencies x 0.1, one
connection per request, every answer held for its draw).

What one *first batch* is, timed from a fresh backend on: ``materializer.periodic.restore``
(eager or lazy), then 10,000 updates to random keys as a Spark micro-batch runs them
(``with backend.batch(keys):`` + ``value()``/``update(v + 1)`` per key), then a checkpoint
(``snapshot`` until durable, as the ``state`` benchmark's batches). After a lazy first batch,
``hydrate()`` loads the rest (timed on its own). Every restore is checked on the batch's keys and a
sample of others, after the hydration too. The three states are built first; then each of
``ROUNDS`` rounds restores every size, eager and lazy, the sizes side by side, on fresh local
directories, the local rounds before the S3 ones; the best of each counts. Why side by side: a
growth is the ratio of two sizes, and measured minutes apart the shared machine's drift went into
it. Why the local rounds first: after an S3 round the S3 side may still be busy on the same cores
(the proxy holds every answer for its latency draw, hedges that lost included, and moto serves
them), which slowed a local round right after one (docs/benchmarks.md).

Figures (``SIZE`` is ``S``, ``4S`` or ``16S``; S3's names end in ``_s3``):

- ``first_batch_s_SIZE_eager``, ``first_batch_s_SIZE_lazy`` (``..._eager_s3``, ``..._lazy_s3``);
- ``first_batch_growth_lazy`` = ``first_batch_s_16S_lazy / first_batch_s_S_lazy`` (goal <= 1.3),
  ``first_batch_growth_eager``, and the same with ``_s3``;
- ``hydration_records_per_s``: the 16S state's records (materialized entries + logged changes,
  as ``recovery``'s ``records_per_s`` counts them) over the seconds of ``hydrate()`` after the
  first batch; goal >= ``eager_records_per_s``, the eager restore's records/s of the same state in
  the same run (and ``_s3`` for both);
- ``restore_s_SIZE_eager``/``_lazy`` (and ``_s3``): the restore's part of the first batch.
"""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.core.handles import KeyedStateHandle
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from benchmarks.common import progress, save_figure
from benchmarks.recovery import CHECKPOINT_EVERY, DESCRIPTOR, _checkpoint, _load, _log_changes, _materialize
from benchmarks.support.latency_proxy import run_in_subprocess
from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY, create_bucket, start_s3_server
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage
from dstl.config import S3Options
from materializer.periodic import restore

ALL = KeyGroupRange(0, 127)
LABELS = ("S", "4S", "16S")
BATCH_KEYS = 10_000
ROUNDS = 2
BUCKET = "recovery-bench"
#: the ``hedging`` benchmark's profile: FLIP-158's S3 latencies scaled by this
S3_SCALE = 0.1
MODES = ("eager", "lazy")
STORES = ("local", "s3")


@dataclass
class _Size:
    """One state size's checkpoint and what its restores measured."""

    label: str
    keys: int
    handle: KeyedStateHandle
    records: int  # materialized entries + logged changes, as ``recovery`` counts them
    final: dict[int, int]
    times: dict[str, list[float]] = field(default_factory=dict)  # "first_batch|restore|hydrate  mode store"

    def value(self, k: int) -> int:
        return self.final.get(k, k)


def _name(what: str, label: str, mode: str, store: str) -> str:
    return f"{what}_{label}_{mode}" + ("_s3" if store == "s3" else "")


def _s3_config(endpoint: str) -> ChangelogConfig:
    return ChangelogConfig(
        base_path=f"s3://{BUCKET}/bench",
        s3=S3Options(
            endpoint_url=endpoint,
            region=REGION,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            force_close=True,  # every request draws its own latency, as in ``hedging``
        ),
    )


def _copy_to_s3(local: StateChangelogStorage, direct: StateChangelogStorage, handle: KeyedStateHandle) -> int:
    """Copy the files ``handle`` references from the local DFS to S3 (straight to moto); bytes copied."""
    paths = {str(c["path"]) for c in handle.materialized} | {p for e in handle.changelog for p in e.log.files}
    copied = 0
    for path in sorted(paths):
        data = local.files.get(path)
        direct.files.put(path, data)
        copied += len(data)
    return copied


def _build(
    tmp: Path,
    st: StateChangelogStorage,
    label: str,
    keys: int,
    log_changes: int,
) -> tuple[_Size, ChangelogKeyedStateBackend]:
    """Load, materialize and log a state of ``keys`` keys; returns it and the crashed backend."""
    progress(f"recovery lazy: {label}: loading {keys:,} keys, materializing, {log_changes:,} changes logged")
    rng = random.Random(keys)
    backend = ChangelogKeyedStateBackend("bench", ALL, tmp / f"build-{label}", storage=st)
    _load(backend, keys, lambda k: k)
    _checkpoint(backend, 1)
    _materialize(backend)
    _checkpoint(backend, 2)
    changed = rng.sample(range(keys), log_changes)
    final = {k: keys + i for i, k in enumerate(changed)}
    state = backend.get_state(DESCRIPTOR)
    cid, handle = 2, None
    for i, k in enumerate(changed, start=1):
        backend.set_current_key(k)
        state.update(final[k])
        if i % CHECKPOINT_EVERY == 0 or i == log_changes:
            cid += 1
            handle = _checkpoint(backend, cid)
    assert handle is not None
    entries = sum(int(c["entries"]) for c in handle.materialized)
    _, logged = _log_changes(st, handle)
    return _Size(label, keys, handle, entries + logged, final), backend


def _first_batch(
    tmp: Path,
    storage: StateChangelogStorage,
    size: _Size,
    mode: str,
    store: str,
    batch: list[int],
    sample: list[int],
) -> None:
    """One restore + first batch (+ hydration when lazy), timed into ``size.times``; checks values."""
    local = tmp / f"restore-{size.label}-{mode}-{store}"
    backend = ChangelogKeyedStateBackend("bench", ALL, local, storage=storage)
    try:
        start = time.perf_counter()
        restore(backend, [size.handle], mode=mode)  # type: ignore[arg-type]
        restored = time.perf_counter()
        state = backend.get_state(DESCRIPTOR)
        set_key = backend.set_current_key
        with backend.batch(batch):
            for k in batch:
                set_key(k)
                state.update(state.value() + 1)
        backend.snapshot(100).result(300)
        end = time.perf_counter()
        backend.notify_checkpoint_complete(100)
        hydrate_s = 0.0
        if mode == "lazy":
            _check(backend, state, size, batch, sample, f"{mode} {store}, before hydrating")
            before = time.perf_counter()
            backend.hydrate()
            hydrate_s = time.perf_counter() - before
            assert backend.fully_local
        _check(backend, state, size, batch, sample, f"{mode} {store}")
    finally:
        backend.close()
        shutil.rmtree(local)
    for what, seconds in (("first_batch", end - start), ("restore", restored - start), ("hydrate", hydrate_s)):
        size.times.setdefault(f"{what} {mode} {store}", []).append(seconds)
    extra = f", hydrate {hydrate_s:.3f} s" if mode == "lazy" else ""
    progress(
        f"recovery lazy: {size.label} {mode:<5} {store:<5}: first batch {end - start:.3f} s "
        f"(restore {restored - start:.3f} s){extra}"
    )


def _check(backend: Any, state: Any, size: _Size, batch: list[int], sample: list[int], what: str) -> None:
    in_batch = set(batch)
    for k in sample + batch[:500]:
        backend.set_current_key(k)
        got, want = state.value(), size.value(k) + (1 if k in in_batch else 0)
        if got != want:
            raise AssertionError(f"restored {size.label} ({what}): key {k} has {got}, expected {want}")


def run_lazy(tmp: Path, st: StateChangelogStorage, quick: bool, out_dir: Path) -> dict[str, Any]:
    """The lazy mode's figures (module doc), on the local DFS ``st`` and on S3."""
    sizes = (250_000, 1_000_000, 4_000_000) if quick else (1_000_000, 4_000_000, 16_000_000)
    log_changes = 25_000 if quick else 100_000
    server = start_s3_server()
    proxy = None
    results: list[_Size] = []
    try:
        create_bucket(server.endpoint_url, BUCKET)
        proxy, port = run_in_subprocess(server.port, scale=S3_SCALE, seed=42, delay_response=True)
        with (
            StateChangelogStorage(_s3_config(server.endpoint_url)) as direct,
            StateChangelogStorage(_s3_config(f"http://127.0.0.1:{port}")) as s3,
        ):
            built = []
            for label, keys in zip(LABELS, sizes, strict=True):
                size, crashed = _build(tmp, st, label, keys, log_changes)
                copied = _copy_to_s3(st, direct, size.handle)
                progress(f"recovery lazy: {label}: {copied / (1 << 20):.1f} MiB copied to S3")
                rng = random.Random(keys + 1)
                sample = rng.sample(range(keys), 500) + list(size.final)[:500]
                built.append((size, crashed, sample, [rng.sample(range(keys), BATCH_KEYS) for _ in range(ROUNDS)]))
            for store, storage in (("local", st), ("s3", s3)):  # module doc: the local rounds first
                for r in range(ROUNDS):
                    for size, _, sample, batches in built:  # module doc: the sizes side by side
                        for mode in MODES:
                            _first_batch(tmp, storage, size, mode, store, batches[r], sample)
                    progress(f"recovery lazy: {store}: round {r + 1}/{ROUNDS} done")
            for size, crashed, _, _ in built:
                crashed.close()  # the crashed processes' leftovers
                shutil.rmtree(tmp / f"build-{size.label}")
                results.append(size)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        server.stop()
    return _figures(results, log_changes, out_dir)


def _figures(results: list[_Size], log_changes: int, out_dir: Path) -> dict[str, Any]:
    metrics: dict[str, Any] = {"lazy_log_changes": log_changes, "lazy_batch_keys": BATCH_KEYS}
    best: dict[str, float] = {}
    for size in results:
        metrics[f"state_keys_{size.label}"] = size.keys
        for key, values in size.times.items():
            best[f"{key} {size.label}"] = min(values)
        for store in STORES:
            for mode in MODES:
                for what in ("first_batch_s", "restore_s"):
                    metrics[_name(what, size.label, mode, store)] = round(
                        best[f"{what[:-2]} {mode} {store} {size.label}"], 3
                    )
    big = results[-1]
    for store in STORES:
        suffix = "_s3" if store == "s3" else ""
        for mode in MODES:
            growth = best[f"first_batch {mode} {store} 16S"] / best[f"first_batch {mode} {store} S"]
            metrics[f"first_batch_growth_{mode}{suffix}"] = round(growth, 3)
        metrics[f"hydration_records_per_s{suffix}"] = round(big.records / best[f"hydrate lazy {store} 16S"])
        metrics[f"eager_records_per_s{suffix}"] = round(big.records / best[f"restore eager {store} 16S"])
    metrics["lazy_records_16S"] = big.records
    plot = out_dir / "recovery_first_batch.png"
    metrics["_plot"] = str(plot) if _plot(results, best, plot) else None
    metrics["_times"] = {f"{s.label} {k}": v for s in results for k, v in s.times.items()}
    return metrics


def table(m: dict[str, Any]) -> list[tuple[str, str]]:
    """The lazy mode's rows of the printed table."""
    rows = [
        (
            "lazy mode: state sizes",
            f"{m['state_keys_S']:,} / {m['state_keys_4S']:,} / {m['state_keys_16S']:,} keys, "
            f"{m['lazy_log_changes']:,} changes logged; a batch of {m['lazy_batch_keys']:,} updates",
        )
    ]
    for store in STORES:
        suffix = "_s3" if store == "s3" else ""
        for mode in MODES:
            times = " / ".join(f"{m[_name('first_batch_s', label, mode, store)]:.3f}" for label in LABELS)
            restores = " / ".join(f"{m[_name('restore_s', label, mode, store)]:.3f}" for label in LABELS)
            rows.append(
                (
                    f"first batch s, {mode}, {store} (S/4S/16S)",
                    f"{times}  (restore {restores}); growth {m[f'first_batch_growth_{mode}{suffix}']:.3f}"
                    + ("  (goal <= 1.3)" if mode == "lazy" else ""),
                )
            )
        rows.append(
            (
                f"hydration records/s, {store} (16S)",
                f"{m[f'hydration_records_per_s{suffix}']:,}  (goal >= the eager restore's "
                f"{m[f'eager_records_per_s{suffix}']:,})",
            )
        )
    return rows


def _plot(results: list[_Size], best: dict[str, float], path: Path) -> bool:
    """First-batch time against state size; False when matplotlib (the ``bench`` extra) is missing."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = [s.keys for s in results]
    for store in STORES:
        for mode in MODES:
            ys = [best[f"first_batch {mode} {store} {s.label}"] for s in results]
            style = "-" if mode == "lazy" else "--"
            ax.plot(keys, ys, marker="o", linestyle=style, label=f"{mode} restore, {store}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(keys, [f"{s.label}\n{s.keys / 1e6:g}M keys" for s in results])
    ax.minorticks_off()
    ax.set_xlabel("state size")
    ax.set_ylabel("first batch after a crash (s)")
    ax.set_title(
        f"Restore + {BATCH_KEYS:,} updates + checkpoint, against state size\n"
        f"(S3: moto + FLIP-158 latencies x {S3_SCALE})"
    )
    ax.legend()
    ax.grid(True, which="both", linewidth=0.3)
    save_figure(fig, path)
    return True
