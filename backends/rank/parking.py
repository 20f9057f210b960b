"""Pinned host buffers for activations parked in host memory (OFFLOAD_ACT / FETCH_ACT), reused.

No per-tensor pinned allocation: `torch.empty(..., pin_memory=True)` for each parked input costs a
page-locking allocation per activation in the first step (18 ms gaps between forward layers on an
H200) and rounds each block to a power of two. Here buffers of one size are carved
from `PinnedSlab`s, GROW_BYTES at a time, and reused. A buffer handed back after an upload from it
is reused only once that upload has finished: on CUDA the next download into it waits for the
upload's event on the device (the host never blocks); on the CPU copies are done when they return.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from tinypipe.common.units import GIB

from ..host.pinned import PinnedSlab

GROW_BYTES = GIB  # pinned at a time when the lot runs out: one registration per GiB
GROW_MAX = 64  # buffers at a time at most (small activations: 4 KiB alignment each)


class ParkingLot:
    """Reusable pinned buffers, by size; `take` one for a download, `give_back` it after its upload."""

    def __init__(self, *, pin: bool, device: torch.device) -> None:
        self.pin = pin
        self.device = device
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}  # nbytes -> [(uint8 view, upload event)]
        self._slabs: list[PinnedSlab] = []

    @property
    def nbytes(self) -> int:
        """Bytes of pinned memory the lot holds (in use or free)."""
        return sum(s.nbytes for s in self._slabs)

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A pinned host tensor of `shape` and `dtype` for a download issued next on the current stream."""
        nbytes = math.prod(shape) * dtype.itemsize
        free = self._free.setdefault(nbytes, [])
        if not free:
            count = max(1, min(GROW_MAX, GROW_BYTES // max(1, nbytes)))
            slab = PinnedSlab([((nbytes,), torch.uint8)] * count, pin=self.pin,
                              what=f"{count} parked activations of {nbytes:,} bytes")
            self._slabs.append(slab)
            free.extend((slab.take((nbytes,), torch.uint8), None) for _ in range(count))
        buf, uploaded = free.pop()
        if uploaded is not None:  # the last upload from this buffer must finish before it is overwritten
            torch.cuda.current_stream(self.device).wait_event(uploaded)
        return buf.view(dtype).view(tuple(shape))

    def give_back(self, t: torch.Tensor) -> None:
        """`t` (from `take`) is free once the work issued so far on the current stream has run."""
        flat = t.reshape(-1).view(torch.uint8)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._free.setdefault(flat.numel(), []).append((flat, event))
