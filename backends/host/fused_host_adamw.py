"""The host optimizer's one-pass kernel: AdamW on the compact planes with fp32, bf16 or 8-bit moments, in C.

`fused_host_adamw.c` reads each element's planes, gradient and moments once and writes the master's planes and
the moments once: the bytes of the step (`hostmem.step_bytes_per_param`) cross DRAM once, where the chunked torch
operators (`planes.compact_adamw_step`, `moments.lowp_adamw_step`) make six to thirty in-cache passes per chunk.
It is built on first use with the machine's C compiler (`cc`, or $CC) for this CPU (-march=native), into the
machine's cache (`hostcal.cache_dir()`, about a second), and called through ctypes, which releases the GIL; a
tensor's ranges run side by side on a pool of threads (`moments.pool`).

fp32 moments: equal to torch's fused CPU AdamW bit for bit (the kernel computes torch's vector lanes; the few
elements torch computes in its scalar tail, `numel % lanes` at the tensor's end, run through torch itself). A
self-check at load compares both on a small tensor and keeps the torch operators if they differ. bf16 and 8-bit
moments: the rules of `moments.py` (round to nearest even; 256-element blocks with the dynamic maps), equal to
its torch operators but for the last few elements of a tensor, which torch computes with other rounding.

`TINYPIPE_HOST_KERNEL=torch` keeps the torch operators (also what runs where no C compiler is found).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tinypipe.estimate.hostcal import cache_dir
from tinypipe.estimate.hostmem import QUANT_BLOCK_ELEMS
from tinypipe.policy.modes import OptimizerState

from . import moments, planes

SOURCE = Path(__file__).with_name("fused_host_adamw.c")
KERNEL_ENV = "TINYPIPE_HOST_KERNEL"  # "native" (default, where it builds) or "torch"
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
# A tensor's range per thread is at least this many elements (a pool hand-off costs ~20 µs: ~50 µs of work
# at 1 ns an element), and starts at a multiple of a quantisation block (also a multiple of every vector width).
MIN_PART_ELEMS = 1 << 16
_GRAD_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# torch's fp32 vector lanes per CPU capability (at::vec::Vectorized<float>::size()); elsewhere its vector
# code is not fused-multiply-add exact, and the self-check keeps the torch operators
_LANES = {"AVX512": 16, "AVX2": 8}


class _Hyper(ctypes.Structure):
    _fields_ = [(name, ctypes.c_float) for name in
                ("decay", "lerp_w", "beta2", "c2", "bc2_sqrt", "eps", "neg_step")]


@dataclass(frozen=True)
class Hyper:
    """One step's hyperparameters (the same for every tensor of a parameter group)."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def native(self) -> _Hyper:
        """The constants as torch's fused kernel rounds them: computed in double, each cast to fp32."""
        bc1 = 1.0 - math.pow(self.beta1, float(self.step))
        bc2 = 1.0 - math.pow(self.beta2, float(self.step))
        decay = 1.0 - self.lr * self.weight_decay if self.weight_decay != 0.0 else 1.0
        return _Hyper(decay, 1.0 - self.beta1, self.beta2, 1.0 - self.beta2, math.sqrt(bc2), self.eps,
                      -(self.lr / bc1))

    def supported(self) -> bool:
        """The kernel computes torch's lerp for a small weight only (|1 - beta1| < 0.5, e.g. beta1 = 0.9)."""
        return abs(1.0 - self.beta1) < 0.5 and self.step >= 1


class _Quantised(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("mq", "vq", "m_absmax", "v_absmax", "m_values", "v_values", "m_table", "v_table")]


