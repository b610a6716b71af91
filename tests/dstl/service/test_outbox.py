"""The remote writer's own look at its bound (``Outbox.look``), with the real ``Outbox`` and
``AppendBuffer`` and no sender: the appending thread gates its buffer only while it still holds
changes, since only a cut (which the sender makes of a non-empty buffer) ungates it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from dstl import KeyGroupRange
from dstl.append_buffer import AppendBuffer, Appender
from dstl.service.outbox import Outbox

WAIT_S = 60.0
BOUND = 1000


@dataclass(eq=False)
class Writer(Appender):
    """What the outbox needs of a writer: a number, a log id, a buffer and a count of waits."""

    outbox: Outbox
    number: int = 1
    log_id: str = "log-1"
    backpressure_waits: int = 0
    buffer: AppendBuffer = field(init=False)

    def __post_init__(self) -> None:
        self.buffer = AppendBuffer(
            self, self.log_id, KeyGroupRange(0, 15), wait=lambda: self.outbox.wait_drained(self),
            look=lambda estimate: self.outbox.look(self, estimate),
        )  # fmt: skip


def test_a_look_after_the_sender_emptied_the_buffer_does_not_gate_it() -> None:
    """The look's estimate says the bound is passed, but the sender cut the buffer in between:
    gating the empty buffer would hold the appending thread for good (the sender never cuts an
    empty buffer, so never ungates it)."""
    lock = threading.Lock()
    outbox = Outbox(lock, BOUND, wake=lambda: None)
    writer = Writer(outbox)
    outbox.writers[writer.number] = writer
    writer.append(1, b"x" * 10)
    with lock:
        outbox.cut_locked(writer)  # the sender's round: the buffer is empty now
    looked = threading.Thread(target=outbox.look, args=(writer, BOUND + 1), daemon=True)
    looked.start()
    looked.join(WAIT_S)
    assert not looked.is_alive(), "the look gated an empty buffer and waits for a cut that never comes"
    assert not writer.buffer.gated


def test_a_look_past_the_bound_waits_for_the_senders_cut() -> None:
    lock = threading.Lock()
    woken = threading.Event()
    outbox = Outbox(lock, BOUND, wake=woken.set)
    writer = Writer(outbox)
    outbox.writers[writer.number] = writer
    writer.append(1, b"x" * 10)
    looked = threading.Thread(target=outbox.look, args=(writer, BOUND + 1), daemon=True)
    looked.start()
    assert woken.wait(WAIT_S)  # the sender is woken to cut
    assert looked.is_alive() and writer.buffer.gated
    with lock:
        outbox.service_writers_locked()  # the sender's round cuts the buffer: the look returns
    looked.join(WAIT_S)
    assert not looked.is_alive() and not writer.buffer.gated and writer.backpressure_waits == 1
