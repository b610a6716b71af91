"""``PeriodicMaterializer``: snapshots a backend's LMDB tables to the DFS and lets the log shrink.

Why: without it the log grows forever and recovery replays all of it. Flink's changelog backend
materializes every 10 minutes; we also trigger on log size, because a burst of changes should
not wait for the clock to bound recovery time and space.

How (FLIP-158's steps, with Flink's rules):
- Trigger: the operator calls ``poll()`` (cheap) at convenient points, e.g. after each checkpoint
  or batch. A materialization starts when ``interval_ms`` has passed (the first one jittered, so
  that subtasks do not all upload at once) or the log since the last one exceeds
  ``size_trigger_bytes``; at most one runs at a time; none starts if nothing changed.
- Consistency: the synchronous part runs on the operator's thread (``begin_materialization``):
  flush, take the log's SQN and an LMDB read transaction with no write in between.
- Upload: in a background thread, one chunk per key-group range (``chunk_key_groups`` key groups
  each), packed into files of at most ``pack_bytes`` (``materializer.packs``: a handle names a
  chunk by file, offset and size), and the last pack shared with the materializations started
  together with this one when the caller passes a ``SharedPack``. A chunk whose key groups did
  not change since the last materialization is re-referenced, not uploaded (incremental). Then
  the backend records (chunks, SQN), later snapshots reference the chunks plus the log after the
  SQN, and the log is truncated (see the backend).
- Failure: the partial chunks of a failed materialization are deleted, its key groups stay dirty
  for the next attempt, and more than ``max_failures_allowed`` consecutive failures raise
  ``MaterializationError`` from ``poll()`` (Flink fails the job the same way).
- Nobody waits for the upload: the caller only starts it (``poll``/``trigger``), and the next
  ``poll`` applies it once done. ``wait`` is for callers that must have it applied now (a full
  materialization before the first checkpoint, a clean shutdown).
- Handing over: once the chunks are durable, and before ``poll`` can apply them, the upload
  thread passes a ``MaterializationResult`` (chunks, and the log and SQN they cover) to
  ``on_result``. A backend of another process that continues the same state can take it
  (``ChangelogKeyedStateBackend.adopt_materialization``): under Spark the next batch of a subtask
  may run in another Python worker, which never sees this materializer (``backend.spark.handover``).
- Dropped: ``close(wait=False)`` lets a running materialization go on alone. If its backend is
  closed meanwhile, its next read of the tables raises and it fails cleanly (``backend.state.cut``);
  if it had read everything, it still finishes and hands its result over.

Storage: the materializer writes and deletes chunks through the backend's ``storage.files`` (a
``dstl.api.DfsFiles``) only. The one place this package names ``ChangelogStorage`` is ``restore``'s
``source``: a restore replays log files, and reading the log back is the storage's side
(``ChangelogStorage.read``), not the files'; ``restore`` only passes it on to the backend.

Times are milliseconds, as everywhere in this project: ``interval_ms``, a ``clock_ms`` returning
milliseconds, ``metrics.last_duration_ms``. ``metrics.registry`` holds the same figures as
Prometheus metrics (``materializer.metrics``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from backend.core.handles import CHUNK_HASH, KeyedStateHandle, chunk_digest
from backend.core.tablekeys import key_group_prefix
from backend.state.keyed_backend import ChangelogKeyedStateBackend, MaterializationPoint, RestoreMode
from dstl.api import ChangelogStorage
from dstl.errors import ConfigurationError
from dstl.types import KeyGroupRange
from materializer.binding import bulk_load_sections
from materializer.chunks import encode_chunk
from materializer.errors import MaterializationError
from materializer.metrics import MaterializationMetrics
from materializer.options import MaterializationOptions
from materializer.packs import PackBuilder, SharedPack
from materializer.point_reads import POINT_READS

_log = logging.getLogger(__name__)


def monotonic_ms() -> float:
    """The default clock: ``time.monotonic`` in milliseconds."""
    return time.monotonic_ns() / 1e6


@dataclass(frozen=True)
class MaterializationResult:
    """A finished materialization, for a backend that continues the same state elsewhere: its
    ``chunks`` (durable) hold the state of ``key_group_range`` after log ``log_id`` up to ``sqn``."""

    log_id: str
    sqn: int
    key_group_range: KeyGroupRange
    chunks: tuple[dict[str, Any], ...]


@dataclass
class _Outcome:
    chunks: list[dict[str, Any]]
    uploaded: int
    full: int
    written: int
    reused: int


class PeriodicMaterializer:
    def __init__(
        self,
        backend: ChangelogKeyedStateBackend,
        options: MaterializationOptions | None = None,
        *,
        clock_ms: Callable[[], float] = monotonic_ms,
        rng: random.Random | None = None,
        upload: Callable[[str, bytes], None] | None = None,
        registry: CollectorRegistry | None = None,
        on_result: Callable[[MaterializationResult], None] | None = None,
    ) -> None:
        """``options``: when and how it materializes (``materializer.options``, checked when made;
        default ``MaterializationOptions()``). ``clock_ms`` returns milliseconds, any origin (not
        ``time.monotonic``, which counts seconds); ``registry`` receives this materializer's
        Prometheus metrics (default: a registry of its own, ``metrics.registry``); ``on_result`` is
        called in the upload thread with each materialization whose chunks are durable, before
        ``poll`` may apply it (an error it raises is logged, the materialization still completes
        here)."""
        if backend.storage is None or backend.writer is None:
            raise ConfigurationError(f"backend {backend.operator_id}: materialization needs a changelog storage")
        self.backend = backend
        self.options = options = options or MaterializationOptions()
        self._clock_ms = clock_ms
        self._upload = upload or backend.storage.files.put
        self._delete = backend.storage.files.delete
        self._on_result = on_result
        jitter = (rng or random.Random()).uniform(0.5, 1.0)  # jittered first run
        self._due = clock_ms() + options.interval_ms * jitter
        self._running: concurrent.futures.Future[_Outcome] | None = None
        self._point: MaterializationPoint | None = None
        self._started_ns = 0
        self._failures = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="materializer")
        owned = backend.key_group_range
        labels = {"operator": backend.operator_id, "key_groups": f"{owned.start}-{owned.end}"}
        self.metrics = MaterializationMetrics(registry, labels)

    # -- the operator's side --------------------------------------------------------------

    def poll(self, pack: SharedPack | None = None) -> bool:
        """Finish a completed materialization, start one if due; True if one was started (then
        it is a member of ``pack``, if given: see ``trigger``)."""
        if self._running is not None:
            if not self._running.done():
                return False
            self._finish()
        if not self.backend.fully_local:  # after a lazy restore: due once the hydration ended
            return False
        log_bytes = self.backend.log_bytes_since_materialization
        size_due = self.options.size_trigger_bytes is not None and log_bytes >= self.options.size_trigger_bytes
        if self._clock_ms() < self._due and not size_due:
            return False
        return self.trigger(pack)

    def trigger(self, pack: SharedPack | None = None) -> bool:
        """Start a materialization now (unless one runs or nothing changed); after a lazy restore,
        everything is loaded first (``hydrate``), while ``poll`` waits for the hydration. With ``pack``, its
        last chunks go into that file, shared with the other materializations the caller starts
        before it seals the pack; only for backends that never delete chunks themselves."""
        if pack is not None and self.backend.storage is not None and self.backend.storage.owns_files:
            raise ConfigurationError("a shared chunk pack needs a storage that never deletes files (owns_files=False)")
        if self._running is not None:
            return False
        self._due = self._clock_ms() + self.options.interval_ms
        point = self.backend.begin_materialization(hydrate=True)
        if point is None:
            self.metrics.on_skipped()
            return False
        self.metrics.on_started()
        self._point = point
        self._started_ns = time.perf_counter_ns()
        if pack is not None:
            pack.join()
        try:
            self._running = self._pool.submit(self._materialize, point, pack)
        except BaseException:
            if pack is not None:
                pack.withdraw()
            raise
        return True

    @property
    def in_flight(self) -> concurrent.futures.Future[_Outcome] | None:
        """The running materialization (done or not) that ``poll`` has not applied yet, if any."""
        return self._running

    @property
    def logged_bytes(self) -> int:
        """The logged bytes since the last materialization this materializer applied: the
        backend's count, plus what the one not applied yet covers (another process may go on
        from these tables without its result, and must count them)."""
        return self.backend.log_bytes_since_materialization + (self._point.log_bytes if self._point else 0)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the running materialization (if any) and apply its outcome."""
        if self._running is not None:
            concurrent.futures.wait([self._running], timeout)
            if self._running.done():
                self._finish()

    def _finish(self) -> None:
        fut, point = self._running, self._point
        assert fut is not None and point is not None
        self._running = self._point = None
        try:
            outcome = fut.result()
        except Exception as exc:
            self.backend.abort_materialization(point)
            self.metrics.on_failed()
            self._failures += 1
            if self._failures > self.options.max_failures_allowed:
                raise MaterializationError(
                    f"materialization of operator {self.backend.operator_id} failed {self._failures} times "
                    f"in a row (allowed: {self.options.max_failures_allowed}); last error: {exc}"
                ) from exc
            return
        self._failures = 0
        self.backend.complete_materialization(point, outcome.chunks)
        duration_ms = (time.perf_counter_ns() - self._started_ns) / 1e6
        self.metrics.on_completed(duration_ms, outcome.full, outcome.uploaded, outcome.written, outcome.reused)

    def close(self, wait: bool = True) -> None:
        """Stop: apply the running materialization first (``wait``), or leave it to end in the
        background, never applied here (its result still goes to ``on_result``)."""
        if wait:
            self.wait()
        self._pool.shutdown(wait=wait)

    # -- the background side --------------------------------------------------------------

    def _ranges(self, owned: KeyGroupRange) -> Iterator[KeyGroupRange]:
        # Aligned to multiples of chunk_key_groups, so subtasks of any parallelism agree on chunks.
        step = self.options.chunk_key_groups
        start = owned.start
        while start <= owned.end:
            end = min(owned.end, (start // step + 1) * step - 1)
            yield KeyGroupRange(start, end)
            start = end + 1

    def _materialize(self, point: MaterializationPoint, shared: SharedPack | None = None) -> _Outcome:
        previous = {
            (tuple(c["key_groups"]), tuple(c["scope"])): c for c in point.previous if c["key_groups"] == c["scope"]
        }
        chunks: list[dict[str, Any]] = []
        pack = PackBuilder(self._upload, self.options.pack_bytes)
        uploaded = full = reused = written = 0
        try:
            try:
                for rng in self._ranges(point.key_group_range):
                    key = (tuple(rng.to_json()), tuple(rng.to_json()))
                    old = previous.get(key)
                    clean = not point.rewrite_all and not any(kg in point.dirty for kg in rng)
                    # an entry without its hash (carried from a version-1 handle) is rewritten: a
                    # handle mixing it with packed entries could not be written in any version
                    if old is not None and clean and CHUNK_HASH in old:
                        chunks.append(old)
                        full += old["size"]
                        reused += 1
                        continue
                    with point.reading() as txn:  # raises once the backend closed the tables
                        sections = read_sections(txn, point.databases, rng)
                    if not sections:
                        continue  # nothing stored in these key groups (any more): no chunk needed
                    data = encode_chunk(rng, point.sqn, sections, level=self.options.compression_level)
                    chunk = {
                        "key_groups": rng.to_json(),
                        "scope": rng.to_json(),
                        "sqn": int(point.sqn),
                        "size": len(data),
                        "entries": sum(len(v) for v in sections.values()),
                        CHUNK_HASH: chunk_digest(data),
                    }
                    pack.add(data, chunk)  # sets the offset (and the path once its pack is uploaded)
                    chunks.append(chunk)
                    written += 1
                    uploaded += len(data)
                    full += len(data)
            except BaseException:
                if shared is not None:
                    shared.withdraw()
                raise
            pack.finish(shared)
        except BaseException:
            for path in pack.written:  # a failed materialization leaves nothing behind (best effort)
                with contextlib.suppress(Exception):
                    self._delete(path)
            raise
        if self._on_result is not None:
            result = MaterializationResult(point.log_id, point.log_sqn, point.key_group_range, tuple(chunks))
            try:
                self._on_result(result)
            except Exception:
                _log.warning("handing over the materialization of %s failed", point.key_group_range, exc_info=True)
        return _Outcome(chunks, uploaded, full, written, reused)


def read_sections(txn: Any, databases: Mapping[str, Any], rng: KeyGroupRange) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every table entry of key groups ``rng`` as ``txn`` sees them, per table, in key order."""
    start = key_group_prefix(rng.start)
    end = key_group_prefix(rng.end + 1)  # a KeyGroupRange ends at MAX_KEY_GROUP, so end + 1 still fits
    sections: dict[str, list[tuple[bytes, bytes]]] = {}
    for name, db in databases.items():
        cursor = txn.cursor(db=db)
        entries: list[tuple[bytes, bytes]] = []
        if cursor.set_range(start):
            for key, value in cursor:
                if key >= end:
                    break
                entries.append((key, value))
        if entries:
            sections[name] = entries
    return sections


def restore(
    backend: ChangelogKeyedStateBackend,
    handles: Iterable[KeyedStateHandle],
    progress: Callable[[int], None] | None = None,
    source: ChangelogStorage | None = None,
    mode: RestoreMode = "eager",
) -> int:
    """``backend.restore`` that can read materialized chunks (the backend does not import us).
    ``source``: the storage holding the handles' files, if not the backend's (it reads their
    logs back, hence a ``ChangelogStorage`` and not a ``DfsFiles``). ``mode="lazy"``: keys are
    loaded when first needed (``backend.state.lazy``), the chunks read by ``point_reads``."""
    return backend.restore(
        handles, progress=progress, load_chunk=bulk_load_sections, source=source, mode=mode, chunks=POINT_READS
    )


def adopt_local(backend: ChangelogKeyedStateBackend, handle: KeyedStateHandle) -> None:
    """``backend.adopt_local`` that can continue a lazy restore another process left partly loaded
    (its chunks read by ``point_reads``)."""
    backend.adopt_local(handle, chunks=POINT_READS)
