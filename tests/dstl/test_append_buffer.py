"""The append buffer both writers own: cuts lose nothing, bad changes fail it, each status raises
its error, the gate holds appends back and the waker wakes its driver."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from dstl import ChangelogError, ConfigurationError, KeyGroupRange, WriterClosedError
from dstl.append_buffer import UNMEASURABLE, AppendBuffer, BufferStatus
from tests.polling import wait_until

RANGE = KeyGroupRange(0, 15)
WAIT_S = 30.0


def buffer(wait: Any = lambda: None, wake: Any = lambda: None) -> AppendBuffer:
    return AppendBuffer("log-1", RANGE, wait=wait, wake=wake)


def test_appends_racing_cuts_are_cut_exactly_once_and_in_order() -> None:
    buf = buffer()
    changes = [(i % 16, i.to_bytes(4, "big")) for i in range(200_000)]
    done = threading.Event()

    def operator() -> None:
        for kg, data in changes:
            buf.append(kg, data)
        done.set()

    thread = threading.Thread(target=operator)
    cuts = []
    thread.start()
    while not done.is_set():
        if (cut := buf.cut()) is not None:
            cuts.append(cut)
    thread.join()
    if (cut := buf.cut()) is not None:
        cuts.append(cut)
    got = [(kg, data) for c in cuts for kg, data in zip(c.key_groups, c.payloads, strict=True)]
    assert got == changes
    assert [c.size for c in cuts] == [sum(map(len, c.payloads)) for c in cuts]
    assert buf.empty and buf.cut() is None


def test_measure_counts_what_was_appended_since_it_last_looked_and_the_cut_reuses_it() -> None:
    buf = buffer()
    buf.append(1, b"abc")
    assert buf.measure() == 3
    buf.append_many([2, b"de", 3, b"f"])
    assert buf.measure() == 6
    buf.append(4, b"gh")
    cut = buf.cut()
    assert cut is not None and cut.size == 8 and list(cut.key_groups) == [1, 2, 3, 4]
    assert buf.measure() == 0


@pytest.mark.parametrize(
    ("pairs", "problem"),
    [
        ([3, b"ok", 16, b"not ours"], "changelog writer log-1 owns key groups [0, 15] but key group 16 was appended"),
        ([0, "text"], "changelog writer log-1: bad change appended: changes must be bytes, got str"),
        ([70_000, b"x"], "changelog writer log-1: bad change appended: key group 70000 is not an integer"),
        (["7", b"x"], "changelog writer log-1: bad change appended: key group '7'"),
    ],
)
def test_a_bad_change_fails_the_buffer_at_the_cut_and_every_later_append(pairs: list[Any], problem: str) -> None:
    buf = buffer()
    buf.append_many(pairs)
    assert buf.cut() is None
    assert buf.status is BufferStatus.FAILED
    for call in (lambda: buf.check("last_appended_sqn"), lambda: buf.append(0, b"later")):
        with pytest.raises(ConfigurationError) as exc_info:
            call()
        assert problem in str(exc_info.value)
    assert buf.close() and buf.status is BufferStatus.CLOSED


def test_a_change_without_a_length_measures_past_every_bound_and_fails_the_cut() -> None:
    buf = buffer()
    buf.append(1, b"fine")
    buf.append(2, None)  # type: ignore[arg-type]
    assert buf.measure() == UNMEASURABLE
    assert buf.cut() is None
    with pytest.raises(ConfigurationError, match="changes must be bytes, got NoneType"):
        buf.check("persist_durably")


def test_a_closed_buffer_drops_its_changes_and_refuses_appends() -> None:
    buf = buffer()
    buf.append(1, b"dropped")
    assert buf.close()
    assert not buf.close()  # once
    assert buf.empty and buf.cut() is None
    with pytest.raises(WriterClosedError, match="changelog writer log-1 is closed: cannot append"):
        buf.append(1, b"late")


@pytest.mark.parametrize("status", [BufferStatus.FENCED, BufferStatus.LOST])
def test_a_fenced_or_lost_buffer_keeps_saying_why_it_died_once_closed(status: BufferStatus) -> None:
    buf = buffer()
    buf.append(1, b"never shipped")
    buf.kill(status, lambda op: ChangelogError(f"{op}: {status.value}"))
    assert not buf.close()  # nothing to close: it is dead already
    assert buf.status is status and buf.empty
    with pytest.raises(ChangelogError, match=f"^append: {status.value}$"):
        buf.append(1, b"late")
    with pytest.raises(ChangelogError, match=f"^release: {status.value}$"):
        buf.check("release")


def test_a_gated_append_waits_for_its_owner_then_lands() -> None:
    may_go = threading.Event()
    waits: list[int] = []

    def wait() -> None:
        waits.append(1)
        assert may_go.wait(WAIT_S)

    buf = buffer(wait=wait)
    buf.gate()
    assert buf.gated
    thread = threading.Thread(target=buf.append, args=(1, b"held back"))
    thread.start()
    wait_until(lambda: waits == [1], "the append to wait at the gate")
    assert buf.empty
    buf.ungate()
    may_go.set()
    thread.join(WAIT_S)
    cut = buf.cut()
    assert cut is not None and cut.payloads == [b"held back"]


def test_a_gated_append_raises_when_its_buffer_closes_meanwhile() -> None:
    waiting = threading.Event()
    may_go = threading.Event()
    errors: list[BaseException] = []

    def wait() -> None:
        waiting.set()
        assert may_go.wait(WAIT_S)

    def operator() -> None:
        try:
            buf.append(1, b"x")
        except BaseException as exc:
            errors.append(exc)

    buf = buffer(wait=wait)
    buf.gate()
    thread = threading.Thread(target=operator)
    thread.start()
    assert waiting.wait(WAIT_S)
    buf.close()
    may_go.set()
    thread.join(WAIT_S)
    assert len(errors) == 1 and isinstance(errors[0], WriterClosedError)
    assert buf.empty


def test_a_parked_buffer_wakes_its_driver_until_it_is_unparked() -> None:
    wakes: list[int] = []
    buf = buffer(wake=lambda: wakes.append(1))
    buf.park()
    buf.append(1, b"a")
    buf.append(2, b"b")
    assert len(wakes) == 2
    buf.unpark()
    buf.append(3, b"c")
    assert len(wakes) == 2
    cut = buf.cut()
    assert cut is not None and list(cut.key_groups) == [1, 2, 3]


def test_gating_parking_and_killing_leave_a_closed_buffer_closed() -> None:
    buf = buffer()
    buf.close()
    buf.gate()
    buf.park()
    buf.kill(BufferStatus.LOST, lambda op: ChangelogError(op))
    assert not buf.gated and buf.status is BufferStatus.CLOSED
    with pytest.raises(WriterClosedError):
        buf.append(1, b"x")
