"""Child process of the lazy adoption crash test: killed (SIGKILL) while its lazy restore is partly loaded.

``python -m tests.support.lazy_adopt_child DFS LOCAL HANDLE OUT READY`` (cwd: the project root):

1. restores the handle JSON in ``HANDLE`` lazily (the DFS in ``DFS``, its local tables in ``LOCAL``),
   changes the keys of ``tests.support.materializer_crash_child.batch_c()[:20]`` (loading them) and
   hydrates a few key groups;
2. snapshots (checkpoint 2) and flushes, as a Spark task does before it writes its marker, and
   writes the handle JSON to ``OUT`` (atomically);
3. goes on as the next batch would before it changes anything: reads keys (each loaded, with the
   pending changes of the log) and hydrates more key groups, none of which changes the state the
   handle names; then writes ``READY`` and blocks with the backend open, never closed: the parent
   kills it there and adopts its tables.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from backend.core.handles import KeyedStateHandle
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage
from materializer.periodic import restore
from tests.support.materializer_crash_child import (
    MAX_P,
    OPERATOR,
    VALUE,
    WAIT_S,
    apply_to_backend,
    batch_c,
    write_atomically,
)

#: the keys step 3 reads
READ_KEYS = range(1, 230, 4)


def main(argv: list[str]) -> None:
    dfs, local, handle_path, out, ready = (Path(a) for a in argv)
    storage = StateChangelogStorage(ChangelogConfig.local(dfs, persist_delay_ms=0))
    backend = ChangelogKeyedStateBackend(
        OPERATOR, KeyGroupRange(0, MAX_P - 1), local, storage=storage, max_parallelism=MAX_P
    )
    restore(backend, [KeyedStateHandle.loads(handle_path.read_text())], mode="lazy")
    apply_to_backend(backend, batch_c()[:20])
    backend.hydrate_step(5)
    handle = backend.snapshot(2).result(timeout=WAIT_S)
    backend.flush()
    write_atomically(out, handle.dumps())
    value = backend.get_state(VALUE)
    for key in READ_KEYS:
        backend.set_current_key(key)
        value.value()
        if key % 20 == 1:
            backend.hydrate_step(3)
    if backend.fully_local:
        raise SystemExit("the child's backend became fully local: nothing left to adopt partly loaded")
    write_atomically(ready, "ready")
    threading.Event().wait()  # never set: the parent kills us here


if __name__ == "__main__":
    main(sys.argv[1:])
