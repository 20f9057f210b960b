"""Host AdamW speed per optimizer-state precision and thread count, beside torch's fused fp32 AdamW.

For N parameters (one tensor; default 16M) and each thread count, the best of `--repeat` timed steps of:
`fused` (torch.optim.AdamW(fused=True) on an fp32 tensor: the peers' step), `compact-fp32` (the compact
planes' chunked step, planes.compact_adamw_step), `compact-bf16` and `compact-8bit` (moments.lowp_adamw_step),
and with `--torchao` torchao's `AdamW8bit` on an fp32 tensor (a reference point: it runs on parameters, not
on the planes; its first step compiles). The variants are timed in turns, round after round, so a noisy
shared host slows each alike. Each step is timed by the wall clock and by the process's CPU time (all its
threads): at 1 thread the CPU time is the step's own work, which a shared, loaded VM measures steadily while
its wall clock also counts the time other tenants held the core; at more threads it also counts OpenMP's
idle spinning, so there the wall clock is the figure. Prints a table of G params/s and writes
bench/results/host_optim_precision.json (or --out); the state factors (each low-precision step's time over
compact-fp32's at `--factor-threads`, default 1: the per-core cost, by CPU time at 1 thread, else by wall
clock) are what `tinypipe.estimate.hostmem.STATE_TIME_FACTOR` holds. The low-precision steps spread chunks
over a pool of threads, fused AdamW spreads each operator: both scale with cores.

    python bench/host_optim_precision.py [--params 16777216] [--threads 1 2] [--repeat 5] [--torchao] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinypipe.backends import moments, planes  # noqa: E402

from bench._common import machine, write_json  # noqa: E402
from tinypipe.estimate.hostmem import QUANT_BLOCK_ELEMS  # noqa: E402
from tinypipe.policy.modes import OptimizerState  # noqa: E402

HP = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def steppers(n: int, torchao: bool = False) -> dict[str, Callable[[int], None]]:
    """name -> one step (1-based number) of that variant on its own n-parameter state."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=gen) * 0.02
    g = torch.randn(n, generator=gen) * 1e-3
    out: dict[str, Callable[[int], None]] = {}
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    opt = torch.optim.AdamW([p], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], fused=True)
    out["fused"] = lambda t: opt.step()
    hi, lo = torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.int16)
    planes.split(w, hi, lo)
    m, v = torch.zeros(n), torch.zeros(n)
    scratch = torch.empty(planes.workspace_elems(), dtype=torch.float32)
    out["compact-fp32"] = lambda t: planes.compact_adamw_step(hi, lo, g, m, v, step=t, scratch=scratch, **HP)
    for state in (OptimizerState.BF16, OptimizerState.INT8):
        h2, l2 = hi.clone(), lo.clone()
        held = moments.zero_state(n, state)
        ws = torch.empty(moments.workspace_elems(), dtype=torch.float32)

        def step(t: int, h2: torch.Tensor = h2, l2: torch.Tensor = l2, held: dict[str, torch.Tensor] = held,
                 ws: torch.Tensor = ws, state: OptimizerState = state) -> None:
            moments.lowp_adamw_step(h2, l2, g, held, state=state, step=t, scratch=ws, **HP)

        out[f"compact-{state}"] = step
    if torchao:
        from torchao.optim import AdamW8bit  # not a dependency: pip install torchao

        q = torch.nn.Parameter(w.clone())
        q.grad = g.clone()
        ao = AdamW8bit([q], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                       weight_decay=HP["weight_decay"], block_size=QUANT_BLOCK_ELEMS)
        out["torchao-8bit"] = lambda t: ao.step()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=1 << 24)
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and all cores")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--factor-threads", type=int, default=1, help="thread count the state factors are taken at")
    ap.add_argument("--torchao", action="store_true", help="also time torchao's AdamW8bit (needs torchao)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/host_optim_precision.json)")
    a = ap.parse_args(argv)
    cores = torch.get_num_threads()
    threads = a.threads or sorted({1, cores})
    rows = []
    for th in threads:
        torch.set_num_threads(th)
        steps = steppers(a.params, a.torchao)
        wall = {name: float("inf") for name in steps}
        cpu = dict(wall)
        for fn in steps.values():  # warm-up: first touch of every buffer (torchao: its compile)
            fn(1)
        for rep in range(a.repeat):
            for name, fn in steps.items():
                c0, t0 = time.process_time(), time.perf_counter()
                fn(rep + 2)
                wall[name] = min(wall[name], time.perf_counter() - t0)
                cpu[name] = min(cpu[name], time.process_time() - c0)
        for name, s in wall.items():
            rows.append({"threads": th, "variant": name, "best_s": s, "gparams_per_s": a.params / s / 1e9,
                         "best_cpu_s": cpu[name], "cpu_gparams_per_s": a.params / cpu[name] / 1e9})
        del steps
    top = a.factor_threads if a.factor_threads in threads else max(threads)
    basis = "best_cpu_s" if top == 1 else "best_s"
    at = {r["variant"]: r[basis] for r in rows if r["threads"] == top}
    factors = {k: at[f"compact-{k}"] / at["compact-fp32"] for k in ("bf16", "8bit")}
    vs_fused = {k: at[k] / at["fused"] for k in at}
    print(f"{'threads':>7} {'variant':>14} {'G params/s':>11} {'by CPU time':>12}")
    for r in rows:
        print(f"{r['threads']:>7} {r['variant']:>14} {r['gparams_per_s']:>11.3f} {r['cpu_gparams_per_s']:>12.3f}")
    print(f"state time factors over compact-fp32 at {top} threads ({basis}): "
          + ", ".join(f"{k} {v:.2f}" for k, v in factors.items()))
    payload = {"params": a.params, "repeat": a.repeat, "hyperparameters": HP, "rows": rows,
               "state_time_factor": factors, "time_over_fused": vs_fused, "factor_threads": top,
               "factor_basis": basis, "chunk_elems": {"compact-fp32": planes.DEFAULT_CHUNK_ELEMS,
                                                      "compact-lowp": moments.DEFAULT_CHUNK_ELEMS}}
    if a.out:
        Path(a.out).write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
        print(f"wrote {a.out}")
    else:
        print(f"wrote {write_json('host_optim_precision.json', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
