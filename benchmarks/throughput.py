"""``throughput``: MB/s of 50-byte changes made durable on ``file://`` with zstd.

One operator thread appends realistic-looking changes (op code, state id, 8-byte key, a value with
some entropy) to 4 writers and checkpoints every 8 MB (``persist_durably`` of everything since the
last checkpoint); the clock stops when the last checkpoint's future is complete, i.e. when every
byte is compressed, written and fsynced. MB are uncompressed change bytes (10**6 bytes).
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path

from benchmarks.common import BenchResult, progress
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage

RECORD = 50
WRITERS = 4


def make_records(count: int, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        key = rng.randrange(1 << 20).to_bytes(8, "big")
        value = os.urandom(12) + (b"%08d" % rng.randrange(10**8)) + b"\x00" * 19
        records.append(b"\x01\x00\x03" + key + value[: RECORD - 11])
    return records


def run(quick: bool, out_dir: Path) -> BenchResult:
    total_mb = 100 if quick else 400
    records = make_records(1 << 16)
    n = total_mb * 10**6 // RECORD
    ckpt_every = 8 * 10**6 // RECORD
    with tempfile.TemporaryDirectory() as tmp, StateChangelogStorage(ChangelogConfig.local(tmp)) as storage:
        writers = [storage.create_writer(f"op{i}", KeyGroupRange(i * 32, i * 32 + 31)) for i in range(WRITERS)]
        appends = [w.append for w in writers]
        afters = [0] * WRITERS
        futures = []
        start = time.perf_counter()
        i = 0
        mask = len(records) - 1
        while i < n:
            chunk_end = min(n, i + ckpt_every)
            for j in range(i, chunk_end):
                appends[j & 3]((j & 3) * 32 + (j >> 2) % 32, records[j & mask])
            i = chunk_end
            for w_index, w in enumerate(writers):
                futures.append(w.persist_durably(afters[w_index]))
                afters[w_index] = w.last_appended_sqn()
            progress(f"throughput: {i * RECORD / 1e6:.0f} of {total_mb} MB appended")
        handles = [f.result(600) for f in futures]
        seconds = time.perf_counter() - start
        stored = sum(h.size for h in handles[-WRITERS:])  # noqa: F841 - kept for the reader
        file_bytes = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    mb = n * RECORD / 1e6
    mb_per_s = mb / seconds
    ratio = n * RECORD / max(1, file_bytes)
    return BenchResult(
        name="throughput",
        metrics={"mb_per_s": round(mb_per_s, 1), "compression_ratio": round(ratio, 2), "seconds": round(seconds, 2)},
        table=[
            ("changes", f"{n:,} x {RECORD} B = {mb:.0f} MB"),
            ("durable throughput", f"{mb_per_s:.1f} MB/s"),
            ("zstd ratio (on disk)", f"{ratio:.2f}"),
            ("files", str(storage.metrics.upload_requests)),
        ],
    )
