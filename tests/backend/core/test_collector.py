"""``collector_paused``: the cyclic garbage collector is off for the step and back as it was after,
whether the step ends or raises."""

from __future__ import annotations

import gc

import pytest

from backend.core.collector import collector_paused


def test_the_collector_is_paused_for_the_step_and_back_on_after_it_even_if_it_raises() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        assert not gc.isenabled()
        raise KeyError("the step failed")
    assert gc.isenabled()


def test_a_collector_the_caller_paused_stays_paused() -> None:
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