class _Kernel:
    """The loaded library and what it needs: the 8-bit maps as tensors kept alive beside their pointers, and
    `fused_v`: whether this torch computes the second moment with one fused multiply-add (the self-check's
    finding; torch 2.13 does)."""

    def __init__(self, lib: ctypes.CDLL, lanes: int) -> None:
        self.lib, self.lanes, self.fused_v = lib, lanes, 1
        vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        hp = ctypes.POINTER(_Hyper)
        lib.tp_adamw_fp32.argtypes = [vp, vp, vp, i32, vp, vp, i64, i64, hp, i32]
        lib.tp_adamw_bf16.argtypes = [vp, vp, vp, i32, vp, vp, i64, i64, hp, i32]
        lib.tp_adamw_8bit.argtypes = [vp, vp, vp, i32, ctypes.POINTER(_Quantised), i64, i64, i64, hp, i32]
        lib.tp_touch.argtypes = [vp, i64, i64, ctypes.c_float]
        lib.tp_sum_squares.argtypes = [vp, i32, i64, i64]
        lib.tp_sum_squares.restype = ctypes.c_double
        for f in (lib.tp_adamw_fp32, lib.tp_adamw_bf16, lib.tp_adamw_8bit, lib.tp_touch):
            f.restype = None
        (self.m_values, m_table), (self.v_values, v_table) = moments.maps(True), moments.maps(False)
        self.m_table, self.v_table = _padded(m_table), _padded(v_table)


def _padded(table: torch.Tensor) -> torch.Tensor:
    """moments.py's nearest-code table with 3 bytes after it: the kernel gathers 4 bytes at a code's offset."""
    out = torch.zeros(table.numel() + 4, dtype=torch.uint8)
    out[:table.numel()] = table.view(-1)
    return out


_LOCK = threading.Lock()
_STATE: dict[str, _Kernel | str] = {}  # "kernel" -> the loaded kernel, or "why" -> why the torch operators run


def kernel() -> _Kernel | None:
    """The built, loaded and self-checked kernel, or None (then `unavailable()` says why)."""
    with _LOCK:
        if "kernel" not in _STATE and "why" not in _STATE:
            try:
                _STATE["kernel"] = _load()
            except _Unavailable as e:
                _STATE["why"] = str(e)
        k = _STATE.get("kernel")
        return k if isinstance(k, _Kernel) else None


def unavailable() -> str | None:
    """Why the torch operators step the host (None: the kernel does)."""
    kernel()
    why = _STATE.get("why")
    return why if isinstance(why, str) else None


def name() -> str:
    """What steps the host: "native" (this kernel) or "torch" (the chunked torch operators)."""
    return "native" if kernel() is not None else "torch"


