"""The compact layout's optimizer step against a plain fused AdamW, on CPU (DESIGN §1.2).

    python bench/compact_optim.py [--params N] [--repeat 7] [--chunks 65536,262144,...] [--threads 16,2]
                                  [--out compact_optim.json] [--append]

For `--params` fp32 parameters (default 64M), at os.cpu_count() threads and at 2 threads, the median
of `--repeat` timings of:
  plain        torch.optim.AdamW(fused=True).step() on an fp32 master (what `replicated` runs)
  cast         a plain fp32 -> bf16 cast of that master (what `replicated` adds to refresh its
               upload copy after each step; `compact` uploads its high plane as it is)
  unfused-strided  join with strided copies, fused AdamW, split with strided copies, each over the
               whole tensor (the DESIGN's measured method, behind COMPACT_OPTIM_FACTOR)
  unfused      backends.planes.unfused_compact_adamw_step: the same three whole passes, vectorized
  join, split  the vectorized whole-tensor join and split alone
  chunked-K    backends.planes.compact_adamw_step with chunks of K elements
  strided-K    the same with moves="strided" (each chunk joined and split by two strided copies)
Variants run interleaved (round-robin, order rotated each round) so that a noisy shared machine
disturbs them alike; ratios are to `plain` measured in the same run. Writes
bench/results/compact_optim.json (`--append` adds this run to the runs already there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import RESULTS, machine
from tinypipe.backends.planes import (
    DEFAULT_CHUNK_ELEMS,
    compact_adamw_step,
    join,
    split,
    unfused_compact_adamw_step,
    workspace_elems,
)

HYPER = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
DEFAULT_CHUNKS = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)


def variants(n: int, chunks: tuple[int, ...]) -> dict[str, Callable[[], object]]:
    """One closure per variant, each on its own state (the gradient is shared, read only)."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=g) * 1e-3
    master = torch.randn(n, generator=g)

    param = torch.nn.Parameter(master.clone())
    param.grad = grad
    opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], fused=True)
    upload = torch.empty(n, dtype=torch.bfloat16)

    def compact_state() -> dict[str, Any]:
        hi, lo = torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.int16)
        split(master, hi, lo)
        return {"hi": hi, "lo": lo, "m": torch.zeros(n), "v": torch.zeros(n), "step": 0}

    def stepper(state: dict[str, Any], fn: Callable[..., None], **kw: Any) -> Callable[[], None]:
        def run() -> None:
            state["step"] += 1
            fn(state["hi"], state["lo"], grad, state["m"], state["v"], step=state["step"], **HYPER, **kw)
        return run

    whole = torch.empty(n)  # the unfused variants' fp32 join buffer, allocated once (in their favour)
    strided = compact_state()
    unfused = compact_state()
    chunked = compact_state()  # the chunk sizes share one state: same work, different chunking
    planes = compact_state()
    out: dict[str, Callable[[], object]] = {
        "plain": opt.step,
        "cast": lambda: upload.copy_(param.detach()),
        "unfused-strided": stepper(strided, _strided_unfused, master=whole),
        "unfused": stepper(unfused, unfused_compact_adamw_step, master=whole),
        "join": lambda: join(planes["hi"], planes["lo"], whole),
        "split": lambda: split(whole, planes["hi"], planes["lo"]),
    }
    for c in chunks:
        out[f"chunked-{_k(c)}"] = stepper(chunked, compact_adamw_step, chunk_elems=c,
                                           scratch=torch.empty(workspace_elems(c)))
        out[f"strided-{_k(c)}"] = stepper(chunked, compact_adamw_step, chunk_elems=c,
                                           scratch=torch.empty(workspace_elems(c)), moves="strided")
    return out


def _strided_unfused(hi: torch.Tensor, lo: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
                     step: int, master: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float) -> None:
    """Join with strided copies, fused AdamW, split with strided copies (DESIGN §1.2's measurement)."""
    words = master.view(torch.int16).view(-1, 2)
    words[:, 0].copy_(lo)
    words[:, 1].copy_(hi)
    torch._fused_adamw_([master], [grad], [m], [v], [], [torch.tensor(float(step))], lr=lr, beta1=beta1,
                        beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    hi.copy_(words[:, 1])
    lo.copy_(words[:, 0])


def measure(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, list[float]]:
    """Seconds per call of each variant: one untimed warm-up round, then `repeat` interleaved rounds."""
    names = list(fns)
    for name in names:
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def _k(elems: int) -> str:
    return f"{elems >> 20}M" if elems % (1 << 20) == 0 else f"{elems >> 10}K"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=64 * 2**20)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--chunks", default=",".join(str(c) for c in DEFAULT_CHUNKS))
    ap.add_argument("--threads", default="", help="comma-separated thread counts (default: cpu count, 2)")
    ap.add_argument("--out", default="compact_optim.json")
    ap.add_argument("--append", action="store_true", help="add this run to the runs already in --out")
    args = ap.parse_args()
    chunks = tuple(int(c) for c in args.chunks.split(","))
    fns = variants(args.params, chunks)
    cpus = os.cpu_count() or 1
    by_threads: list[dict[str, Any]] = []
    counts = tuple(int(t) for t in args.threads.split(",")) if args.threads else (cpus, 2)
    for threads in dict.fromkeys(counts):
        torch.set_num_threads(threads)
        load_before = os.getloadavg()
        times = measure(fns, args.repeat)
        load_after = os.getloadavg()
        med = {name: statistics.median(ts) for name, ts in times.items()}
        plain = med["plain"]
        rows = {name: {"median_s": med[name], "ratio_to_plain": med[name] / plain,
                       "ratio_to_plain_plus_cast": med[name] / (plain + med["cast"]), "times_s": times[name]}
                for name in times}
        by_threads.append({"threads": threads, "loadavg_1m_before_after": [load_before[0], load_after[0]],
                           "variants": rows})
        print(f"\n{args.params / 2**20:.0f}M params, {threads} threads, median of {args.repeat} "
              f"(1-min load {load_before[0]:.1f} -> {load_after[0]:.1f})")
        print(f"{'variant':18s} {'median s':>9s} {'x plain':>8s} {'x (plain+cast)':>15s}")
        for name in rows:
            mark = " (default)" if name == f"chunked-{_k(DEFAULT_CHUNK_ELEMS)}" else ""
            print(f"{name:18s} {med[name]:9.4f} {med[name] / plain:8.2f} {med[name] / (plain + med['cast']):15.2f}"
                  f"{mark}")
    run = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "params": args.params, "repeat": args.repeat, "hyper": HYPER, "default_chunk_elems": DEFAULT_CHUNK_ELEMS,
           "by_threads": by_threads}
    path = RESULTS / args.out
    runs: list[dict[str, Any]] = []
    if args.append and path.exists():
        runs = json.loads(path.read_text()).get("runs", [])
    runs.append({"machine": machine(), **run})
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
