"""``state``: ValueState read-modify-write throughput (log on vs off) and checkpoint latency vs size.

1. Throughput: a backend holding N int keys (1M; quick 200k) runs random read-modify-write
   updates (``value()`` + ``update(v + 1)``), checkpointing every 100k updates (the snapshot's
   upload completes while processing goes on, as in Flink; the round's clock stops when every
   checkpoint of the round is durable). The same run is made with the log disabled (same backend
   class, no writer): their ratio is what the log costs. Each round runs both modes on the same
   keys, back to back, in alternating order; ``on_off_ratio`` is the median of the rounds' paired
   ratios (a noisy neighbour slows both halves of a round alike, and an outlier round does not
   decide), the rates are each mode's best round. A round's rate also depends on how many cache
   spills to LMDB fall into it (one every few checkpoints), so the mean over all rounds
   (``updates_per_s_on_mean``) is printed too: it is the long-run figure. Each round also times
   the same keys on a plain dict of N ints (``d[k] = d[k] + 1``): the speed of this shared
   machine at that moment (it drifts between hours), so runs on different days can
   be compared through ``on_vs_bare_dict``.
   *Batch mode* runs the same updates in micro-batches of 10,000 keys through the batch API
   (``with backend.batch(keys):``, the keys' state read ahead in key order), as a Spark
   micro-batch partition runs: ``batch_on_vs_bare_dict`` and ``batch_on_off_ratio`` are its figures,
   measured in the same rounds. Its floor, the same work with nothing of ours (``batch_floor``), in
   the same rounds: the N ints (8-byte big-endian keys, 8-byte values) in a plain LMDB table;
   per micro-batch of the same keys, their values read from LMDB in key order (``txn.get``) and
   unpacked into a dict, the batch's read-modify-writes on that dict, and every
   ``CHECKPOINT_EVERY`` updates the changed values packed and written back sorted
   (``putmulti``) in one transaction: no key groups, no log, no snapshot.
   ``batch_floor_vs_bare_dict`` is what a store of the values in LMDB allows at all;
   ``batch_on_vs_floor`` how close batch mode comes to it.
2. Checkpoint latency: 10k random keys changed per checkpoint, with 100k and with 1M keys in
   total (quick: 50k and 200k); p50 of the snapshot latency (flush to LMDB + log + durable upload
   on a local directory). ``flat_ratio`` = large / small: a checkpoint costs what changed.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import struct
import tempfile
import time
from pathlib import Path

import lmdb

from backend.core.descriptors import ValueStateDescriptor
from backend.core.serializers import Int64Serializer
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from benchmarks.common import BenchResult, progress
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage

ALL = KeyGroupRange(0, 127)
CHECKPOINT_EVERY = 100_000
#: keys per micro-batch in batch mode
BATCH_KEYS = 10_000
MODES = ("bare", "batch_floor", "off", "on", "batch_off", "batch_on")
_KEY, _VALUE = struct.Struct(">Q"), struct.Struct("<q")


def _backend(tmp: str, storage: StateChangelogStorage | None, log: bool) -> ChangelogKeyedStateBackend:
    return ChangelogKeyedStateBackend(
        "bench", ALL, Path(tmp) / ("on" if log else "off"), storage=storage, log_enabled=log
    )


def _populate(backend: ChangelogKeyedStateBackend, keys: int) -> None:
    state = backend.get_state(ValueStateDescriptor("count", Int64Serializer()))
    for k in range(keys):
        backend.set_current_key(k)
        state.update(0)
        if k % 200_000 == 199_999:
            backend.flush()
    backend.snapshot(0).result(120)
    backend.notify_checkpoint_complete(0)


def _updates(backend: ChangelogKeyedStateBackend, keys: list[int], checkpoint_base: int, batched: bool) -> float:
    """Updates per second of ``value()`` + ``update(v + 1)`` over ``keys``, a checkpoint every
    ``CHECKPOINT_EVERY``; ``batched``: in micro-batches of ``BATCH_KEYS`` through ``batch``."""
    state = backend.get_state(ValueStateDescriptor("count", Int64Serializer()))
    set_key = backend.set_current_key
    pending = []
    step = BATCH_KEYS if batched else CHECKPOINT_EVERY
    start = time.perf_counter()
    for first in range(0, len(keys), step):
        chunk = keys[first : first + step]
        with backend.batch(chunk) if batched else contextlib.nullcontext():
            for k in chunk:
                set_key(k)
                state.update(state.value() + 1)
        done = first + len(chunk)
        if done % CHECKPOINT_EVERY == 0:
            # As in Flink, processing goes on while the checkpoint's upload completes.
            cid = checkpoint_base + done // CHECKPOINT_EVERY
            pending.append((cid, backend.snapshot(cid)))
    for cid, fut in pending:
        fut.result(120)
        backend.notify_checkpoint_complete(cid)
    return len(keys) / (time.perf_counter() - start)


def _bare_dict(sample: list[int], total: int) -> float:
    """The machine's reference speed: the same read-modify-write on a plain dict of ``total``
    ints, best of three (one pass is a few tens of ms, short against the machine's noise)."""
    table = dict.fromkeys(range(total), 0)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for k in sample:
            table[k] = table[k] + 1
        best = max(best, len(sample) / (time.perf_counter() - start))
    return best


def _floor_table(tmp: str, total: int) -> lmdb.Environment:
    """The batch floor's LMDB table: ``total`` int keys, each holding 0."""
    env = lmdb.open(str(Path(tmp) / "floor"), map_size=1 << 32, sync=False, metasync=False)
    with env.begin(write=True) as txn:
        txn.cursor().putmulti(((_KEY.pack(k), _VALUE.pack(0)) for k in range(total)), append=True)
    return env


def _batch_floor(env: lmdb.Environment, keys: list[int]) -> float:
    """Updates per second of the batch floor (module doc) over ``keys`` (a multiple of
    ``CHECKPOINT_EVERY``, as the benchmark's: every change is written back)."""
    pack_key, pack, unpack = _KEY.pack, _VALUE.pack, _VALUE.unpack
    dirty: dict[bytes, int] = {}
    start = time.perf_counter()
    for first in range(0, len(keys), BATCH_KEYS):
        chunk = [pack_key(k) for k in keys[first : first + BATCH_KEYS]]
        wanted = sorted(set(chunk))
        with env.begin(buffers=False) as txn:
            values = {k: unpack(v)[0] for k, v in zip(wanted, map(txn.get, wanted), strict=True) if v is not None}
        values.update((k, dirty[k]) for k in dirty.keys() & values.keys())  # changed, not written back yet
        for k in chunk:
            values[k] = values[k] + 1
        dirty.update(values)
        if (first + len(chunk)) % CHECKPOINT_EVERY == 0:
            with env.begin(write=True) as txn:
                txn.cursor().putmulti([(k, pack(v)) for k, v in sorted(dirty.items())])
            dirty = {}
    return len(keys) / (time.perf_counter() - start)


def _checkpoint_p50(tmp: str, storage: StateChangelogStorage, total: int, changed: int, rounds: int) -> float:
    backend = ChangelogKeyedStateBackend(f"ckpt{total}", ALL, Path(tmp) / f"ckpt{total}", storage=storage)
    try:
        _populate(backend, total)
        state = backend.get_state(ValueStateDescriptor("count", Int64Serializer()))
        rng = random.Random(total)
        latencies = []
        for cid in range(1, rounds + 1):
            for k in rng.sample(range(total), changed):
                backend.set_current_key(k)
                state.update(cid)
            start = time.perf_counter()
            backend.snapshot(cid).result(120)
            latencies.append((time.perf_counter() - start) * 1000)
            backend.notify_checkpoint_complete(cid)
        return statistics.median(latencies)
    finally:
        backend.close()


def run(quick: bool, out_dir: Path) -> BenchResult:
    keys = 200_000 if quick else 1_000_000
    updates = 200_000 if quick else 500_000
    rounds = 4 if quick else 6  # even: each mode runs first in half the rounds
    small, large = (50_000, 200_000) if quick else (100_000, 1_000_000)
    with tempfile.TemporaryDirectory() as tmp, StateChangelogStorage(ChangelogConfig.local(Path(tmp) / "dfs")) as st:
        on, off = _backend(tmp, st, True), _backend(tmp, None, False)
        progress(f"state: loading {keys} keys twice")
        _populate(on, keys)
        _populate(off, keys)
        floor = _floor_table(tmp, keys)
        rng = random.Random(1)
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(rounds):
            sample = [rng.randrange(keys) for _ in range(updates)]
            for i, mode in enumerate(MODES if r % 2 == 0 else MODES[::-1]):
                if mode == "bare":
                    rates[mode].append(_bare_dict(sample, keys))
                elif mode == "batch_floor":
                    rates[mode].append(_batch_floor(floor, sample))
                else:
                    backend = on if mode.endswith("on") else off
                    rates[mode].append(_updates(backend, sample, (r * len(MODES) + i) * 100, mode.startswith("batch")))
            progress(f"state: round {r + 1}/{rounds}: on {rates['on'][-1]:,.0f}/s, off {rates['off'][-1]:,.0f}/s, "
                     f"batch on {rates['batch_on'][-1]:,.0f}/s, off {rates['batch_off'][-1]:,.0f}/s")  # fmt: skip
        on.close()
        off.close()
        floor.close()
        progress("state: checkpoint latency, small state")
        p50_small = _checkpoint_p50(tmp, st, small, 10_000, 10)
        progress("state: checkpoint latency, large state")
        p50_large = _checkpoint_p50(tmp, st, large, 10_000, 10)
    on_rate, off_rate, bare_rate = max(rates["on"]), max(rates["off"]), max(rates["bare"])

    def paired(a: str, b: str) -> float:  # the median of the rounds' ratios
        return statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))

    ratio = paired("on", "off")
    batch_ratio = paired("batch_on", "batch_off")
    metrics = {
        "keys": keys,
        "updates_per_s_on": round(on_rate),
        "updates_per_s_off": round(off_rate),
        "updates_per_s_on_mean": round(statistics.mean(rates["on"])),
        "updates_per_s_off_mean": round(statistics.mean(rates["off"])),
        "on_off_ratio": round(ratio, 3),
        "bare_dict_updates_per_s": round(bare_rate),
        "on_vs_bare_dict": round(paired("on", "bare"), 3),
        "updates_per_s_batch_on": round(max(rates["batch_on"])),
        "updates_per_s_batch_off": round(max(rates["batch_off"])),
        "batch_on_off_ratio": round(batch_ratio, 3),
        "batch_on_vs_bare_dict": round(paired("batch_on", "bare"), 3),
        "batch_floor_vs_bare_dict": round(paired("batch_floor", "bare"), 3),
        "batch_on_vs_floor": round(paired("batch_on", "batch_floor"), 3),
        "ckpt_p50_ms_small": round(p50_small, 2),
        "ckpt_p50_ms_large": round(p50_large, 2),
        "flat_ratio": round(p50_large / p50_small, 3),
        "total_keys_small": small,
        "total_keys_large": large,
    }
    return BenchResult(
        name="state",
        metrics=metrics,
        table=[
            ("keys", f"{keys:,}, {updates:,} updates per round, checkpoint every {CHECKPOINT_EVERY:,}"),
            ("updates/s, log on", f"{on_rate:,.0f}"),
            ("updates/s, log off", f"{off_rate:,.0f}"),
            ("updates/s, mean of rounds, on", f"{statistics.mean(rates['on']):,.0f}"),
            ("updates/s, mean of rounds, off", f"{statistics.mean(rates['off']):,.0f}"),
            ("on/off ratio (median of rounds)", f"{ratio:.3f}"),
            ("machine: plain dict updates/s", f"{bare_rate:,.0f} (log on / dict {metrics['on_vs_bare_dict']})"),
            (
                f"batch mode ({BATCH_KEYS:,} keys a batch): on / off",
                f"{max(rates['batch_on']):,.0f} / {max(rates['batch_off']):,.0f} updates/s, ratio {batch_ratio:.3f}",
            ),
            ("batch mode: log on / dict", f"{metrics['batch_on_vs_bare_dict']}"),
            (
                "batch floor: the same work, nothing of ours",
                f"{max(rates['batch_floor']):,.0f} updates/s; floor / dict {metrics['batch_floor_vs_bare_dict']}, "
                f"batch on / floor {metrics['batch_on_vs_floor']}",
            ),
            (f"checkpoint p50, {small:,} keys", f"{p50_small:.2f} ms (10k changed)"),
            (f"checkpoint p50, {large:,} keys", f"{p50_large:.2f} ms (10k changed)"),
            ("flat ratio (large/small)", f"{p50_large / p50_small:.3f}"),
        ],
        details={"rates": rates},
    )
