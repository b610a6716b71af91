"""``append``: the cost of ``writer.append`` against the bare minimum, a bytearray ``+=``.

Both loops have the same shape (iterate over precomputed key groups, append one 32-byte change)
and run interleaved, several rounds each; the best round of each is compared, the usual way to
take the machine's noise out of a micro-benchmark. A round appends 100k changes (3.2 MB, below the
pre-emptive persist threshold) and its changeset is then discarded, so no upload runs while
appends are timed; the pre-emptive size check itself is part of every timed append.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import BenchResult, progress
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage

ROUND = 100_000


def run(quick: bool, out_dir: Path) -> BenchResult:
    rounds = 7 if quick else 25
    data = b"k" * 16 + b"v" * 16  # a 32-byte change
    key_groups = [i % 128 for i in range(ROUND)]
    appends: list[float] = []
    bares: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, StateChangelogStorage(ChangelogConfig.local(tmp)) as storage:
        writer = storage.create_writer("bench", KeyGroupRange(0, 127))
        append = writer.append
        for r in range(rounds):
            buf = bytearray()
            start = time.perf_counter_ns()
            for _kg in key_groups:
                buf += data
            bares.append((time.perf_counter_ns() - start) / ROUND)
            start = time.perf_counter_ns()
            for kg in key_groups:
                append(kg, data)
            appends.append((time.perf_counter_ns() - start) / ROUND)
            writer.truncate(writer.last_appended_sqn() + 1)
            if r % 5 == 0:
                progress(f"append round {r + 1}/{rounds}")
    append_ns, bare_ns = min(appends), min(bares)
    ratio = append_ns / bare_ns
    return BenchResult(
        name="append",
        metrics={"append_ns": round(append_ns, 1), "bare_ns": round(bare_ns, 1), "ratio": round(ratio, 2)},
        table=[
            ("writer.append (ns/change)", f"{append_ns:.1f}"),
            ("bytearray += (ns/change)", f"{bare_ns:.1f}"),
            ("ratio", f"{ratio:.2f}"),
            ("rounds x changes", f"{rounds} x {ROUND}"),
        ],
        details={"append_ns_rounds": appends, "bare_ns_rounds": bares},
    )
