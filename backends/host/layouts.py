"""The host-state layouts by name (`--host-memory`, a policy's `host_memory`): `make_host_state`."""

from __future__ import annotations

import torch

from tinypipe.estimate.hostmem import DEFAULT_GRAD_RING_SLOTS
from tinypipe.policy.modes import HostMemory, OptimizerState

from .compact import CompactHostState
from .replicated import ReplicatedHostState
from .state import AdamWConfig, HostState


def make_host_state(params: dict[int, dict[str, torch.Tensor]], *, host_memory: HostMemory, compute_dtype: torch.dtype,
                    optim: AdamWConfig, pin: bool = False, grad_ring_slots: int = DEFAULT_GRAD_RING_SLOTS,
                    shared_grad: int | None = None, snapshots: bool = False,
                    optimizer_state: OptimizerState = OptimizerState.FP32, grad_clip: bool = False) -> HostState:
    """The host state of `params` under `host_memory`; `grad_ring_slots`, `snapshots`, a low-precision
    `optimizer_state` and `grad_clip` (a gradient region per layer instead of the ring) are compact's."""
    if not OptimizerState(optimizer_state).exact and host_memory != HostMemory.COMPACT:
        raise ValueError(f"{optimizer_state} optimizer state needs the compact host layout")
    if host_memory == HostMemory.REPLICATED:
        return ReplicatedHostState(params, compute_dtype=compute_dtype, optim=optim, pin=pin, shared_grad=shared_grad)
    if host_memory == HostMemory.COMPACT:
        return CompactHostState(params, compute_dtype=compute_dtype, optim=optim, pin=pin, shared_grad=shared_grad,
                                grad_ring_slots=grad_ring_slots, snapshots=snapshots, optimizer_state=optimizer_state,
                                grad_clip=grad_clip)
    raise ValueError(f"unknown host memory layout {host_memory!r}; expected one of {tuple(HostMemory)}")
