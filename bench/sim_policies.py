"""tinypipe (searched) against mobius and resident, simulated, on every shipped hardware preset for
three models. Writes bench/results/sim_policies.json and prints the table of docs/performance.md.

    python bench/sim_policies.py [--models a,b,c] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import time

from _common import write_json

from tinypipe.common.errors import TinypipeError
from tinypipe.common.table import render
from tinypipe.describe.hardware import load_hardware, shipped_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.target import Target
from tinypipe.describe.trace import trace_for
from tinypipe.describe.workload import Workload
from tinypipe.policy import PRESETS
from tinypipe.search.policy_search import SearchTarget, search
from tinypipe.sim.evaluate import SimEvaluator
from tinypipe.sim.guard import simulate_policy


def _preset(name: str, model, hw, seq_len: int, batch: int) -> dict:
    p = PRESETS[name].replace(microbatches=batch)
    trace = trace_for(model, hw.gpus[0], microbatch_size=p.microbatch_size, seq_len=seq_len)
    try:
        _, r = simulate_policy(p, model, hw, trace, iterations=3)
    except TinypipeError as exc:
        return {"fits": False, "why": str(exc), "tokens_per_s": 0.0}
    return {"fits": r.fits, "why": r.violation or "", "tokens_per_s": r.tokens_per_s,
            "peak_gpu_bytes": r.peak_gpu_bytes, "peak_host_bytes": r.peak_host_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-1.7b,llama-3.1-8b,llama-3.1-70b")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-sequences", type=int, default=32)
    args = ap.parse_args()
    rows = []
    t0 = time.perf_counter()
    for model_name in args.models.split(","):
        model = load_model(model_name)
        for hw_name in shipped_hardware():
            hw = load_hardware(hw_name)
            row = {"model": model_name, "hardware": hw_name}
            for name in ("resident", "mobius", "tinypipe"):
                row[name] = _preset(name, model, hw, args.seq_len, args.batch_sequences)
            work = Workload(model=model, seq_len=args.seq_len, batch_tokens=args.batch_sequences * args.seq_len)
            w = SearchTarget(work, Target(hardware=hw))
            s = search(w, SimEvaluator(model, hw, args.seq_len), workers=args.workers)
            row["searched"] = s.winner.to_json() if s.winner else {"fits": False, "why": "; ".join(s.advice),
                                                                   "tokens_per_s": 0.0}
            rows.append(row)
            print(f"  {model_name} on {hw_name}: done ({time.perf_counter() - t0:.0f} s)", flush=True)

    def cell(d: dict) -> str:
        return f"{d['tokens_per_s']:,.0f}" if d.get("fits") else "does not fit"

    def ratio(d: dict, base: dict) -> str:
        if not d.get("fits") or not base.get("fits") or not base["tokens_per_s"]:
            return "-"
        return f"{d['tokens_per_s'] / base['tokens_per_s']:.2f}x"

    print(f"\nsimulated tokens/s, {args.batch_sequences} x {args.seq_len} tokens per step\n")
    print(render(["model", "hardware", "resident", "mobius", "tinypipe preset", "tinypipe searched",
                  "searched / mobius"],
                 [[r["model"], r["hardware"], cell(r["resident"]), cell(r["mobius"]), cell(r["tinypipe"]),
                   cell(r["searched"]), ratio(r["searched"], r["mobius"])] for r in rows], align="llrrrrr"))
    write_json("sim_policies.json", {"seq_len": args.seq_len, "batch_sequences": args.batch_sequences,
                                     "rows": rows, "wall_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
