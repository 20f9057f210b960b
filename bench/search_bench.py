"""Search speed (docs/performance.md): `tinypipe search` for llama-3.1-70b on rtx4090x8-pcie4 and llama-3.1-8b on
rtx4090x1, each with its wall time, candidates evaluated per second and the winner.

    python bench/search_bench.py [--workers N]

Writes bench/results/search.json.
"""

from __future__ import annotations

import argparse
import os
import time

from _common import write_json

from tinypipe.common.table import gib, render
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.target import Target
from tinypipe.describe.workload import Workload
from tinypipe.search.policy_search import SearchTarget, search
from tinypipe.sim.evaluate import SimEvaluator

CASES = (("llama-3.1-70b", "rtx4090x8-pcie4"), ("llama-3.1-8b", "rtx4090x1"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-sequences", type=int, default=32)
    args = ap.parse_args()
    rows = []
    for model_name, hw_name in CASES:
        model, hw = load_model(model_name), load_hardware(hw_name)
        work = Workload(model=model, seq_len=args.seq_len, batch_tokens=args.batch_sequences * args.seq_len)
        w = SearchTarget(work, Target(hardware=hw))
        t0 = time.perf_counter()
        r = search(w, SimEvaluator(model, hw, args.seq_len), workers=args.workers)
        wall = time.perf_counter() - t0
        win = r.winner
        simulated = len(r.ranked) - r.rejected
        rows.append({"model": model_name, "hardware": hw_name, "wall_s": wall, "considered": r.considered,
                     "simulated": simulated, "pruned": r.pruned, "rejected_by_memory_bound": r.rejected,
                     "simulated_per_s": simulated / wall,
                     "winner": win.to_json() if win else None, "advice": r.advice})
    print(f"search, {args.batch_sequences} x {args.seq_len} tokens per step, {args.workers} worker processes\n")
    print(render(["model", "hardware", "wall s", "considered", "simulated", "pruned", "rejected", "simulated/s",
                  "best tokens/s", "peak GPU"],
                 [[r["model"], r["hardware"], round(r["wall_s"], 1), r["considered"], r["simulated"], r["pruned"],
                   r["rejected_by_memory_bound"], round(r["simulated_per_s"], 1),
                   round(r["winner"]["tokens_per_s"]) if r["winner"] else "nothing fits",
                   gib(r["winner"]["peak_gpu_bytes"]) if r["winner"] else "-"] for r in rows],
                 align="llrrrrrrrr"))
    for r in rows:
        for line in r["advice"]:
            print(f"{r['model']} on {r['hardware']}: {line}")
    write_json("search.json", {"workers": args.workers, "seq_len": args.seq_len,
                               "batch_sequences": args.batch_sequences, "cases": rows})


if __name__ == "__main__":
    main()
