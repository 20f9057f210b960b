"""Host AdamW speed per optimizer-state precision and thread count: the one-pass kernel beside the torch operators,
torch's fused fp32 AdamW and, where it installs, DeepSpeed's CPU Adam; G params/s and GB/s of DRAM moved.

For N parameters (one tensor; default 16M) and each thread count, the best of `--repeat` timed steps of:
- `torch-fused`: torch.optim.AdamW(fused=True) on an fp32 tensor with an fp32 gradient (the peers' step; 28 B/param);
- `native-fp32`, `native-bf16`, `native-8bit`: the compact planes stepped by the one-pass kernel
  (backends/host/fused_host_adamw.py, what `tinypipe run` uses where it builds), bf16 gradient;
- `torch-fp32`, `torch-bf16`, `torch-8bit`: the same steps with the chunked torch operators (planes.compact_adamw_step,
  moments.lowp_adamw_step: what runs where no C compiler is found);
- `deepspeed-cpu-adam` (where `deepspeed` imports and builds its op) and, with `--torchao`, torchao's AdamW8bit on
  an fp32 tensor (reference points that run on plain fp32 parameters, not on the planes);
- `copy`: this host's copy bandwidth at that thread count (dst.copy_(src), bytes read + written; its writes also
  read each line first, uncounted, so it understates DRAM's bandwidth), and `dram`: an in-place pass over the same
  bytes by the kernel (`fused_host_adamw.memory_gbps`: every byte written was read first, as in the step).
The variants are timed in turns, round after round, so a noisy shared host slows each alike. GB/s is the step's
bytes per parameter (`hostmem.step_bytes_per_param`; 28 for fp32 AdamW on fp32 gradients) times params/s: the
share of `dram`'s GB/s it reaches says how close to the memory-bandwidth floor it runs. Each step is timed by the
wall clock and by the process's CPU time; at more than one thread the wall clock is the figure. Prints a table and
writes bench/results/host_optim_precision.json (or --out); the state factors (each native low-precision step's
time over native-fp32's at `--factor-threads`) are what `tinypipe.estimate.hostmem.STATE_TIME_FACTOR` holds.

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

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after the installed tinypipe: `bench` only

from bench._common import machine, write_json  # noqa: E402
from bench.device.hostbw import copy_gbps, mem_gbps  # noqa: E402
from tinypipe.backends.host import fused_host_adamw, moments, planes  # noqa: E402
from tinypipe.estimate.hostmem import QUANT_BLOCK_ELEMS, step_bytes_per_param  # noqa: E402
from tinypipe.policy.modes import OptimizerState  # noqa: E402

HP = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


FUSED_BYTES_PER_PARAM = 28  # torch's fused AdamW on fp32: param, grad, m, v read (16), param, m, v written (12)


def steppers(n: int, threads: int, torchao: bool = False) -> dict[str, tuple[Callable[[int], None], float]]:
    """name -> (one step (1-based number) of that variant on its own n-parameter state, its bytes per parameter)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=gen) * 0.02
    g = torch.randn(n, generator=gen) * 1e-3
    g16 = g.to(torch.bfloat16)
    out: dict[str, tuple[Callable[[int], None], float]] = {}
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    opt = torch.optim.AdamW([p], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], fused=True)
    out["torch-fused"] = (lambda t: opt.step(), FUSED_BYTES_PER_PARAM)
    if fused_host_adamw.kernel() is not None:
        for state in OptimizerState:
            out[f"native-{state}"] = (_native(w, g16, state, threads), step_bytes_per_param(state))
    for state in OptimizerState:
        out[f"torch-{state}"] = (_torch_ops(w, g16, state, threads), step_bytes_per_param(state))
    ds = _deepspeed(w, g)
    if ds is not None:
        out["deepspeed-cpu-adam"] = (ds, FUSED_BYTES_PER_PARAM)
    if torchao:
        from torchao.optim import AdamW8bit  # not a dependency: pip install torchao

        q = torch.nn.Parameter(w.clone())
        q.grad = g.clone()
        ao = AdamW8bit([q], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                       weight_decay=HP["weight_decay"], block_size=QUANT_BLOCK_ELEMS)
        out["torchao-8bit"] = (lambda t: ao.step(), 4 + 4 + 2 + 4 + 2 * 2)
    return out


def _planes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi, lo = torch.empty(w.numel(), dtype=torch.int16), torch.empty(w.numel(), dtype=torch.int16)
    planes.split(w, hi, lo)
    return hi, lo


def _native(w: torch.Tensor, g: torch.Tensor, state: OptimizerState, threads: int) -> Callable[[int], None]:
    hi, lo = _planes(w)
    held = {k: v.view(-1) for k, v in moments.zero_state(w.numel(), state).items()}

    def step(t: int) -> None:
        hp = fused_host_adamw.Hyper(step=t, **HP)
        if not fused_host_adamw.run([fused_host_adamw.Job(hi, lo, g, held, hp)], state=state, threads=threads):
            raise RuntimeError(f"the one-pass kernel did not run: {fused_host_adamw.unavailable()}")

    return step


