"""This machine as the planner sees it without torch: the host memory a run may take, and its GPU models.

Host memory a run may take is the smaller of the kernel's `MemAvailable` (what can be allocated now
without swapping: page cache and reclaimable memory count, other processes' memory does not) and the
memory limit of this process's cgroup (a container's `--memory`; v2 `memory.max`, v1
`memory.limit_in_bytes`). `MemTotal` would promise memory that other processes hold; a cgroup limit
below it is what the kernel's OOM killer enforces.

A plan's predicted host peak may take the limit less a margin (`usable_host_bytes`): what the prediction
misses. While a run trains, `host_available_now` is what it has left: MemAvailable, or the cgroup's limit
less what the cgroup holds (its reclaimable page cache not counted), whichever is smaller.

The GPU models come from the NVIDIA driver's `/proc/driver/nvidia/gpus/*/information` (no CUDA
initialisation): search and simulate call a hardware preset *local* when its GPU model is here.
"""

from __future__ import annotations

import hashlib
import math
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
# beside a cgroup's limit file: the file of what the cgroup holds now, and memory.stat's key for the part of
# it that is reclaimable page cache (what `docker stats` leaves out too)
CGROUP_USAGE = {"memory.max": ("memory.current", "inactive_file"),
                "memory.limit_in_bytes": ("memory.usage_in_bytes", "total_inactive_file")}
# The share of a host limit kept from a plan: its predicted host peak plus this share must fit the limit. On the
# 1-GPU H200 machine (125.8 GiB) a run predicted to peak at 109.1 GiB of host memory held 116.4 GiB of worker
# RSS, 6.7% above its prediction; another day the kernel's OOM killer ended the same run (issue 35). A plan at
# the edge takes 92% of the limit and may run 8.7% above its prediction before it reaches the limit. No fixed
# part: the measured gap is one ratio, and a fixed part would refuse every small run under a small --host-mem;
# the workers' RSS guard (backends/rank/rss_guard.py) stops a run cleanly where a prediction misses by more.
HOST_MARGIN_FRACTION = 0.08


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


def _cgroup_free(limit: int, path: Path) -> int | None:
    """`limit` less what the cgroup of the limit file `path` holds now, its reclaimable page cache not counted;
    None when its usage cannot be read."""
    usage_name, cache_key = CGROUP_USAGE.get(path.name, ("", ""))
    try:
        used = int(path.with_name(usage_name).read_text().strip()) if usage_name else None
    except (OSError, ValueError):
        used = None
    if used is None:
        return None
    try:
        words = path.with_name("memory.stat").read_text().split()  # "key value" lines, in bytes
    except OSError:
        words = []
    cache = dict(zip(words[::2], words[1::2])).get(cache_key, "0")
    return limit - max(0, used - (int(cache) if cache.isdigit() else 0))


def host_available_now(meminfo: Path | None = None,
                       cgroup_limits: tuple[Path, ...] | None = None) -> HostMemoryHere | None:
    """The host bytes left now (see the module docstring): the smaller of MemAvailable and the cgroup's limit less
    what it holds; None when neither is readable."""
    avail = _meminfo_bytes("MemAvailable", meminfo or MEMINFO)
    limit = _cgroup_limit(cgroup_limits if cgroup_limits is not None else CGROUP_LIMITS)
    if limit is not None:
        free = _cgroup_free(*limit)  # unreadable: the room is at most the limit
        room = (HostMemoryHere(limit[0], f"cgroup limit {limit[1]}") if free is None
                else HostMemoryHere(max(0, free), f"cgroup {limit[1].parent} below its limit"))
        if avail is None or room.bytes < avail:
            return room
    if avail is not None:
        return HostMemoryHere(avail, "MemAvailable")
    return None


def host_total_here(meminfo: Path | None = None, cgroup_limits: tuple[Path, ...] | None = None) -> int | None:
    """This machine's host memory: the smaller of MemTotal and the cgroup's limit; None when neither is readable."""
    total = _meminfo_bytes("MemTotal", meminfo or MEMINFO)
    limit = _cgroup_limit(cgroup_limits if cgroup_limits is not None else CGROUP_LIMITS)
    sizes = [b for b in (total, None if limit is None else limit[0]) if b is not None]
    return min(sizes) if sizes else None


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


def host_margin_bytes(limit_bytes: int) -> int:
    """The bytes of a host limit a plan may not take (`HOST_MARGIN_FRACTION` of it)."""
    return round(HOST_MARGIN_FRACTION * limit_bytes)


def usable_host_bytes(limit_bytes: int) -> int:
    """The most a plan's predicted host peak may take under a host limit: the limit less its margin."""
    return limit_bytes - host_margin_bytes(limit_bytes)


def limit_for_peak(peak_bytes: int) -> int:
    """The least host limit under which a plan may take `peak_bytes` (`usable_host_bytes` inverted)."""
    limit = math.ceil(peak_bytes / (1 - HOST_MARGIN_FRACTION))
    while usable_host_bytes(limit) < peak_bytes:
        limit += 1
    return limit


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
