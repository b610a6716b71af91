"""The append buffer both writers own: cuts lose nothing, bad changes fail it, each status raises
its error, the gate holds appends back and the waker wakes its driver."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from dstl import ChangelogError, ConfigurationError, KeyGroupRange, WriterClosedError
from dstl.append_buffer import LOOK_EVERY, UNMEASURABLE, AppendBuffer, Appender, BufferStatus
from tests.support.polling import wait_until

RANGE = KeyGroupRange(0, 15)
WAIT_S = 30.0


class Writer(Appender):
    """The least owner of a buffer: ``append`` and ``append_many`` (from ``Appender``) and the buffer."""

    def __init__(self, wait: Any = lambda: None, wake: Any = lambda: None) -> None:
        self.buffer = AppendBuffer(self, "log-1", RANGE, wait=wait, wake=wake)


def test_appends_racing_cuts_are_cut_exactly_once_and_in_order() -> None:
    w = Writer()
    changes = [(i % 16, i.to_bytes(4, "big")) for i in range(200_000)]
    done = threading.Event()

    def operator() -> None:
        for kg, data in changes:
            w.append(kg, data)
        done.set()

    thread = threading.Thread(target=operator)
    cuts = []
    thread.start()
    while not done.is_set():
        if (cut := w.buffer.cut()) is not None:
            cuts.append(cut)
    thread.join()
    if (cut := w.buffer.cut()) is not None:
        cuts.append(cut)
    got = [(kg, data) for c in cuts for kg, data in zip(c.key_groups, c.payloads, strict=True)]
    assert got == changes
    assert [c.size for c in cuts] == [sum(map(len, c.payloads)) for c in cuts]
    assert w.buffer.empty and w.buffer.cut() is None


def test_measure_counts_what_was_appended_since_it_last_looked_and_the_cut_reuses_it() -> None:
    w = Writer()
    w.append(1, b"abc")
    assert w.buffer.measure() == 3
    w.append_many([2, b"de", 3, b"f"])
    assert w.buffer.measure() == 6
    w.append(4, b"gh")
    cut = w.buffer.cut()
    assert cut is not None and cut.size == 8 and list(cut.key_groups) == [1, 2, 3, 4]
    assert w.buffer.measure() == 0


def test_a_key_group_whose_payload_has_not_followed_yet_waits_for_the_next_cut() -> None:
    """``append`` appends a change's key group, then its payload: a thread switch between the two
    leaves a lone key group, which neither a measure nor a cut may take apart from its payload.
    The test stands in for the appending thread stopped between its two appends."""
    w = Writer()
    w.append(1, b"whole")
    w._records.append(2)  # the key group of the next change; its payload is still coming
    assert w.buffer.measure() == 5
    cut = w.buffer.cut()
    assert cut is not None and list(cut.key_groups) == [1] and cut.payloads == [b"whole"]
    assert w.buffer.empty and w.buffer.cut() is None and w.buffer.measure() == 0
    w._records.append(b"late")  # the payload follows
    w.append(3, b"next")
    assert w.buffer.measure() == 8
    cut = w.buffer.cut()
    assert cut is not None and list(cut.key_groups) == [2, 3] and cut.payloads == [b"late", b"next"]


def test_a_cut_carries_what_its_check_computed_for_the_encoder() -> None:
    w = Writer()
    w.append(7, b"abc")
    assert w.buffer.measure() == 3  # the measured lengths are kept, the others taken at the cut
    w.append_many([3, b"", 12, b"defgh"])
    cut = w.buffer.cut()
    assert cut is not None
    assert list(cut.lengths) == [3, 0, 5] and cut.lengths.typecode == "I"
    assert (cut.size, cut.min_key_group, cut.max_key_group) == (8, 3, 12)


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
    w = Writer()
    w.append_many(pairs)
    assert w.buffer.cut() is None
    assert w.buffer.status is BufferStatus.FAILED
    for call in (lambda: w.buffer.check("last_appended_sqn"), lambda: w.append(0, b"later")):
        with pytest.raises(ConfigurationError) as exc_info:
            call()
        assert problem in str(exc_info.value)
    assert w.buffer.close() and w.buffer.status is BufferStatus.CLOSED


def test_a_change_without_a_length_measures_past_every_bound_and_fails_the_cut() -> None:
    w = Writer()
    w.append(1, b"fine")
    w.append(2, None)  # type: ignore[arg-type]
    assert w.buffer.measure() == UNMEASURABLE
    assert w.buffer.cut() is None
    with pytest.raises(ConfigurationError, match="changes must be bytes, got NoneType"):
        w.buffer.check("persist_durably")


def test_a_closed_buffer_drops_its_changes_and_refuses_appends() -> None:
    w = Writer()
    w.append(1, b"dropped")
    assert w.buffer.close()
    assert not w.buffer.close()  # once
    assert w.buffer.empty and w.buffer.cut() is None
    with pytest.raises(WriterClosedError, match="changelog writer log-1 is closed: cannot append"):
        w.append(1, b"late")


@pytest.mark.parametrize("status", [BufferStatus.FENCED, BufferStatus.LOST])
def test_a_fenced_or_lost_buffer_keeps_saying_why_it_died_once_closed(status: BufferStatus) -> None:
    w = Writer()
    w.append(1, b"never shipped")
    w.buffer.kill(status, lambda op: ChangelogError(f"{op}: {status.value}"))
    assert not w.buffer.close()  # nothing to close: it is dead already
    assert w.buffer.status is status and w.buffer.empty
    with pytest.raises(ChangelogError, match=f"^append: {status.value}$"):
        w.append(1, b"late")
    with pytest.raises(ChangelogError, match=f"^release: {status.value}$"):
        w.buffer.check("release")


def test_a_gated_append_waits_for_its_owner_then_lands() -> None:
    """The gate waits once per change, before its key group: its payload follows without a wait."""
    may_go = threading.Event()
    waits: list[int] = []

    def wait() -> None:
        waits.append(1)
        assert may_go.wait(WAIT_S)

    w = Writer(wait=wait)
    w.buffer.gate()
    assert w.buffer.gated
    thread = threading.Thread(target=w.append, args=(1, b"held back"))
    thread.start()
    wait_until(lambda: waits == [1], "the append to wait at the gate")
    assert w.buffer.empty
    w.buffer.ungate()
    may_go.set()
    thread.join(WAIT_S)
    assert waits == [1]
    cut = w.buffer.cut()
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
            w.append(1, b"x")
        except BaseException as exc:
            errors.append(exc)

    w = Writer(wait=wait)
    w.buffer.gate()
    thread = threading.Thread(target=operator)
    thread.start()
    assert waiting.wait(WAIT_S)
    w.buffer.close()
    may_go.set()
    thread.join(WAIT_S)
    assert len(errors) == 1 and isinstance(errors[0], WriterClosedError)
    assert w.buffer.empty


def test_a_parked_buffer_wakes_its_driver_until_it_is_unparked() -> None:
    wakes: list[int] = []
    w = Writer(wake=lambda: wakes.append(1))
    w.buffer.park()
    w.append(1, b"a")
    w.append(2, b"b")
    assert len(wakes) == 2
    w.buffer.unpark()
    w.append(3, b"c")
    assert len(wakes) == 2
    cut = w.buffer.cut()
    assert cut is not None and list(cut.key_groups) == [1, 2, 3]


def test_gating_parking_and_killing_leave_a_closed_buffer_closed() -> None:
    w = Writer()
    w.buffer.close()
    w.buffer.gate()
    w.buffer.park()
    w.buffer.kill(BufferStatus.LOST, lambda op: ChangelogError(op))
    assert not w.buffer.gated and w.buffer.status is BufferStatus.CLOSED
    with pytest.raises(WriterClosedError):
        w.append(1, b"x")


class LookingWriter(Appender):
    """A buffer's owner whose ``look`` records each estimate it is given, and raises when told."""

    def __init__(self) -> None:
        self.looks: list[int] = []
        self.refuse = False
        self.buffer = AppendBuffer(self, "log-1", RANGE, wait=lambda: None, look=self._look)

    def _look(self, estimate: int) -> None:
        self.looks.append(estimate)
        if self.refuse:
            raise WriterClosedError("refused by the test")


