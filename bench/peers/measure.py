"""What every peer script measures, the same way: its options, the GPU memory cap, synchronised step
timing, peak GPU and host memory, pinned host memory, versions; and the record it writes for the runner.

A peer script writes `<--result>.rank<R>.json` after setting up and again after every step (atomically),
so a run the runner has to kill still leaves the steps it finished.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from peers.workload import add_workload_arguments

GIB = 2**30
BALLAST_CHUNK_BYTES = 2 * GIB  # the ballast is taken in pieces: one huge cuMemAlloc may find no room


def peer_parser(description: str) -> argparse.ArgumentParser:
    """The options every peer script takes (the runner passes them all)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True, help="directory holding the model's config.json")
    p.add_argument("--mode", choices=("sync", "async"), default="sync", help="optimizer mode")
    p.add_argument("--gpus", type=int, default=1, help="GPUs this configuration uses")
    p.add_argument("--gpu-mem-gib", type=_cap, default=None, help="GPU memory cap per GPU in GiB, or none")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps, warm-up included")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of tokens/s")
    p.add_argument("--result", required=True, help="prefix of the record files (<prefix>.rank<R>.json)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: tests only")
    add_workload_arguments(p)
    return p


def _cap(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank): torchrun's, or a single process's (whose defaults are set here)."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Recorder:
    """This rank's record: set fields, add steps, `flush` (atomic rewrite of the file)."""

    def __init__(self, prefix: str, rank: int, **fields: Any) -> None:
        self.path = Path(f"{prefix}.rank{rank}.json")
        self.started = time.perf_counter()
        self.data: dict[str, Any] = {"rank": rank, "done": False, "iteration_s_each": [], "losses": [],
                                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                     **fields}
        self.flush()

    def set(self, **fields: Any) -> None:
        self.data.update(fields)
        self.flush()

    def step(self, seconds: float, loss: float | None) -> None:
        self.data["iteration_s_each"].append(seconds)
        self.data["losses"].append(loss)
        self.flush()

    def flush(self) -> None:
        self.data["elapsed_s"] = time.perf_counter() - self.started
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def guarded(main: Callable[[], int]) -> int:
    """Run a peer's main: an exception prints its traceback (the runner keeps the log's last lines)
    and exits 1."""
    try:
        return main()
    except BaseException as exc:  # noqa: BLE001 - the runner records every failure, its own included
        if isinstance(exc, SystemExit):
            raise
        traceback.print_exc()
        print(f"peer failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1


def cap_gpus(cap_gib: float | None, devices: Sequence[int]) -> dict[str, Any]:
    """Hold each device to `cap_gib`: PyTorch's allocator capped at that share of the device
    (`set_per_process_memory_fraction`), and the rest of the free memory taken by a ballast allocated
    with the CUDA driver outside PyTorch, so that a system which plans from the free memory it sees
    (RoundPipe reads `torch.cuda.mem_get_info` when it is imported) sees a card of `cap_gib`. The
    ballast is not in PyTorch's statistics. Call before the system allocates (or is imported)."""
    import torch

    if cap_gib is None:
        return {"method": "uncapped"}
    cap = int(cap_gib * GIB)
    out: dict[str, Any] = {"method": "set_per_process_memory_fraction + driver ballast", "cap_bytes": cap,
                           "devices": []}
    for d in devices:
        torch.cuda.set_device(d)
        torch.empty(1, device=f"cuda:{d}")  # this device's context, current on this thread
        total = torch.cuda.get_device_properties(d).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), d)
        free, _ = torch.cuda.mem_get_info(d)
        want = max(0, free - cap)
        took, error = _ballast(want, d)
        out["devices"].append({"device": d, "total_bytes": total, "fraction": min(1.0, cap / total),
                               "ballast_bytes": took, "ballast_error": error,
                               "free_after_bytes": torch.cuda.mem_get_info(d)[0]})
    torch.cuda.set_device(devices[0])
    return out


