"""What the gradient norm in metrics.jsonl costs the host optimizer: one pass over each layer's gradients.

    python bench/grad_norm_cost.py

`HostState.step` adds the squared norm of a layer's fp32 gradients (`torch.linalg.vector_norm`) to its
step's total before the AdamW update. This times that pass beside torch's fused AdamW step on the same
tensors, at the thread count one rank of `tinypipe run` gets on this machine, for layers of 1 M, 4 M
and 16 M parameters (median of 7), and writes bench/results/grad_norm_cost.json.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from _common import machine, write_json

from tinypipe.backends.options.settings import rank_threads

SIZES = (1 << 20, 1 << 22, 1 << 24)
REPEAT = 7


def median_s(fn: object, repeat: int = REPEAT) -> float:
    assert callable(fn)
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    threads = rank_threads("cpu", 2, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    rows = []
    for n in SIZES:
        p = torch.zeros(n, requires_grad=True)
        p.grad = torch.randn(n)
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        adamw = median_s(opt.step)
        norm = median_s(lambda: float(torch.linalg.vector_norm(p.grad, dtype=torch.float32)))  # noqa: B023
        rows.append({"params": n, "adamw_s": adamw, "norm_s": norm, "norm_over_adamw": norm / adamw})
        print(f"{n:>12,} params: fused AdamW {adamw * 1e3:8.2f} ms, gradient norm {norm * 1e3:7.2f} ms "
              f"({norm / adamw:.1%} of the step)")
    path = write_json("grad_norm_cost.json", {"threads": threads, "rows": rows, "machine": machine()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
