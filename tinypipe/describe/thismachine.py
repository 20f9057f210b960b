"""This machine as the planner sees it without torch: the host memory a run may take, and its GPU models.

Host memory a run may take is the smaller of the kernel's `MemAvailable` (what can be allocated now
without swapping: page cache and reclaimable memory count, other processes' memory does not) and the
memory limit of this process's cgroup (a container's `--memory`; v2 `memory.max`, v1
`memory.limit_in_bytes`). `MemTotal` would promise memory that other processes hold; a cgroup limit
below it is what the kernel's OOM killer enforces.

The GPU models come from the NVIDIA driver's `/proc/driver/nvidia/gpus/*/information` (no CUDA
initialisation): search and simulate call a hardware preset *local* when its GPU model is here.
"""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from .hardware import Hardware

MEMINFO = Path("/proc/meminfo")
# v2 (unified) first, then v1's memory controller; a missing file is no limit
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
# cgroup v1 writes "no limit" as a page-rounded 2^63 - 1; anything this large is no limit
NO_LIMIT_BYTES = 1 << 60


@dataclass(frozen=True)
class HostMemoryHere:
    """What this machine's host memory allows a run: the bytes and where the figure comes from."""

    bytes: int
    source: str  # e.g. "MemAvailable" or "cgroup limit (/sys/fs/cgroup/memory.max)"

    def describe(self) -> str:
        return f"{self.bytes / 2**30:.1f} GiB ({self.source})"


def _meminfo_bytes(field: str, path: Path) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == field:
            parts = rest.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return None


def _cgroup_limit(paths: tuple[Path, ...]) -> tuple[int, Path] | None:
    for path in paths:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < NO_LIMIT_BYTES:
            return int(text), path
    return None


def host_memory_here(meminfo: Path | None = None,
                     cgroup_limits: tuple[Path, ...] | None = None) -> HostMemoryHere | None:
    """The host bytes a run started now may take (see the module docstring); None when neither is readable."""
    avail = _meminfo_bytes("MemAvailable", meminfo or MEMINFO)
    limit = _cgroup_limit(cgroup_limits if cgroup_limits is not None else CGROUP_LIMITS)
    if limit is not None and (avail is None or limit[0] < avail):
        return HostMemoryHere(limit[0], f"cgroup limit {limit[1]}")
    if avail is not None:
        return HostMemoryHere(avail, "MemAvailable")
    return None


def gpu_models_here(root: Path | None = None) -> list[str]:
    """The model names the NVIDIA driver reports here (`Model: NVIDIA H200`), one per GPU; [] without one."""
    out = []
    try:
        dirs = sorted((root or NVIDIA_GPUS).iterdir())
    except OSError:
        return []
    for d in dirs:
        try:
            text = (d / "information").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Model:"):
                out.append(line.split(":", 1)[1].strip())
    return out


def is_here(hw: Hardware, models: list[str] | None = None) -> bool:
    """Whether `hw` describes this machine: its GPU model is among the GPUs here, as many or more of them."""
    here = gpu_models_here() if models is None else models
    name = hw.gpus[0].model.casefold()
    return sum(1 for m in here if name in m.casefold()) >= len(hw.gpus)


def host_limit_here(hw: Hardware, here: HostMemoryHere | None) -> tuple[int, str]:
    """The host bytes to plan `hw` with when it is this machine: the smaller of its description and what
    this machine allows now, with a phrase saying which."""
    if here is None or here.bytes >= hw.host.memory_bytes:
        return hw.host.memory_bytes, f"{hw.host.memory_bytes / 2**30:.1f} GiB ({hw.name}'s host memory)"
    return here.bytes, here.describe()


def _first_line(path: str, prefix: str = "") -> str:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.strip()
    except OSError:
        pass
    return ""


def fingerprint() -> str:
    """A short name for this machine as booted now: host name, boot id, CPU model and count, MemTotal and GPU
    models. A calibration cached under it is never read on another machine, a new VM, or after a reboot."""
    parts = [platform.node(), _first_line("/proc/sys/kernel/random/boot_id"),
             _first_line("/proc/cpuinfo", "model name"), str(os.cpu_count()), _first_line(str(MEMINFO), "MemTotal"),
             *gpu_models_here()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