def test_the_appending_thread_looks_every_look_every_changes_with_the_bytes_since_the_cut() -> None:
    w = LookingWriter()
    for _ in range(LOOK_EVERY - 1):
        w.append(3, b"0123456789")
    assert w.looks == []
    w.append(3, b"0123456789")  # the LOOK_EVERY-th change: the look counts it, then it is appended
    assert w.looks == [10 * LOOK_EVERY]
    for _ in range(LOOK_EVERY):
        w.append(3, b"0123456789")
    assert w.looks == [10 * LOOK_EVERY, 20 * LOOK_EVERY]
    cut = w.buffer.cut()
    assert cut is not None and len(cut.payloads) == 2 * LOOK_EVERY and cut.size == 20 * LOOK_EVERY
    for _ in range(LOOK_EVERY):
        w.append(3, b"01234")
    assert w.looks[-1] == 5 * LOOK_EVERY  # the cut started the estimate again


def test_an_append_whose_look_raises_is_not_appended_and_the_next_append_looks_again() -> None:
    w = LookingWriter()
    for _ in range(LOOK_EVERY - 1):
        w.append(3, b"x")
    w.refuse = True
    with pytest.raises(WriterClosedError, match="refused by the test"):
        w.append(3, b"refused")
    with pytest.raises(WriterClosedError, match="refused by the test"):
        w.append(3, b"refused again")
    w.refuse = False
    w.append(3, b"y")
    assert len(w.looks) == 3
    cut = w.buffer.cut()
    assert cut is not None and cut.payloads == [b"x"] * (LOOK_EVERY - 1) + [b"y"]