def _torch_ops(w: torch.Tensor, g: torch.Tensor, state: OptimizerState, threads: int) -> Callable[[int], None]:
    hi, lo = _planes(w)
    held = moments.zero_state(w.numel(), state)
    if state.exact:
        scratch = torch.empty(planes.workspace_elems(), dtype=torch.float32)
        return lambda t: planes.compact_adamw_step(hi, lo, g, held["exp_avg"], held["exp_avg_sq"], step=t,
                                                   scratch=scratch, **HP)
    ws = torch.empty(moments.workspace_elems(), dtype=torch.float32)
    return lambda t: moments.lowp_adamw_step(hi, lo, g, held, state=state, step=t, scratch=ws, threads=threads,
                                             **HP)


def _deepspeed(w: torch.Tensor, g: torch.Tensor) -> Callable[[int], None] | None:
    """DeepSpeed's CPU Adam (AdamW mode) on an fp32 tensor, where deepspeed imports and builds its op; else None."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]  # not a dependency

        d = torch.nn.Parameter(w.clone())
        d.grad = g.clone()
        ds = DeepSpeedCPUAdam([d], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                              weight_decay=HP["weight_decay"], adamw_mode=True)
        ds.step()
    except Exception as exc:  # noqa: BLE001 - not installed, or its op does not build here: say so and go on
        print(f"deepspeed-cpu-adam: not measured ({type(exc).__name__}: {str(exc)[:120]})")
        return None
    return lambda t: ds.step()


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
    print(f"host kernel: {fused_host_adamw.name()}" + (f" ({fused_host_adamw.unavailable()})"
                                                       if fused_host_adamw.unavailable() else ""))
    rows = []
    for th in threads:
        torch.set_num_threads(th)
        steps = steppers(a.params, th, a.torchao)
        wall = {name: float("inf") for name in steps}
        cpu = dict(wall)
        for fn, _ in steps.values():  # warm-up: first touch of every buffer (torchao: its compile)
            fn(1)
        for rep in range(a.repeat):
            for name, (fn, _) in steps.items():
                c0, t0 = time.process_time(), time.perf_counter()
                fn(rep + 2)
                wall[name] = min(wall[name], time.perf_counter() - t0)
                cpu[name] = min(cpu[name], time.process_time() - c0)
        copy = copy_gbps(max(4 * a.params, 256 << 20), repeat=a.repeat, threads=th)
        dram = mem_gbps(max(4 * a.params, 256 << 20), repeat=a.repeat, threads=th)
        for name, s in wall.items():
            rate = a.params / s
            gbps = rate * steps[name][1] / 1e9
            rows.append({"threads": th, "variant": name, "best_s": s, "gparams_per_s": rate / 1e9,
                         "best_cpu_s": cpu[name], "cpu_gparams_per_s": a.params / cpu[name] / 1e9,
                         "bytes_per_param": steps[name][1], "gbps": gbps, "of_copy_bandwidth": gbps / copy,
                         "of_dram_bandwidth": gbps / dram})
        rows.append({"threads": th, "variant": "copy", "gbps": copy, "of_copy_bandwidth": 1.0,
                     "of_dram_bandwidth": copy / dram})
        rows.append({"threads": th, "variant": "dram", "gbps": dram, "of_copy_bandwidth": dram / copy,
                     "of_dram_bandwidth": 1.0})
        del steps
    top = a.factor_threads if a.factor_threads in threads else max(threads)
    basis = "best_cpu_s" if top == 1 else "best_s"
    at = {r["variant"]: r[basis] for r in rows if r["threads"] == top and basis in r}
    prefix = "native" if "native-fp32" in at else "torch"
    factors = {k: at[f"{prefix}-{k}"] / at[f"{prefix}-fp32"] for k in ("bf16", "8bit")}
    vs_fused = {k: at[k] / at["torch-fused"] for k in at}
    print(f"{'threads':>7} {'variant':>18} {'G params/s':>11} {'by CPU time':>12} {'B/param':>8} {'GB/s':>7} "
          f"{'of copy':>8} {'of DRAM':>8}")
    for r in rows:
        if r["variant"] in ("copy", "dram"):
            print(f"{r['threads']:>7} {r['variant']:>18} {'':>11} {'':>12} {'':>8} {r['gbps']:>7.1f} "
                  f"{r['of_copy_bandwidth']:>8.0%} {r['of_dram_bandwidth']:>8.0%}")
            continue
        print(f"{r['threads']:>7} {r['variant']:>18} {r['gparams_per_s']:>11.3f} {r['cpu_gparams_per_s']:>12.3f} "
              f"{r['bytes_per_param']:>8.2f} {r['gbps']:>7.1f} {r['of_copy_bandwidth']:>8.0%} "
              f"{r['of_dram_bandwidth']:>8.0%}")
    print(f"state time factors over {prefix}-fp32 at {top} threads ({basis}): "
          + ", ".join(f"{k} {v:.2f}" for k, v in factors.items()))
    payload = {"params": a.params, "repeat": a.repeat, "hyperparameters": HP, "host_kernel": fused_host_adamw.name(),
               "rows": rows, "state_time_factor": factors, "state_time_factor_of": prefix,
               "time_over_fused": vs_fused, "factor_threads": top, "factor_basis": basis,
               "chunk_elems": {"torch-fp32": planes.DEFAULT_CHUNK_ELEMS, "torch-lowp": moments.DEFAULT_CHUNK_ELEMS}}
    if a.out:
        Path(a.out).write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
        print(f"wrote {a.out}")
    else:
        print(f"wrote {write_json('host_optim_precision.json', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
