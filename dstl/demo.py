"""A demo of the log alone, with no state backend and no Spark (``dstl-demo``).

The demo of the whole project is the Spark one, ``backend.spark.demo`` (README command 1).

Four "subtasks" of a keyed operator each own a quarter of 128 key groups and log per-user running
totals as changes. Every few hundred events a checkpoint makes their logs durable (one file per
checkpoint for all four writers, thanks to batching). Then the process "crashes" (the storage is
abandoned, not closed), and a new process restores the state at parallelism 2 (rescaled) by
replaying the handles of the last completed checkpoint, keeping only the key groups each new
subtask owns. The restored totals are checked against a plain recomputation of the input.

    python -m dstl.demo [--dir DIR] [--events N] [--checkpoint-every N]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import struct
import tempfile
import time
import zlib
from pathlib import Path

from dstl import ChangelogConfig, ChangelogHandle, KeyGroupRange, StateChangelogStorage

MAX_PARALLELISM = 128
RECORD = struct.Struct(">I q")  # user id, running total


def key_group(user: int) -> int:
    return zlib.crc32(user.to_bytes(4, "big")) % MAX_PARALLELISM


def subtask_range(index: int, parallelism: int) -> KeyGroupRange:
    return KeyGroupRange(index * MAX_PARALLELISM // parallelism, (index + 1) * MAX_PARALLELISM // parallelism - 1)


def run(directory: Path, events: int, checkpoint_every: int, seed: int = 1) -> bool:
    rng = random.Random(seed)
    stream = [(rng.randrange(1000), rng.randrange(1, 100)) for _ in range(events)]
    print(f"DFS (embedded default, a local directory): {directory}")
    print(f"input: {events} events of 1000 users; 4 subtasks; checkpoint every {checkpoint_every} events\n")

    storage = StateChangelogStorage(ChangelogConfig.local(directory))
    writers = [storage.create_writer("running-total", subtask_range(i, 4)) for i in range(4)]
    totals: dict[int, int] = {}
    completed: list[dict[str, object]] = []
    print(f"{'ckpt':>4} {'events':>7} {'logged changes':>14} {'new files':>9} {'latency ms':>10}")
    for n, (user, amount) in enumerate(stream, start=1):
        totals[user] = totals.get(user, 0) + amount
        kg = key_group(user)
        writers[kg * 4 // MAX_PARALLELISM].append(kg, RECORD.pack(user, totals[user]))
        if n % checkpoint_every == 0:
            files_before = storage.metrics.upload_requests
            start = time.perf_counter()
            # No materializer yet: a checkpoint is the log since the start. Changesets uploaded by
            # earlier checkpoints are reused, so each checkpoint uploads only its new changes.
            futures = [w.persist_durably(0) for w in writers]
            handles = [f.result(30) for f in futures]
            latency = (time.perf_counter() - start) * 1000
            for w, h in zip(writers, handles, strict=True):
                w.confirm(h)
            completed.append(
                {
                    "checkpoint": len(completed) + 1,
                    "events": n,
                    "totals": dict(totals),
                    "handles": [h.to_json() for h in handles],
                }
            )
            changes = sum(s.records for h in handles for s in h.segments)
            new_files = storage.metrics.upload_requests - files_before
            print(f"{len(completed):>4} {n:>7} {changes:>14} {new_files:>9} {latency:>10.1f}")
    (directory / "_last_checkpoint.json").write_text(
        json.dumps({k: v for k, v in completed[-1].items() if k != "totals"})
    )
    print(f"\ncrash after {events} events (storage abandoned, nothing flushed or closed)")
    print(
        f"metrics: uploads={storage.metrics.upload_requests} flushes={storage.metrics.flushes} "
        f"hedges={storage.metrics.hedges} failures={storage.metrics.upload_failures}"
    )

    # -- a new process: restore at parallelism 2 from the last completed checkpoint's handles --
    last = json.loads((directory / "_last_checkpoint.json").read_text())
    handles = [ChangelogHandle.from_json(h) for h in last["handles"]]
    restored: dict[int, int] = {}
    with StateChangelogStorage(ChangelogConfig.local(directory)) as recovery:
        for index in range(2):
            owned = subtask_range(index, 2)
            count = 0
            for handle in handles:
                for _, data in recovery.read(handle, owned):
                    user, total = RECORD.unpack(data)
                    restored[user] = total
                    count += 1
            print(f"restored subtask {index + 1}/2 (key groups {owned.start}-{owned.end}): replayed {count} changes")
    expected: dict[int, int] = completed[-1]["totals"]  # type: ignore[assignment]
    ok = restored == expected
    print(
        f"\nrestored {len(restored)} users at checkpoint {last['checkpoint']} (after {last['events']} events); "
        f"recomputed from the input: {len(expected)} users"
    )
    print("PASS: restored state equals the recomputation" if ok else "FAIL: restored state differs")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dstl.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="DFS directory (default: a fresh temporary directory)")
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--checkpoint-every", type=int, default=2_000)
    args = parser.parse_args(argv)
    if args.events < args.checkpoint_every or args.checkpoint_every <= 0:
        parser.error("--events must be at least --checkpoint-every, which must be positive")
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        return 0 if run(args.dir, args.events, args.checkpoint_every) else 1
    tmp = Path(tempfile.mkdtemp(prefix="dstl-demo-"))
    try:
        return 0 if run(tmp, args.events, args.checkpoint_every) else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
