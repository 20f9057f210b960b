"""The host-state layouts by name (`--host-memory`, a policy's `host_memory`): `make_host_state`."""

from __future__ import annotations

import torch

from tinypipe.estimate.hostmem import DEFAULT_GRAD_RING_SLOTS
from tinypipe.policy.modes import HOST_LAYOUTS, HostLayout

from .host_compact import CompactHostState
from .host_replicated import ReplicatedHostState
from .hoststate import AdamWConfig, HostState


def make_host_state(params: dict[int, dict[str, torch.Tensor]], *, layout: HostLayout, compute_dtype: torch.dtype,
                    optim: AdamWConfig, pin: bool = False, grad_ring_slots: int = DEFAULT_GRAD_RING_SLOTS,
                    shared_grad: int | None = None, snapshots: bool = False) -> HostState:
    """The host state of `params` under `layout`; `grad_ring_slots` and `snapshots` are compact's."""
    if layout == "replicated":
        return ReplicatedHostState(params, compute_dtype=compute_dtype, optim=optim, pin=pin, shared_grad=shared_grad)
    if layout == "compact":
        return CompactHostState(params, compute_dtype=compute_dtype, optim=optim, pin=pin, shared_grad=shared_grad,
                                grad_ring_slots=grad_ring_slots, snapshots=snapshots)
    raise ValueError(f"unknown host memory layout {layout!r}; expected one of {HOST_LAYOUTS}")
