"""``batching``: K writers of one storage persisting together write one file per flush.

Each round every writer appends a few hundred changes and then all call ``persist_durably`` (as
the subtasks of one TaskManager do at a checkpoint); we count the files the round wrote. The
flush rule "every registered writer is waiting" closes the batch as soon as the last writer
asks, so the count should be 1 for every K, and the persist latency not wait for the 10 ms timer.
The 64 requests of K = 64 take longer than that timer in all: the batch waits for writers still
arriving (``dstl.scheduler``), so they too share one file. ``max_files_per_round`` is the most
files one round wrote at each K: 1 when no round split.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import BenchResult, progress
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage

KS = (1, 4, 16, 64)


def run(quick: bool, out_dir: Path) -> BenchResult:
    rounds = 5 if quick else 20
    files_per_flush: list[float] = []
    max_files: list[int] = []
    latencies: list[float] = []
    table = []
    for k in KS:
        with tempfile.TemporaryDirectory() as tmp, StateChangelogStorage(ChangelogConfig.local(tmp)) as storage:
            max_p = 128 * 64
            writers = [
                storage.create_writer(f"op{i}", KeyGroupRange(i * max_p // k, (i + 1) * max_p // k - 1))
                for i in range(k)
            ]
            files = 0
            most = 0
            lat = []
            for _ in range(rounds):
                before = storage.metrics.upload_requests
                afters = []
                for w in writers:
                    afters.append(w.last_appended_sqn())
                    for j in range(200):
                        w.append(w.key_group_range.start + j % len(w.key_group_range), b"change-%06d" % j)
                start = time.perf_counter()
                futures = [w.persist_durably(a) for w, a in zip(writers, afters, strict=True)]
                for f in futures:
                    f.result(60)
                lat.append((time.perf_counter() - start) * 1000)
                files += storage.metrics.upload_requests - before
                most = max(most, storage.metrics.upload_requests - before)
        files_per_flush.append(files / rounds)
        max_files.append(most)
        latencies.append(statistics.median(lat))
        p50 = statistics.median(lat)
        summary = f"{files / rounds:.2f}  (most in a round {most}; persist p50 {p50:.1f} ms)"
        table.append((f"K={k:<3} files per flush", summary))
        progress(f"batching K={k}: {files / rounds:.2f} files per flush")
    return BenchResult(
        name="batching",
        metrics={
            "ks": list(KS),
            "files_per_flush": files_per_flush,
            "max_files_per_round": max_files,
            "persist_p50_ms": latencies,
        },
        table=table,
    )
