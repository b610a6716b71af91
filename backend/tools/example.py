"""The README's standalone example: keyed events in a loop, checkpoints, a crash, a restore.

python -m backend.tools.example
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from backend import ChangelogKeyedStateBackend, Int64Serializer, KeyedStateHandle, ValueStateDescriptor
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage


def main() -> bool:
    work = Path(tempfile.mkdtemp(prefix="backend-example-"))
    events = [(f"user-{random.Random(i).randrange(50)}", i % 7) for i in range(10_000)]
    totals = ValueStateDescriptor("total", Int64Serializer())

    # -- a subtask owning all 128 key groups processes events, checkpointing every 1000 --------
    storage = StateChangelogStorage(ChangelogConfig.local(work / "dfs"))
    backend = ChangelogKeyedStateBackend("sums", KeyGroupRange(0, 127), work / "local-1", storage=storage)
    total = backend.get_state(totals)
    last_checkpoint = None
    for n, (user, amount) in enumerate(events[:7_500], start=1):
        backend.set_current_key(user)
        total.update((total.value() or 0) + amount)
        if n % 1000 == 0:
            handle = backend.snapshot(checkpoint_id=n).result()
            backend.notify_checkpoint_complete(n)
            last_checkpoint = (n, handle.dumps())  # JSON; a coordinator would store this
    # -- crash: events 7001..7500 were processed but never checkpointed; nothing is closed ------

    # -- a new process restores the last checkpoint and replays the events after it ------------
    done, handle_json = last_checkpoint  # type: ignore[misc]
    storage = StateChangelogStorage(ChangelogConfig.local(work / "dfs"))
    backend = ChangelogKeyedStateBackend("sums", KeyGroupRange(0, 127), work / "local-2", storage=storage)
    backend.restore([KeyedStateHandle.loads(handle_json)])
    total = backend.get_state(totals)
    for user, amount in events[done:]:
        backend.set_current_key(user)
        total.update((total.value() or 0) + amount)

    expected: dict[str, int] = {}
    for user, amount in events:
        expected[user] = expected.get(user, 0) + amount
    ok = True
    for user, value in expected.items():
        backend.set_current_key(user)
        ok &= total.value() == value
    print(f"restored checkpoint {done}, replayed {len(events) - done} events:", "PASS" if ok else "FAIL")
    backend.close()
    storage.close()
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