class _Unavailable(Exception):
    pass


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    return cc if cc and shutil.which(cc) else (shutil.which("cc") or shutil.which("gcc"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path(cc: str) -> Path:
    """Where this source, compiler, flags and CPU build their library in the machine's cache."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), cc, version, " ".join(CFLAGS), platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"fused_host_adamw-{key}.so"


def _load() -> _Kernel:
    if os.environ.get(KERNEL_ENV, "native") == "torch":
        raise _Unavailable(f"{KERNEL_ENV}=torch")
    lanes = _LANES.get(torch.backends.cpu.get_cpu_capability())
    if lanes is None:
        raise _Unavailable(f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()} (not AVX2 / AVX512)")
    cc = _compiler()
    if cc is None:
        raise _Unavailable("no C compiler (cc, gcc or $CC) on the PATH")
    out = library_path(cc)
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        done = subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            raise _Unavailable(f"{cc} could not build {SOURCE.name}: {first}")
        os.replace(tmp, out)
    try:
        k = _Kernel(ctypes.CDLL(str(out)), lanes)
    except OSError as e:
        raise _Unavailable(f"could not load {out}: {e}") from None
    for fused_v in (1, 0):
        k.fused_v = fused_v
        if _self_check(k):
            return k
    raise _Unavailable(f"its fp32 step differs from torch {torch.__version__}'s fused AdamW on this CPU")


def _self_check(k: _Kernel) -> bool:
    """fp32 moments on 1000 elements (a tail included), weight decay on: equal to torch's step bit for bit."""
    gen = torch.Generator().manual_seed(0)
    n = 1000
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    hi, lo = torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.int16)
    planes.split(w, hi, lo)
    m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
    m2, v2, hi2, lo2 = m.clone(), v.clone(), hi.clone(), lo.clone()
    hp = Hyper(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    for call in _fp32_calls(k, hi, lo, g, m, v, hp):
        call()
    _fp32_tail(k, hi, lo, g, m, v, hp)
    planes.compact_adamw_step(hi2, lo2, g, m2, v2, step=hp.step, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2,
                              eps=hp.eps, weight_decay=hp.weight_decay)
    return all(bool(torch.equal(a, b)) for a, b in ((hi, hi2), (lo, lo2), (m, m2), (v, v2)))


def _parts(n: int, threads: int) -> list[tuple[int, int]]:
    """[begin, end) ranges of n elements for `threads` threads, each a multiple of a block long but the last."""
    if n <= 0:
        return []
    b = QUANT_BLOCK_ELEMS
    count = max(1, min(threads, n // MIN_PART_ELEMS))
    per = -(-n // count)  # n / count, rounded up
    size = -(-per // b) * b  # then up to whole blocks
    return [(s, min(n, s + size)) for s in range(0, n, size)]


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _grad(g: torch.Tensor, n: int) -> torch.Tensor:
    if g.dtype not in _GRAD_KIND or g.numel() != n or not g.is_contiguous() or g.device.type != "cpu":
        raise ValueError(f"grad must be a contiguous CPU fp32, bf16 or fp16 tensor of {n} elements, "
                         f"got {g.dtype} with {g.numel()} on {g.device}")
    return g.reshape(-1)


def _fp32_calls(k: _Kernel, hi: torch.Tensor, lo: torch.Tensor, grad: torch.Tensor, m: torch.Tensor,
                v: torch.Tensor, hp: Hyper, threads: int = 1) -> list[Callable[[], None]]:
    n = hi.numel()
    g = _grad(grad, n)
    vec = n - n % k.lanes
    c = hp.native()
    args = (_ptr(hi), _ptr(lo), _ptr(g), _GRAD_KIND[g.dtype], _ptr(m), _ptr(v))
    return [partial(k.lib.tp_adamw_fp32, *args, s, e, ctypes.byref(c), k.fused_v) for s, e in _parts(vec, threads)]


def _fp32_tail(k: _Kernel, hi: torch.Tensor, lo: torch.Tensor, grad: torch.Tensor, m: torch.Tensor,
               v: torch.Tensor, hp: Hyper) -> None:
    """The elements torch's kernel computes in its scalar tail, through torch."""
    n = hi.numel()
    s = n - n % k.lanes
    if s < n:
        g = grad.reshape(-1)
        planes.compact_adamw_step(hi[s:], lo[s:], g[s:], m[s:], v[s:], step=hp.step, lr=hp.lr, beta1=hp.beta1,
                                  beta2=hp.beta2, eps=hp.eps, weight_decay=hp.weight_decay)


def _lowp_calls(k: _Kernel, hi: torch.Tensor, lo: torch.Tensor, grad: torch.Tensor, held: dict[str, torch.Tensor],
                state: OptimizerState, hp: Hyper, threads: int) -> list[Callable[[], None]]:
    n = hi.numel()
    g = _grad(grad, n)
    c = hp.native()
    kind = _GRAD_KIND[g.dtype]
    if state == OptimizerState.BF16:
        args = (_ptr(hi), _ptr(lo), _ptr(g), kind, _ptr(held["exp_avg"]), _ptr(held["exp_avg_sq"]))
        return [partial(k.lib.tp_adamw_bf16, *args, s, e, ctypes.byref(c), k.fused_v) for s, e in _parts(n, threads)]
    q = _Quantised(*(_ptr(t) for t in (held["exp_avg"], held["exp_avg_sq"], held["exp_avg_absmax"],
                                       held["exp_avg_sq_absmax"], k.m_values, k.v_values, k.m_table, k.v_table)))
    b = QUANT_BLOCK_ELEMS
    return [partial(k.lib.tp_adamw_8bit, _ptr(hi), _ptr(lo), _ptr(g), kind, ctypes.byref(q), n, s // b, -(-e // b),
                    ctypes.byref(c), k.fused_v) for s, e in _parts(n, threads)]


def sum_squares(grad: torch.Tensor, threads: int | None = None) -> float | None:
    """The sum of the squares of `grad`'s elements (fp32, bf16 or fp16, contiguous, on the CPU), accumulated in
    double, read once on `threads` threads (default: torch's intra-op threads); None without the kernel. What the
    gradient norm sums per layer: torch's `vector_norm(dtype=float32)` widens a bf16 gradient into a new fp32
    tensor first (on an H100 host, most of an 8B block's step) and sums in fp32."""
    k = kernel()
    if k is None or grad.dtype not in _GRAD_KIND or not grad.is_contiguous() or grad.device.type != "cpu":
        return None
    threads = torch.get_num_threads() if threads is None else max(1, threads)
    calls = [partial(k.lib.tp_sum_squares, _ptr(grad), _GRAD_KIND[grad.dtype], s, e)
             for s, e in _parts(grad.numel(), threads)]
    return float(sum(_side_by_side(calls, threads)))


def memory_gbps(nbytes: int = 1 << 30, repeat: int = 3, threads: int | None = None) -> float | None:
    """This host's DRAM bandwidth as the kernel moves bytes: GB/s read + written by an in-place pass over `nbytes`
    of fp32 on `threads` threads (default: torch's intra-op threads), the best of `repeat` after a first touch;
    None without the kernel."""
    k = kernel()
    if k is None:
        return None
    threads = torch.get_num_threads() if threads is None else max(1, threads)
    x = torch.zeros(nbytes // 4)
    calls = [partial(k.lib.tp_touch, _ptr(x), s, e, ctypes.c_float(0.0)) for s, e in _parts(x.numel(), threads)]
    best = float("inf")
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        _side_by_side(calls, threads)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() * 4 / best / 1e9


def _side_by_side(calls: Sequence[Callable[[], Any]], threads: int) -> list[Any]:
    """Each call's result, the calls run on `threads` threads of `moments.pool` (here, one after another, when
    there is one thread or one call)."""
    if threads <= 1 or len(calls) <= 1:
        return [c() for c in calls]
    pool = moments.pool(threads)
    return [f.result() for f in [pool.submit(c) for c in calls]]


@dataclass
class Job:
    """One parameter tensor's update: its planes, gradient, moments (`moments.state_shapes`) and step."""

    hi: torch.Tensor
    lo: torch.Tensor
    grad: torch.Tensor
    held: dict[str, torch.Tensor]
    hp: Hyper


def run(jobs: list[Job], *, state: OptimizerState, threads: int | None = None) -> bool:
    """Step every job with the kernel, ranges side by side on `threads` threads (default: torch's intra-op
    threads of the caller); False, with nothing changed, where the kernel is unavailable or a job's
    hyperparameters are outside what it computes (the caller then runs the torch operators)."""
    k = kernel()
    if k is None or not all(j.hp.supported() for j in jobs):
        return False
    state = OptimizerState(state)
    threads = torch.get_num_threads() if threads is None else max(1, threads)
    calls: list[Callable[[], Any]] = []
    for j in jobs:
        for t in (j.hi, j.lo):
            if t.dtype != torch.int16 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("planes must be contiguous int16 CPU tensors")
        if state.exact:
            calls += _fp32_calls(k, j.hi, j.lo, j.grad, j.held["exp_avg"], j.held["exp_avg_sq"], j.hp, threads)
        else:
            calls += _lowp_calls(k, j.hi, j.lo, j.grad, j.held, state, j.hp, threads)
    _side_by_side(calls, threads)
    if state.exact:
        for j in jobs:
            _fp32_tail(k, j.hi, j.lo, j.grad, j.held["exp_avg"], j.held["exp_avg_sq"], j.hp)
    return True
