"""A rank's layers and host state, built so that the host never holds the model twice.

Under the compact layout, and for a frozen base (LoRA), the layers are built with their parameters on the meta device
(`hf.build_model(lazy=True)`), the host state is made from their shapes, and then each layer's weights
are read (safetensors) or drawn (seeded initialisation) and split into the planes one layer at a time:
the host's peak is the state plus one layer, not the state plus the model. The replicated layout keeps
the built tensors as its masters (no second copy either). `rss` records the resident bytes at each phase.
"""

from __future__ import annotations

import os
import resource
from typing import Any

import torch

from ..host.compact import CompactHostState
from ..host.frozen import FrozenHostState
from ..host.layouts import make_host_state
from ..host.state import DTYPES, HostState
from ..model.layers import LayerStack


def build_rank_state(job: Any, layers: list[int], device: torch.device,
                     ) -> tuple[LayerStack, HostState, dict[str, tuple[int, int]]]:
    """(the rank's layer stack with its parameters stripped, its host state, RSS by phase) for `job`."""
    from ..model.hf import build_model

    sched = job.schedule
    rss = {"start": rss_now()}
    lazy = sched.host_memory.planes or sched.lora is not None
    stack = build_model(job.model, seed=job.seed, only=set(layers), lazy=lazy)
    rss["model built" + (" (shapes only)" if lazy else "")] = rss_now()
    shared = 0 if stack.tied is not None and {0, sched.num_layers - 1} <= set(layers) else None
    host: HostState
    if sched.lora is not None:  # a frozen base: one compute-dtype copy, adapters on the device
        from ..save.lora_save import lora_host_state

        host = lora_host_state(job, stack, layers, device)
    else:
        host = make_host_state(stack.state(), host_memory=sched.host_memory,
                               compute_dtype=DTYPES[sched.compute_dtype], optim=job.optim, pin=device.type == "cuda",
                               shared_grad=shared, snapshots=sched.optimizer.staleness > 0,
                               optimizer_state=sched.optimizer_state, grad_clip=sched.grad_clip)
    rss["host state made"] = rss_now()
    if lazy:
        assert isinstance(host, (CompactHostState, FrozenHostState)) and stack.tensors_of is not None
        for i in layers:
            host.fill(i, stack.tensors_of(i))  # this layer's tensors are dropped before the next is made
        rss["weights filled layer by layer"] = rss_now()
    for i in layers:
        module = stack.layers[i]
        assert module is not None  # built for the layers this rank owns
        strip_parameters(module)
    rss["model's own weights dropped"] = rss_now()
    return stack, host, rss


def strip_parameters(module: torch.nn.Module) -> None:
    """Replace a module's parameters by meta tensors: it becomes structure for functional_call."""
    for name, p in list(module.named_parameters()):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        setattr(owner, leaf, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                requires_grad=False))


def rss_now() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes so far) of this process; now is 0 without /proc."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), peak
    except OSError:
        return 0, peak
