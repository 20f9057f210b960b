"""What one decoder block costs on this GPU, as a recomputing schedule runs it (lora_block.py, moe_block.py).

`time_block` times the forward (no autograd: a FWD) and the recompute backward (the forward again with autograd,
then the backward: a BWD), CUDA-event medians over `repeat` runs after `warmup`, and the first of each with
whatever compiling it does."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


def timeit(fn: Callable[[], Any], warmup: int, repeat: int) -> float:
    """The median seconds of `fn` on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def time_block(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor,
               trained: Iterable[torch.nn.Parameter], *, warmup: int, repeat: int,
               ctx: Callable[[], AbstractContextManager[Any]] = nullcontext) -> dict[str, float]:
    """{fwd_ms, recompute_bwd_ms, first_s} of the block `fn` on input `x`, `dy` the output's gradient; the
    gradients of `trained` are dropped after each backward; `ctx` wraps each call (e.g. autocast)."""
    params = list(trained)

    def fwd() -> None:
        with torch.no_grad(), ctx():
            fn(x)

    def bwd() -> None:
        xin = x.detach().requires_grad_()
        with ctx():
            out = fn(xin)
        out.backward(dy)
        for p in params:
            p.grad = None

    t0 = time.perf_counter()
    fwd()
    bwd()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    return {"fwd_ms": 1e3 * timeit(fwd, warmup, repeat), "recompute_bwd_ms": 1e3 * timeit(bwd, warmup, repeat),
            "first_s": first}
