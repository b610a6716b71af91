"""Property: whatever writers append, persist, truncate, confirm and release, a handle reads back
exactly the model's changes with ``after < sqn <= upto``, in append order, restricted to the
requested key groups; and once the storage is closed, exactly the files of the handles still held
remain: the confirmed ones, and those handed over by a close (their checkpoint may have completed).

The model does not predict SQNs (the storage's loop thread may cut a pre-emptive changeset at any
time); it records, for every SQN the API returned, how many changes had been appended when it was
returned. That is all a caller can rely on: ``last_appended_sqn`` is stable while nothing is
appended and grows otherwise, and a handle covers the changes between two returned SQNs.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dstl import (
    ChangelogConfig,
    ChangelogHandle,
    ChangelogWriter,
    KeyGroupRange,
    StateChangelogStorage,
    WriterClosedError,
)

WAIT = 30.0
MAX_KG = 127

OPS = [
    "append",
    "append",
    "append",
    "append_many",
    "sqn",
    "persist",
    "persist",
    "persist_many",
    "truncate",
    "read",
    "release",
    "confirm",
    "close_writer",
]


@dataclass
class WriterModel:
    writer: ChangelogWriter
    key_groups: KeyGroupRange
    records: list[tuple[int, bytes]] = field(default_factory=list)
    #: every SQN the API returned -> how many records had been appended when it was returned
    cuts: dict[int, int] = field(default_factory=lambda: {0: 0})
    last_seen: int = 0
    truncated_before: int = 1
    closed: bool = False

    def observe(self, sqn: int) -> None:
        if sqn == self.last_seen:
            assert len(self.records) == self.cuts[sqn], f"sqn {sqn} did not roll over new changes"
        else:
            assert sqn > self.last_seen, f"sqn went back from {self.last_seen} to {sqn}"
            assert len(self.records) > self.cuts[self.last_seen], f"sqn {sqn} rolled over nothing"
        self.cuts[sqn] = len(self.records)
        self.last_seen = sqn

    def may_persist(self, after: int) -> bool:
        return after + 1 >= self.truncated_before


@dataclass
class Held:
    handle: ChangelogHandle
    expected: list[tuple[int, bytes]]
    model: WriterModel
    confirmed: bool = False


def key_group_ranges() -> st.SearchStrategy[KeyGroupRange]:
    return st.tuples(st.integers(0, MAX_KG), st.integers(0, MAX_KG)).map(lambda t: KeyGroupRange(min(t), max(t)))


payloads = st.one_of(st.just(b""), st.binary(max_size=24))


class Run:
    def __init__(self, data: st.DataObject, storage: StateChangelogStorage, root: Path) -> None:
        self.data = data
        self.storage = storage
        self.root = root
        ranges = data.draw(st.lists(key_group_ranges(), min_size=2, max_size=5), label="writer key groups")
        self.models = [WriterModel(storage.create_writer(f"op{i}", rng), rng) for i, rng in enumerate(ranges)]
        self.held: list[Held] = []

    def draw(self, strategy: st.SearchStrategy, label: str):  # type: ignore[no-untyped-def,type-arg]
        return self.data.draw(strategy, label=label)

    def open_model(self) -> WriterModel | None:
        live = [m for m in self.models if not m.closed]
        return self.draw(st.sampled_from(live), "writer") if live else None

    # -- operations -------------------------------------------------------------------------

    def append(self, m: WriterModel, count: int) -> None:
        rng = m.key_groups
        if count == 1:
            records = [(self.draw(st.integers(rng.start, rng.end), "key group"), self.draw(payloads, "payload"))]
        else:  # enough bytes to pass the pre-emptive threshold: the loop thread may cut any time
            seed = self.draw(st.integers(0, 2**16), "seed")
            records = [(rng.start + (seed + i) % len(rng), f"{seed}:{i}".encode().ljust(10)) for i in range(count)]
        for kg, payload in records:
            m.writer.append(kg, payload)
        m.records.extend(records)

    def sqn(self, m: WriterModel) -> None:
        m.observe(m.writer.last_appended_sqn())

    def choose_after(self, m: WriterModel) -> int:
        return int(self.draw(st.sampled_from(sorted(m.cuts)), "after"))

    def persist(self, models: list[WriterModel]) -> None:
        requests = []
        for m in models:
            after = self.choose_after(m)
            if not m.may_persist(after):
                with pytest.raises(ValueError, match="truncated"):
                    m.writer.persist_durably(after)
                continue
            requests.append((m, after, m.writer.persist_durably(after)))
        for m, after, future in requests:
            handle = future.result(WAIT)
            assert (handle.log_id, handle.after) == (m.writer.log_id, after)
            m.observe(handle.upto)
            held = Held(handle, m.records[m.cuts[after] : m.cuts[handle.upto]], m)
            self.held.append(held)
            self.check_read(held)

    def truncate(self, m: WriterModel) -> None:
        seen = sorted(m.cuts)
        before = int(self.draw(st.sampled_from([*seen, *(s + 1 for s in seen)]), "before"))
        m.writer.truncate(before)
        m.truncated_before = max(m.truncated_before, before)

    def check_read(self, held: Held) -> None:
        if self.draw(st.booleans(), "whole range"):
            assert list(self.storage.read(held.handle)) == held.expected
        rng = self.draw(key_group_ranges(), "read key groups")
        got = list(self.storage.read(held.handle, rng))
        assert got == [(kg, p) for kg, p in held.expected if kg in rng]

    def close_writer(self, m: WriterModel) -> None:
        m.writer.close()
        m.closed = True
        with pytest.raises(WriterClosedError):
            m.writer.last_appended_sqn()
        # a closed writer's handles neither confirmed nor released are handed over: kept as confirmed
        for held in self.held:
            held.confirmed = held.confirmed or held.model is m

    def step(self) -> None:
        op = self.draw(st.sampled_from(OPS), "op")
        if op in ("read", "release", "confirm"):
            if not self.held:
                return
            held = self.draw(st.sampled_from(self.held), "handle")
            if op == "read":
                self.check_read(held)
            elif op == "release" and not held.confirmed:
                held.model.writer.release(held.handle)
                self.held.remove(held)
            elif op == "confirm" and not held.model.closed:
                held.model.writer.confirm(held.handle)
                held.confirmed = True
            return
        if op == "persist_many":
            live = [m for m in self.models if not m.closed]
            chosen = self.draw(st.lists(st.sampled_from(live), min_size=1, unique_by=id), "writers") if live else []
            self.persist(chosen)
            return
        m = self.open_model()
        if m is None:
            return
        if op == "append":
            self.append(m, 1)
        elif op == "append_many":
            self.append(m, self.draw(st.integers(30, 80), "count"))
        elif op == "sqn":
            self.sqn(m)
        elif op == "persist":
            self.persist([m])
        elif op == "truncate":
            self.truncate(m)
        elif op == "close_writer" and self.draw(st.integers(0, 3), "really close") == 0:
            self.close_writer(m)

    def finish(self) -> None:
        for held in self.held:
            assert list(self.storage.read(held.handle)) == held.expected
        # Truncate everything: then only held or confirmed handles keep files on the DFS.
        for m in self.models:
            if not m.closed:
                m.observe(m.writer.last_appended_sqn())
                m.writer.truncate(m.last_seen + 1)
        self.storage.flush(WAIT)
        listed = set(self.storage.run(self.storage.list_files(), WAIT))
        assert listed == set().union(*(h.handle.files for h in self.held)), "a file leaked or was deleted early"
        for held in self.held:
            assert list(self.storage.read(held.handle)) == held.expected
        self.storage.close()
        dfs = self.root / "dfs"
        on_disk = {p.relative_to(dfs).as_posix() for p in dfs.rglob("*") if p.is_file()} if dfs.exists() else set()
        assert on_disk == listed, "close must keep the files of every handle held (confirmed or handed over)"
        assert self.storage.tracked_files() == {}


@given(st.data())
def test_handles_read_back_exactly_the_model(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory(prefix="dstl-prop-") as tmp:
        root = Path(tmp)
        config = ChangelogConfig.local(
            root / "dfs",
            persist_delay_ms=1,
            preemptive_persist_threshold=300,
            upload_timeout_ms=round(WAIT * 1000),
        )
        storage = StateChangelogStorage(config)
        try:
            run = Run(data, storage, root)
            for _ in range(data.draw(st.integers(1, 30), label="operations")):
                run.step()
            run.finish()
        finally:
            storage.close()
