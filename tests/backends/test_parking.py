"""Parked activations reuse pinned buffers carved from slabs (no per-tensor pinned allocation)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tinypipe.backends.rank import parking  # noqa: E402
from tinypipe.backends.rank.parking import ParkingLot  # noqa: E402


def test_buffers_are_reused_after_give_back_and_grown_in_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A given-back buffer is what the next `take` of that size returns; the lot grows by whole slabs
    (GROW_BYTES of buffers, at most GROW_MAX), never one allocation per take; sizes do not mix."""
    monkeypatch.setattr(parking, "GROW_BYTES", 3 * 64 * 4)  # three 64-element fp32 buffers per slab
    lot = ParkingLot(pin=False, device=torch.device("cpu"))
    a = lot.take((4, 16), torch.float32)
    assert a.shape == (4, 16) and a.dtype == torch.float32
    grown = lot.nbytes
    b = lot.take((64,), torch.float32)
    c = lot.take((2, 32), torch.float32)
    assert lot.nbytes == grown  # three from the first slab
    ptrs = {t.data_ptr() for t in (a, b, c)}
    assert len(ptrs) == 3
    lot.give_back(b)
    d = lot.take((8, 8), torch.float32)
    assert d.data_ptr() == b.data_ptr() and lot.nbytes == grown
    lot.take((64,), torch.float32)  # the slab is used up: one more slab
    assert lot.nbytes == 2 * grown
    half = lot.take((64,), torch.bfloat16)  # another size: its own buffers
    assert half.data_ptr() not in ptrs and lot.nbytes > 2 * grown


def test_values_survive_the_round_trip() -> None:
    """What is downloaded into a parked buffer comes back unchanged (the interpreter's OFFLOAD/FETCH)."""
    lot = ParkingLot(pin=False, device=torch.device("cpu"))
    x = torch.randn(3, 5)
    host = lot.take(x.shape, x.dtype)
    host.copy_(x)
    back = host.clone()
    lot.give_back(host)
    torch.testing.assert_close(back, x, rtol=0, atol=0)
