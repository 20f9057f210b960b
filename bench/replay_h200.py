"""`tinypipe replay` of the committed 2x H200 traces: measured, replayed (the simulator with the run's
own durations) and predicted (the simulator with the profile's costs) steady iteration times, and the
largest per-kind divergences. Writes bench/results/replay_h200.json; the README's replay table quotes it.

    python bench/replay_h200.py

The traces predate `otherData.run`, so each replay is given the run's policy and workload, as
bench/cuda_bench.py ran it (seq 2048, 65,536 tokens per step, --gpu-mem 24GiB). Steady state: the
first window's iterations 1..3 (`--warmup 1`, Timeline's definition) and 2..3 (`--warmup 2`, the
bench's, which leaves out the first AdamW steps' first touch of their moments). The sync runs were
compiled before the head's OPT_STEP moved after the others (tinypipe/compiler/optimizer.py), the 1-GPU
async run while the head's inputs were still offloaded (tinypipe/compiler/passes.py): they are replayed
against the schedules they ran (`--schedule`, bench/results/cuda_h200_<case>.schedule.txt).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import write_json
from tinypipe.sim import simulate

from tinypipe.common.table import render
from tinypipe.replay.runner import add_replay_arguments, replay, settle
from tinypipe.replay.trace_match import load_run_trace

ROOT = Path(__file__).resolve().parent.parent
CASES = {"1gpu-sync-compact": "h200x1-24g-sync-compact.json", "1gpu-async": "h200x1-24g-async.json",
         "2gpu-sync-compact": "h200x2-24g-sync-compact.json", "2gpu-async": "h200x2-24g-async.json"}
WORKLOAD = ["--seq-len", "2048", "--batch-tokens", "65536", "--gpu-mem", "24GiB"]


def main() -> None:
    ap = argparse.ArgumentParser()
    add_replay_arguments(ap)
    rows, out = [], {}
    for case, policy in CASES.items():
        trace_path = ROOT / "bench" / "results" / f"cuda_h200_{case}.trace.json"
        # the sync runs predate the head step's move after the others: their schedules travel beside them
        schedule = trace_path.with_name(f"cuda_h200_{case}.schedule.txt")
        old = ["--schedule", str(schedule)] if schedule.exists() else []
        args = ap.parse_args([str(trace_path), "--policy", str(ROOT / "bench" / "policies" / policy), *WORKLOAD,
                              *old])
        trace = load_run_trace(trace_path)
        setup = settle(trace, args)
        case_out = {}
        for warmup in (1, 2):
            rep = replay(trace, setup, simulate=simulate, warmup=warmup)
            js = rep.to_json()
            js["trace"] = str(trace_path.relative_to(ROOT))
            case_out[f"warmup{warmup}"] = js
            s = js["steady_s"]
            rows.append([case, f"{warmup}..3", round(s["measured"], 3), round(s["replayed"], 3),
                         f"{100 * js['replay_error']:+.2f}%", round(s["predicted"], 3),
                         f"{100 * js['prediction_error']:+.2f}%",
                         ", ".join(f"{k['kind']} x{k['ratio']:.2f}" for k in js["kinds"][:3])])
        out[case] = case_out
    print(render(["trace", "iterations", "measured s", "replayed s", "replay err", "predicted s", "predict err",
                  "largest divergences (measured/predicted)"], rows, align="llrrrrrl"))
    write_json("replay_h200.json", {"cases": out})


if __name__ == "__main__":
    main()
