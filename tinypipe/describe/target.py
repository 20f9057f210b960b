"""Target: where a plan runs, the hardware with the GPU and host memory a plan may take (`--gpu-mem`, `--host-mem`)."""

from __future__ import annotations

from dataclasses import dataclass

from tinypipe.common.units import parse_bytes

from .hardware import Hardware
from .thismachine import usable_host_bytes


def gpu_mem_bytes(text: str) -> int:
    """`--gpu-mem`, a size as people type it (`24GiB`): the cap per GPU in bytes; a one-line InputError else."""
    return parse_bytes(text, "--gpu-mem")


def host_mem_bytes(text: str) -> int:
    """`--host-mem`, a size as people type it (`256GiB`): the host memory in bytes; a one-line InputError else."""
    return parse_bytes(text, "--host-mem")


@dataclass(frozen=True, kw_only=True)
class Target:
    """The hardware a plan is for and its memory limits, typed once where a command line is read.

    GPU bytes a plan may use follow one rule (`describe.hardware.usable_gpu_bytes`): the memory or the cap,
    less what is kept free; host bytes, the host memory less the margin a plan keeps (`usable_host_bytes`)."""

    hardware: Hardware
    gpu_mem_bytes: int | None = None  # a cap per GPU (`--gpu-mem`); None: each GPU's own memory
    host_mem_bytes: int | None = None  # the host memory planned for (`--host-mem`); None: the hardware's

    @property
    def gpu_limit(self) -> int:
        """The GPU memory a plan is sized against: the cap, else the smallest GPU's memory."""
        return self.gpu_mem_bytes or min(g.memory_bytes for g in self.hardware.gpus)

    @property
    def gpu_usable_bytes(self) -> int:
        """What a schedule's ledger may hold on the smallest GPU: its memory or the cap less its allocator slack
        (`GPU.usable_bytes`), as the simulator checks it."""
        return min(g.usable_bytes(self.gpu_mem_bytes) for g in self.hardware.gpus)

    @property
    def host_memory(self) -> int:
        """The host memory planned for: `host_mem_bytes`, else the hardware's."""
        return self.host_mem_bytes or self.hardware.host.memory_bytes

    @property
    def host_limit(self) -> int:
        """The most a plan's predicted host peak may take: the host memory less the margin `run` keeps from it
        (`describe.thismachine.usable_host_bytes`)."""
        return usable_host_bytes(self.host_memory)
