"""The devices a run happens on, as a `Hardware`: CUDA's shipped preset of the local GPU model, or N CPU worker
processes standing in for GPUs with rates measured here in a fraction of a second (GEMM rate, copy bandwidth,
AdamW rate)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from tinypipe.common.errors import InputError
from tinypipe.common.units import MIB
from tinypipe.describe.hardware import GPU, HOST, Hardware, Host, Link, load_hardware, shipped_hardware


def _rate(fn: Callable[[], object], work: float, repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return work / max(best, 1e-9)


def cpu_hardware(workers: int, *, threads: int) -> Hardware:
    """N CPU worker processes as stand-in GPUs, with rates measured here on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(256, 256)
        flops = _rate(lambda: [a @ a for _ in range(8)], 8 * 2 * 256**3)
        src, dst = torch.empty(8 * MIB, dtype=torch.uint8), torch.empty(8 * MIB, dtype=torch.uint8)
        gbps = _rate(lambda: dst.copy_(src), src.numel()) / 1e9
        p = torch.zeros(1 << 18, requires_grad=True)
        p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW([p], fused=True)
        adam = _rate(opt.step, p.numel())
    finally:
        torch.set_num_threads(before)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count() or 1
    return Hardware(
        name=f"cpu-x{workers}", provenance="measured",
        source=f"this host's CPU as {workers} worker processes ({threads} thread(s) each): {flops / 1e9:.1f} GFLOP/s "
               f"(fp32 GEMM 256^3), {gbps:.1f} GB/s copies, {adam / 1e6:.0f} M params/s fused AdamW, measured "
               f"at start-up; all workers share the host's memory",
        host=Host(memory_bytes=mem, dma_gbps=gbps, cpu_cores=cores, adam_params_per_s=adam),
        gpus=tuple(GPU(f"gpu{i}", "CPU", mem, flops, gbps) for i in range(workers)), switches=("rc0",),
        links=(Link(HOST, "rc0", "mem", gbps, 0.0),)
        + tuple(Link("rc0", f"gpu{i}", "pcie", gbps, 2e-6) for i in range(workers)))


def cuda_hardware(gpus: int, name: str | None) -> Hardware:
    """`name` (a preset or file), else the shipped preset of the local GPU model with enough GPUs."""
    if not torch.cuda.is_available():
        raise InputError("--backend cuda: no CUDA device is available (torch.cuda.is_available() is false); "
                         "use --backend cpu")
    have = torch.cuda.device_count()
    if gpus > have:
        raise InputError(f"--gpus {gpus}: only {have} CUDA device{'s' if have != 1 else ''} here")
    hw: Hardware | None = None
    if name is not None:
        hw = load_hardware(name)
    else:
        model = torch.cuda.get_device_name(0)
        for preset in shipped_hardware():
            cand = load_hardware(preset)
            if cand.gpus[0].model.casefold() in model.casefold() and len(cand.gpus) >= gpus:
                if hw is None or len(cand.gpus) < len(hw.gpus):
                    hw = cand
        if hw is None:
            raise InputError(f"no shipped hardware preset describes {model!r}; give --hardware NAME|FILE "
                             f"(presets: {', '.join(shipped_hardware())})")
    if len(hw.gpus) < gpus:
        raise InputError(f"--gpus {gpus}: hardware {hw.name} has only {len(hw.gpus)} GPUs")
    return hw


def first_gpus(hw: Hardware, n: int) -> Hardware:
    """`hw` restricted to its first n GPUs (links to the others dropped)."""
    keep = {f"gpu{i}" for i in range(n)}
    links = tuple(x for x in hw.links if not (x.a.startswith("gpu") and x.a not in keep)
                  and not (x.b.startswith("gpu") and x.b not in keep))
    return Hardware(name=f"{hw.name}[:{n}]", provenance=hw.provenance, source=hw.source, host=hw.host,
                    gpus=hw.gpus[:n], switches=hw.switches, links=links, gpu_p2p=hw.gpu_p2p)