_BALLAST: list[int] = []  # device pointers held for the life of the process


def _ballast(nbytes: int, device: int) -> tuple[int, str | None]:
    """Allocate `nbytes` on `device` with the CUDA driver's cuMemAlloc, in the device's primary context
    (PyTorch's), never freed; (bytes taken, error or None)."""
    if nbytes <= 0:
        return 0, None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return 0, f"no CUDA driver library: {exc}"
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:  # PyTorch made it current; else do so
        dev = ctypes.c_int()
        if (lib.cuDeviceGet(ctypes.byref(dev), device) != 0 or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0
                or lib.cuCtxSetCurrent(ctx) != 0):
            return 0, f"no CUDA context for device {device}"
    taken = 0
    while taken < nbytes:
        size = min(BALLAST_CHUNK_BYTES, nbytes - taken)
        ptr = ctypes.c_uint64()
        rc = lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
        if rc != 0:
            return taken, f"cuMemAlloc_v2 of {size:,} bytes returned CUDA error {rc} after {taken:,} bytes"
        _BALLAST.append(ptr.value)
        taken += size
    return taken, None


def synchronizer(devices: Sequence[int], cuda: bool) -> Callable[[], None]:
    """A function that waits for all work queued on `devices` (nothing on the CPU)."""
    import torch

    def sync() -> None:
        if cuda:
            for d in devices:
                torch.cuda.synchronize(d)

    return sync


def timed_steps(step: Callable[[int], Any], rec: Recorder, *, steps: int, sync: Callable[[], None]) -> None:
    """Run `steps` optimizer steps, each timed on the host between two device synchronisations;
    the loss is read after the clock stops."""
    for k in range(steps):
        sync()
        t0 = time.perf_counter()
        loss = step(k)
        sync()
        seconds = time.perf_counter() - t0
        rec.step(seconds, None if loss is None else float(loss))


def gpu_memory(devices: Sequence[int], cuda: bool) -> dict[str, Any]:
    """Peak bytes PyTorch's allocator had allocated and reserved on each device (0 on the CPU)."""
    import torch

    if not cuda:
        return {"peak_gpu_bytes": [0], "peak_gpu_reserved_bytes": [0]}
    return {"peak_gpu_bytes": [int(torch.cuda.max_memory_allocated(d)) for d in devices],
            "peak_gpu_reserved_bytes": [int(torch.cuda.max_memory_reserved(d)) for d in devices]}


def reset_gpu_peaks(devices: Sequence[int], cuda: bool) -> dict[str, Any]:
    """The peaks of set-up (building the model, the system's own initialisation), then a fresh start,
    so that `gpu_memory` after the steps reports training's peaks."""
    import torch

    before = gpu_memory(devices, cuda)
    if cuda:
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)
    return {"setup_" + k: v for k, v in before.items()}


def host_memory() -> dict[str, Any]:
    """This process's peak resident set (ru_maxrss) and the most pinned bytes PyTorch's pinned caching
    allocator held (None where this torch keeps no such statistics)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:  # the one reader of PyTorch's pinned statistics; a peer's record must not hang on it
        from tinypipe.backends.host.pinned import torch_pinned_peak_bytes
    except ImportError as exc:
        return {"peak_host_rss_bytes": rss, "pinned_host_bytes": None, "pinned_note": f"not read: {exc}"}
    pinned = torch_pinned_peak_bytes()
    note = ("torch.cuda.host_memory_stats: PyTorch's pinned caching allocator only (memory pinned with "
            "cudaHostRegister or by a library's own cudaHostAlloc is not in it)" if pinned is not None else
            "not available (no torch.cuda.host_memory_stats in this torch, or no CUDA)")
    return {"peak_host_rss_bytes": rss, "pinned_host_bytes": pinned, "pinned_note": note}


def versions(*packages: str) -> dict[str, str | None]:
    """Installed versions of `packages` (None for one not installed)."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_name(cuda: bool) -> str:
    import torch

    if not cuda:
        return "cpu"
    return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
