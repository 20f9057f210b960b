"""The host-state layouts by name (`--host-memory`, a policy's `host_memory`): `LAYOUTS`, `make_host_state`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tinypipe.estimate.hostmem import DEFAULT_GRAD_RING_SLOTS
from tinypipe.policy.modes import HostMemory, OptimizerState

from .compact import CompactHostState
from .replicated import ReplicatedHostState
from .state import AdamWConfig, HostState

Params = dict[int, dict[str, torch.Tensor]]

# The host state of each layout: (params, the options every layout takes, the compact layout's own) -> the state.
LAYOUTS: dict[HostMemory, Callable[[Params, dict[str, Any], dict[str, Any]], HostState]] = {
    HostMemory.REPLICATED: lambda params, common, own: ReplicatedHostState(params, **common),
    HostMemory.COMPACT: lambda params, common, own: CompactHostState(params, **common, **own),
}


def make_host_state(params: Params, *, host_memory: HostMemory, compute_dtype: torch.dtype,
                    optim: AdamWConfig, pin: bool = False, grad_ring_slots: int = DEFAULT_GRAD_RING_SLOTS,
                    shared_grad: int | None = None, snapshots: bool = False,
                    optimizer_state: OptimizerState = OptimizerState.FP32, grad_clip: bool = False) -> HostState:
    """The host state of `params` under `host_memory`; `grad_ring_slots`, `snapshots`, a low-precision
    `optimizer_state` and `grad_clip` (a gradient region per layer instead of the ring) are compact's."""
    layout = next((m for m in HostMemory if m.value == host_memory), None)  # a member or its value
    if not OptimizerState(optimizer_state).exact and (layout is None or not layout.planes):
        raise ValueError(f"{optimizer_state} optimizer state needs the compact host layout")
    if layout is None:
        raise ValueError(f"unknown host memory layout {host_memory!r}; expected one of {tuple(HostMemory)}")
    common = {"compute_dtype": compute_dtype, "optim": optim, "pin": pin, "shared_grad": shared_grad}
    own = {"grad_ring_slots": grad_ring_slots, "snapshots": snapshots, "optimizer_state": optimizer_state,
           "grad_clip": grad_clip}
    return LAYOUTS[layout](params, common, own)
