"""Host bytes a rank's state really holds, by purpose, as counted from its tensors (`HostState.held`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tinypipe.policy.modes import HostMemory


@dataclass(frozen=True)
class HeldBytes:
    """Host bytes this rank really holds, by purpose (tensor storage sizes; a pinned slab's views by
    their own sizes, the slab's alignment padding apart)."""

    host_memory: HostMemory
    params: int
    master_bytes: int
    upload_copy_bytes: int
    grad_bytes: int
    optim_state_bytes: int  # AdamW moments and step counters
    scratch_bytes: int  # compact: the join/update/split buffer
    stale_bytes: int  # compact + async: snapshots of the previous version awaiting their last LOAD
    pinned_rounding_bytes: int  # alignment padding of the pinned slabs (no allocator rounding: one slab)

    @property
    def total_bytes(self) -> int:
        return (self.master_bytes + self.upload_copy_bytes + self.grad_bytes + self.optim_state_bytes
                + self.scratch_bytes + self.stale_bytes + self.pinned_rounding_bytes)

    @property
    def bytes_per_param(self) -> float:
        return self.total_bytes / max(1, self.params)

    def to_json(self) -> dict[str, Any]:
        return {"host_memory": self.host_memory.value, "params": self.params, "master_bytes": self.master_bytes,
                "upload_copy_bytes": self.upload_copy_bytes, "grad_bytes": self.grad_bytes,
                "optim_state_bytes": self.optim_state_bytes, "scratch_bytes": self.scratch_bytes,
                "stale_bytes": self.stale_bytes, "pinned_rounding_bytes": self.pinned_rounding_bytes,
                "total_bytes": self.total_bytes, "bytes_per_param": self.bytes_per_param}


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def view_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the tensors themselves span (views carved from one slab count separately)."""
    return sum(t.numel() * t.element_size() for t in tensors)
