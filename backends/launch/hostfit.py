"""Refusing a run whose predicted host peak exceeds the host memory this machine allows it, with what fits.

The limit is the smaller of the hardware description's host memory and what this machine has now
(`tinypipe.describe.thismachine`: MemAvailable or the cgroup limit), or `--host-mem`. A plan's predicted
peak may take that limit less a margin for what the prediction misses (`thismachine.HOST_MARGIN_FRACTION`,
the figure `search` plans with too). The refusal is one line before training: the predicted peak, the
limit, where it comes from and the margin, and the nearest variant of the policy that fits (the compact
host layout, activations kept on the GPU), each predicted by the same compiler and simulator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.common.units import GIB, MIB
from tinypipe.describe.hardware import Hardware
from tinypipe.describe.target import host_mem_bytes
from tinypipe.describe.thismachine import (
    HOST_MARGIN_FRACTION,
    host_limit_here,
    host_margin_bytes,
    host_memory_here,
    usable_host_bytes,
)
from tinypipe.policy import Policy
from tinypipe.policy.modes import ActivationHome, HostMemory

# (change, how it reads): the variants tried, least change first
VARIANTS: tuple[tuple[dict[str, Any], str], ...] = (
    ({"host_memory": HostMemory.COMPACT}, "host_memory compact"),
    ({"activation_home": ActivationHome.GPU}, "activation_home gpu"),
    ({"host_memory": HostMemory.COMPACT, "activation_home": ActivationHome.GPU},
     "host_memory compact and activation_home gpu"),
)


def _size(b: int) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / MIB:.1f} MiB"


def run_host_limit(hardware: Hardware, host_mem: str | None) -> tuple[int, str]:
    """The host bytes the run may take and a phrase saying where the figure comes from."""
    if host_mem:
        return host_mem_bytes(host_mem), f"{host_mem} (--host-mem)"
    limit, said = host_limit_here(hardware, host_memory_here())
    return limit, said if limit >= GIB else f"{_size(limit)} ({said.split('(', 1)[1]}"


def check_host_fits(policy: Policy, peak_host_bytes: int, limit: tuple[int, str],
                    predict: Callable[[Policy], int | None]) -> None:
    """InputError when `peak_host_bytes` exceeds the limit less its margin (`usable_host_bytes`);
    `predict(variant)` is a variant's predicted host peak (None when it cannot compile)."""
    limit_bytes, said = limit
    usable = usable_host_bytes(limit_bytes)
    if peak_host_bytes <= usable:
        return
    fits = ""
    for change, label in VARIANTS:
        if all(getattr(policy, k) == v for k, v in change.items()):
            continue
        peak = predict(policy.replace(**change))
        if peak is not None and peak <= usable:
            fits = f"; with {label} in the policy it needs {_size(peak)} and fits"
            break
    else:
        fits = ("; no variant of this policy fits (compact layout, activations on the GPU): run on a host with more "
                "memory")
    raise InputError(f"policy {policy.name!r} needs {_size(peak_host_bytes)} of host memory at its predicted peak, "
                     f"more than the {said} this run may take less {_size(host_margin_bytes(limit_bytes))} "
                     f"({HOST_MARGIN_FRACTION:.0%}) for what the prediction may miss (docs/memory.md): "
                     f"{_size(usable)}{fits}")
