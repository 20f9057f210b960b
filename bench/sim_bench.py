"""Simulator speed: wall time and SimPy events per second to simulate 3 iterations of llama-3.1-70b on
rtx4090x8-pcie4 with 32 microbatches of 1 x 2048 tokens, for each policy preset (target: < 1 s).

    python bench/sim_bench.py [--repeat N] [--profile]

Compiling is timed apart and not counted. Each simulation runs `--repeat` times; the table shows the
best and the median wall time. `--profile` prints the top of a cProfile of one tinypipe simulation.
Writes bench/results/sim.json.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from _common import machine, write_json

from tinypipe import sim
from tinypipe.common.table import render
from tinypipe.compiler import compile_schedule
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.trace import trace_for
from tinypipe.policy import PRESETS

MODEL, HARDWARE, SEQ_LEN, MICROBATCHES, ITERATIONS = "llama-3.1-70b", "rtx4090x8-pcie4", 2048, 32, 3
TARGET_S = 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    model, hw = load_model(MODEL), load_hardware(HARDWARE)
    rows = []
    for name in ("tinypipe", "mobius", "resident"):
        policy = PRESETS[name].replace(microbatches=MICROBATCHES)
        trace = trace_for(model, hw.gpus[0], microbatch_size=policy.microbatch_size, seq_len=SEQ_LEN)
        t0 = time.perf_counter()
        sched = compile_schedule(policy, model, hw, trace, iterations=ITERATIONS)
        compile_s = time.perf_counter() - t0
        walls = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            res = sim.simulate(sched, model, hw, trace, on_capacity="record")
            walls.append(time.perf_counter() - t0)
        best, median = min(walls), statistics.median(walls)
        rows.append({"policy": name, "actions": len(sched.actions), "events": res.events, "compile_s": compile_s,
                     "sim_wall_best_s": best, "sim_wall_median_s": median, "events_per_s": res.events / best,
                     "actions_per_s": len(sched.actions) / best, "simulated_iteration_s": res.iteration_s,
                     "tokens_per_s": res.tokens_per_s, "fits": res.fits, "meets_target": best < TARGET_S})
        if args.profile and name == "tinypipe":
            prof = cProfile.Profile()
            prof.runcall(sim.simulate, sched, model, hw, trace, on_capacity="record")
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    print(f"{MODEL} on {HARDWARE}, {MICROBATCHES} microbatches x {SEQ_LEN} tokens, {ITERATIONS} iterations; "
          f"{machine()['cpus']} CPUs; best of {args.repeat}\n")
    print(render(["policy", "actions", "events", "compile s", "sim s (best)", "sim s (median)", "events/s",
                  "actions/s", "< 1 s"],
                 [[r["policy"], r["actions"], r["events"], r["compile_s"], r["sim_wall_best_s"],
                   r["sim_wall_median_s"], round(r["events_per_s"]), round(r["actions_per_s"]), r["meets_target"]]
                  for r in rows]))
    path = write_json("sim.json", {"model": MODEL, "hardware": HARDWARE, "seq_len": SEQ_LEN,
                                   "microbatches": MICROBATCHES, "iterations": ITERATIONS, "target_s": TARGET_S,
                                   "repeat": args.repeat, "results": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
