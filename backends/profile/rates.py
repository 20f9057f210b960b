"""Host <-> device copy rates and the host optimizer's rates, measured here -> `HostRates` (and a preset with them).

Copies (pinned host memory on CUDA, timed with CUDA events on side streams; on a CPU the "device"
is host memory too, so these are host memcpys timed with `time.perf_counter`), median of `repeat`
after one warm-up:
- h2d_gbps, d2h_gbps: one copy of `copy_bytes` each way alone;
- bidir_gbps: both at once (two streams; on a CPU two threads), total bytes over the time both took;
- copy_latency_s: the fixed cost of a copy, the time of a `small_copy_bytes` copy less its bytes at
  the H2D rate (3-6 us on the H200 host: traces/hardware/h200x2.json).

Host optimizer, over one fp32 tensor of `optim_params` parameters at `threads` intra-op threads,
through the run's own code (`HostState.step`, what an OPT_STEP runs), gradients delivered first:
- adam_params_per_s: torch's fused AdamW alone (`AdamWConfig.make`), the rate `Hardware.host` holds;
- replicated_params_per_s: the replicated layout's step (that AdamW, then the refresh of the
  compute-dtype upload copy);
- compact_params_per_s: the compact layout's step (`planes.compact_adamw_step`, chunked join /
  AdamW / split over the 16-bit planes);
- compact_bf16_params_per_s, compact_8bit_params_per_s: the compact step with bf16 / 8-bit moments
  (`moments.lowp_adamw_step`, `--optimizer-state`).
(each compact step runs the one-pass kernel, `fused_host_adamw`, where it builds, as a run's OPT_STEPs do);
- host_mem_gbps: this host's DRAM bandwidth, bytes read + written by an in-place pass over a buffer past the
  last-level cache on `threads` threads (`fused_host_adamw.memory_gbps`, as the optimizer's kernel moves bytes; a
  memcpy without the kernel): what the simulator's host optimizer and copies share (`Host.mem_gbps`);
- compact_beside_copies_params_per_s: the compact step again while host -> device copies run back to back beside
  it (on a CPU, host memcpys), to set beside what the shared-DRAM model predicts for it
  (`tinypipe.estimate.hostcal.step_beside_copies`).
Where a trace has no per-kind step (optim.py measures those, on each kind's own tensors and beside
the device's work), the simulator charges these layouts' rates (`tinypipe.estimate.hostmem.optimizer_s_per_param`;
`optimizer_time_factor(host_memory)` / adam_params_per_s without them); `factors()` gives the measured
factors to compare with those constants.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tinypipe.common.units import MIB
from tinypipe.describe.hardware import Hardware
from tinypipe.estimate.hostcal import FORMAT, with_rates
from tinypipe.estimate.hostmem import optimizer_time_factor
from tinypipe.policy.modes import HostMemory, OptimizerState

from ..host import fused_host_adamw
from ..host.layouts import make_host_state
from ..host.state import DTYPES, AdamWConfig

COPY_BYTES = 256 * MIB  # large enough to reach the link's rate (>= 16 MiB on the H200 host)
CPU_COPY_BYTES = 64 * MIB  # host memcpy: past the last-level cache, a fraction of a second on 2 cores
SMALL_COPY_BYTES = 4 << 10
OPTIM_PARAMS = 1 << 24  # 16M fp32 parameters: 256 MiB of state, past any cache, ~20 ms a step on 2 cores


@dataclass(frozen=True)
class HostRates:
    """What `measure_rates` measured (see the module docstring); bandwidths in GB/s = 1e9 B/s."""

    device: str  # what the copies ran on, e.g. "cuda:0 (NVIDIA H200)" or "cpu (host memcpy)"
    threads: int  # torch intra-op threads for the host work
    h2d_gbps: float
    d2h_gbps: float
    bidir_gbps: float  # H2D and D2H at once, both directions together
    copy_latency_s: float
    adam_params_per_s: float
    replicated_params_per_s: float
    compact_params_per_s: float
    compact_bf16_params_per_s: float
    compact_8bit_params_per_s: float
    copy_bytes: int
    small_copy_bytes: int
    optim_params: int
    compute_dtype: str  # of the host state the optimizer steps ran in
    repeat: int
    when: str
    host_mem_gbps: float | None = None
    compact_beside_copies_params_per_s: float | None = None

    def factors(self) -> dict[HostMemory, float]:
        """Each layout's optimizer time per parameter over a plain fused AdamW's (hostmem's factors, measured)."""
        return {HostMemory.REPLICATED: self.adam_params_per_s / self.replicated_params_per_s,
                HostMemory.COMPACT: self.adam_params_per_s / self.compact_params_per_s}

    def to_json(self) -> dict[str, Any]:
        f = self.factors()
        return {"format": FORMAT, **asdict(self),
                "optimizer_time_factor": {k: round(v, 3) for k, v in f.items()},
                "optimizer_time_factor_in_tinypipe": {lay: round(optimizer_time_factor(lay), 3)
                                                      for lay in tuple(HostMemory)},
                "fields": "h2d/d2h_gbps: one copy of copy_bytes each way alone (pinned host memory on CUDA, host "
                          "memcpy on a CPU); bidir_gbps: both directions at once, total; copy_latency_s: a "
                          "small_copy_bytes copy's time less its bytes at h2d_gbps; *_params_per_s: fp32 parameters "
                          "per second at `threads` threads: torch fused AdamW alone (Hardware.host.adam_params_per_s), "
                          "HostState.step under the replicated layout (AdamW + upload-copy refresh) and the compact "
                          "one (planes.compact_adamw_step); optimizer_time_factor: adam / layout rate, to compare "
                          "with tinypipe.estimate.hostmem's constants"}

    def hardware(self, base: Hardware) -> Hardware:
        """`base` with these rates (`tinypipe.estimate.hostcal.with_rates`, which says what changes)."""
        return with_rates(base, self.to_json())


def _median(fn: Callable[[], float], repeat: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(repeat))


def _cuda_copies(device: torch.device, nbytes: int, small: int, repeat: int) -> tuple[float, float, float, float]:
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def timed(*copies: tuple[torch.cuda.Stream, Callable[[], object]]) -> float:
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        ends = []
        for stream, copy in copies:
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                copy()
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                ends.append(end)
        torch.cuda.synchronize(device)
        return max(float(start.elapsed_time(e)) for e in ends) / 1e3

    h2d = (up, lambda: dev_in.copy_(host_in, non_blocking=True))
    d2h = (down, lambda: host_out.copy_(dev_out, non_blocking=True))
    small_copy = (up, lambda: dev_in[:small].copy_(host_in[:small], non_blocking=True))
    t_up = _median(lambda: timed(h2d), repeat)
    t_down = _median(lambda: timed(d2h), repeat)
    t_both = _median(lambda: timed(h2d, d2h), repeat)
    t_small = _median(lambda: timed(small_copy), 5 * repeat)
    return nbytes / t_up, nbytes / t_down, 2 * nbytes / t_both, max(0.0, t_small - small / (nbytes / t_up))


def _cpu_copies(nbytes: int, small: int, repeat: int) -> tuple[float, float, float, float]:
    host_in, dev_in = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dev_out, host_out = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

    def timed(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def both() -> float:
        go = threading.Barrier(2)

        def other() -> None:
            go.wait()
            host_out.copy_(dev_out)

        t = threading.Thread(target=other)
        t.start()
        go.wait()
        t0 = time.perf_counter()
        dev_in.copy_(host_in)
        t.join()
        return time.perf_counter() - t0

    t_up = _median(lambda: timed(lambda: dev_in.copy_(host_in)), repeat)
    t_down = _median(lambda: timed(lambda: host_out.copy_(dev_out)), repeat)
    t_both = _median(both, repeat)
    t_small = _median(lambda: timed(lambda: dev_in[:small].copy_(host_in[:small])), 5 * repeat)
    return nbytes / t_up, nbytes / t_down, 2 * nbytes / t_both, max(0.0, t_small - small / (nbytes / t_up))


def _plain_adam_rate(weights: torch.Tensor, grad: torch.Tensor, repeat: int) -> float:
    p = weights.clone().requires_grad_()
    p.grad = grad.float()
    opt = AdamWConfig().make([p])

    def step() -> float:
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    return weights.numel() / _median(step, repeat)


def host_state_rate(host_memory: HostMemory, weights: torch.Tensor, grad: torch.Tensor, compute_dtype: str,
                    repeat: int, optimizer_state: OptimizerState = OptimizerState.FP32) -> float:
    """params/s of `HostState.step` (what an OPT_STEP runs) under `host_memory` (moments as `optimizer_state`):
    the median of `repeat` steps after one that allocates the moments, each after its GRAD_OUT's gradient
    delivery."""
    state = make_host_state({0: {"w": weights.clone()}}, host_memory=host_memory, compute_dtype=DTYPES[compute_dtype],
                            optim=AdamWConfig(), optimizer_state=optimizer_state)

    def step() -> float:
        state.receive_grads(0, {"w": grad})  # what GRAD_OUT delivers before each OPT_STEP
        t0 = time.perf_counter()
        state.step(0)
        return time.perf_counter() - t0

    return weights.numel() / _median(step, repeat)


def host_mem_gbps(nbytes: int = 1 << 30, repeat: int = 3) -> float:
    """This host's DRAM bandwidth on torch's intra-op threads: the kernel's in-place pass
    (`fused_host_adamw.memory_gbps`), else `host_copy_gbps`."""
    got = fused_host_adamw.memory_gbps(nbytes, repeat)
    return got if got is not None else host_copy_gbps(nbytes, repeat)


def host_copy_gbps(nbytes: int = 1 << 30, repeat: int = 5) -> float:
    """GB/s read + written by `dst.copy_(src)` of `nbytes` (a memcpy into another buffer, whose writes also read
    each line first, uncounted), the median of `repeat` after a first touch, on torch's intra-op threads."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def copy() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    return 2 * nbytes / _median(copy, repeat) / 1e9


def _beside_copies(device: torch.device, nbytes: int, measure: Callable[[], float]) -> float:
    """`measure()` while a thread copies `nbytes` host -> `device` back to back (pinned on CUDA; on a CPU, a memcpy
    between two host buffers), until it returns."""
    pinned = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stop = threading.Event()

    def copies() -> None:
        stream = torch.cuda.Stream(device) if pinned else None
        while not stop.is_set():
            if stream is not None:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                stream.synchronize()
            else:
                dst.copy_(src)

    t = threading.Thread(target=copies, daemon=True)
    t.start()
    try:
        return measure()
    finally:
        stop.set()
        t.join()


def _optimizer_rates(params: int, compute_dtype: str, repeat: int) -> tuple[float, ...]:
    """params/s of a plain fused AdamW, the replicated layout's step and the compact one with fp32, bf16 and
    8-bit moments."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(params, generator=gen) * 0.02
    grad = (torch.randn(params, generator=gen) * 1e-3).to(DTYPES[compute_dtype])
    return (_plain_adam_rate(weights, grad, repeat),
            host_state_rate(HostMemory.REPLICATED, weights, grad, compute_dtype, repeat),
            *(host_state_rate(HostMemory.COMPACT, weights, grad, compute_dtype, repeat, optimizer_state=s)
              for s in (OptimizerState.FP32, OptimizerState.BF16, OptimizerState.INT8)))


def measure_rates(device: torch.device, *, threads: int, compute_dtype: str, repeat: int = 5,
                  copy_bytes: int | None = None, small_copy_bytes: int = SMALL_COPY_BYTES,
                  optim_params: int = OPTIM_PARAMS, when: str = "") -> HostRates:
    """Measure copies between host and `device` and the host optimizer at `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if device.type == "cuda":
            nbytes = copy_bytes or COPY_BYTES
            up, down, both, latency = _cuda_copies(device, nbytes, small_copy_bytes, repeat)
            where = f"{device} ({torch.cuda.get_device_name(device)})"
        else:
            nbytes = copy_bytes or CPU_COPY_BYTES
            up, down, both, latency = _cpu_copies(nbytes, small_copy_bytes, repeat)
            where = "cpu (host memcpy)"
        adam, replicated, compact, compact_bf16, compact_8bit = _optimizer_rates(optim_params, compute_dtype, repeat)
        mem = host_mem_gbps(max(4 * nbytes, 256 * MIB), repeat)
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(optim_params, generator=gen) * 0.02
        g = (torch.randn(optim_params, generator=gen) * 1e-3).to(DTYPES[compute_dtype])
        beside = _beside_copies(device, nbytes, lambda: host_state_rate(HostMemory.COMPACT, w, g, compute_dtype,
                                                                         repeat))
    finally:
        torch.set_num_threads(before)
    return HostRates(device=where, threads=threads, h2d_gbps=up / 1e9, d2h_gbps=down / 1e9, bidir_gbps=both / 1e9,
                     copy_latency_s=latency, adam_params_per_s=adam, replicated_params_per_s=replicated,
                     compact_params_per_s=compact, compact_bf16_params_per_s=compact_bf16,
                     compact_8bit_params_per_s=compact_8bit, host_mem_gbps=mem,
                     compact_beside_copies_params_per_s=beside, copy_bytes=nbytes, small_copy_bytes=small_copy_bytes,
                     optim_params=optim_params, compute_dtype=compute_dtype, repeat=repeat, when=when)
