"""The memory ledger (tinypipe/ir/ledger.py): effects in order, peaks, samples, live buffers, unknown devices."""

from __future__ import annotations

import pytest

from tinypipe.common.errors import ScheduleError
from tinypipe.ir.ledger import Ledger
from tinypipe.ir.schedule import Action, Kind, Mem


def act(i: int, allocs: tuple[Mem, ...] = (), frees: tuple[Mem, ...] = ()) -> Action:
    return Action(i, Kind.FWD, "g0.compute", 0, allocs=allocs, frees=frees)


def test_allocs_at_start_frees_at_end_peak_and_samples() -> None:
    """Static bytes from the start; an action's allocations on one device are one change; each free is one."""
    led = Ledger({"host": 10}, devices=("g0", "host"), samples=True)
    a = act(0, (Mem("g0", "x.L1.m0", 4), Mem("g0", "ws", 3), Mem("host", "gring.L0", 5)), (Mem("g0", "ws", 3),))
    led.start(a, 1.0)
    led.end(a, 2.0)
    b = act(1, (), (Mem("g0", "x.L1.m0", 4),))
    led.start(b, 3.0)
    led.end(b, 3.5)
    assert led.used_bytes == {"g0": 0, "host": 15}
    assert led.peaks() == {"g0": 7, "host": 15}
    assert led.samples == {"g0": [(0.0, 0), (1.0, 7), (2.0, 4), (3.5, 0)], "host": [(0.0, 10), (1.0, 15)]}


def test_closed_ledger_refuses_unknown_devices_open_one_adds_them() -> None:
    """With `devices` given, an effect on another device is a ScheduleError naming the action and device."""
    a = act(7, (Mem("g3", "w.L0", 1),))
    with pytest.raises(ScheduleError, match="action 7.*unknown device 'g3'"):
        Ledger(devices=("g0",)).start(a)
    led = Ledger()
    led.start(a)
    assert led.peaks() == {"g3": 1}


def test_live_buffers_note_double_allocations_and_stray_frees() -> None:
    """`buffers=True`: allocating a live buffer or freeing one that is not live is noted, not raised."""
    led = Ledger(buffers=True)
    w = Mem("g0", "w.L0", 8)
    led.start(act(0, (w,)))
    led.start(act(1, (w,)))
    led.end(act(2, (), (w,)))
    led.end(act(3, (), (w,)))
    assert led.problems == ["action 1 allocates g0:w.L0, which is already live",
                            "action 3 frees g0:w.L0, which is not live"]
