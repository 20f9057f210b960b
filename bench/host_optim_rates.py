"""The host optimizer's rate as `tinypipe run` uses it: one process per rank, each stepping its own
layers on its own thread pool (cores / ranks - 1 threads on CUDA), all ranks at once.

    python bench/host_optim_rates.py [--params N] [--ranks 1,2] [--steps 5] [--out FILE]

For each rank count R in `--ranks`, R processes start together (a barrier), each holding one layer
of `--params` parameters (default 218,112,000: one Llama-3.1-8B block) in a HostState of each
layout, and each times `--steps` optimizer steps of it with `tinypipe profile`'s own measurement
(`backends.profile.rates.host_state_rate`: `HostState.step`, what an OPT_STEP runs, bf16 gradients,
after one untimed step that allocates the AdamW moments). Reported: params/s of each rank (median
step) and of all ranks together. bench/results/host_optim_rates_h200x1.json was written by the first
version of this script (commit 7cd45a4), which stepped the planes and the fused AdamW
directly rather than through HostState. The simulator's
`host.adam_params_per_s` and `hostmem.optimizer_time_factor` are one rate for the whole host; the
replay of 2x H200 runs (bench/results/replay_h200.json) measured a compact step of an 8B block at
2.7x that prediction with two ranks stepping at once. This measures the rates apart from any run.
Writes bench/results/host_optim_rates.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

BLOCK_PARAMS = 218_112_000  # Llama-3.1-8B decoder block


def _worker(rank: int, params: int, steps: int, layout: str, threads: int, barrier: Any, out: Any) -> None:
    from tinypipe.backends.profile.rates import host_state_rate

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(rank)
    weights = torch.randn(params, generator=g) * 0.02
    grad = (torch.randn(params, generator=g) * 1e-3).to(torch.bfloat16)
    barrier.wait()  # every rank steps at once
    out.put((rank, host_state_rate(layout, weights, grad, "bf16", steps)))


def measure(ranks: int, params: int, steps: int, layout: str) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    threads = max(1, cores // ranks - 1)
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, params, steps, layout, threads, barrier, out))
             for r in range(ranks)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    per_rank = [got[r] for r in range(ranks)]
    return {"layout": layout, "ranks": ranks, "threads_per_rank": threads, "params_per_rank": params,
            "params_per_s_each_rank": per_rank,
            "params_per_s_total": sum(per_rank)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=BLOCK_PARAMS)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layouts", default="compact,replicated")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "host_optim_rates.json"))
    a = ap.parse_args()
    rows = []
    for layout in a.layouts.split(","):
        for r in (int(x) for x in a.ranks.split(",")):
            row = measure(r, a.params, a.steps, layout)
            rows.append(row)
            print(f"{layout:10s} ranks {r}  threads/rank {row['threads_per_rank']:3d}  "
                  f"per rank {', '.join(f'{x / 1e9:.2f}' for x in row['params_per_s_each_rank'])} G params/s  "
                  f"total {row['params_per_s_total'] / 1e9:.2f} G params/s", flush=True)
    from _common import machine

    Path(a.out).write_text(json.dumps({"machine": machine(), "cpus": os.cpu_count(), "runs": rows}, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
