"""Calibrate the analytic cost model against the simulator (the holistic packer uses what the
simulator teaches, without a search).

Simulates a set of cases (models x hardware presets x policies x pack sizes), then grid-searches the
cost model's fitted constants (`CostModel.FITTED`) for the smallest mean |log(estimate / simulated)|
of the iteration time. Writes traces/calibration/cost_model.json (shipped: `CostModel.calibrated()`
reads it, and every packer uses it) and bench/results/calibrate_cost.json with the error before and
after.

    python bench/calibrate_cost.py
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path

from _common import machine, write_json

from tinypipe.common.table import render
from tinypipe.compiler import compile_schedule, make_plan
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.trace import trace_for
from tinypipe.estimate.calibration import CostModel
from tinypipe.estimate.cost import estimate
from tinypipe.policy import PRESETS
from tinypipe.sim import simulate

MODELS = ("qwen3-1.7b", "llama-3.1-8b", "qwen3-32b")
HARDWARE = ("h200x2", "rtx3090x4-pcie3", "rtx3090x8-pcie3", "rtx4090x8-pcie4")
POLICIES = ("tinypipe", "mobius")
PACK_SIZES = (1, 2, 4, 8)
GRID = {"pack_overhead_s": (0.0, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 16e-3),
        "h2d_efficiency": (0.7, 0.8, 0.9, 1.0),
        "fill_scale": (0.0, 0.25, 0.5, 0.75, 1.0, 1.5)}
OUT = Path(__file__).resolve().parents[1] / "traces" / "calibration" / "cost_model.json"


def cases() -> list[dict]:
    out = []
    for mname, hname, pname, k in itertools.product(MODELS, HARDWARE, POLICIES, PACK_SIZES):
        model, hw = load_model(mname), load_hardware(hname)
        p = PRESETS[pname].replace(microbatches=16, packing="uniform", pack_size=k)
        trace = trace_for(model, hw.gpus[0], microbatch_size=1, seq_len=2048)
        sched = compile_schedule(p, model, hw, trace, iterations=3)
        r = simulate(sched, model, hw, trace, on_capacity="record")
        out.append({"model": mname, "hardware": hname, "policy": pname, "pack_size": k, "sim_s": r.iteration_s,
                    "args": (p, model, hw, trace)})
    return out


def estimates(cs: list[dict], cost: CostModel) -> list[float]:
    est = []
    for c in cs:
        p, model, hw, trace = c["args"]
        plan = make_plan(p, model, hw, trace, iterations=1, cost=cost)
        sizes = tuple(len(x) for x in plan.pack_layers)
        est.append(estimate(plan, sizes, plan.pack_gpu, kept=plan.kept).iteration_s)
    return est


def error(cs: list[dict], est: list[float]) -> float:
    return statistics.fmean(abs(math.log(e / c["sim_s"])) for c, e in zip(cs, est))


def main() -> None:
    t0 = time.perf_counter()
    cs = cases()
    t_sim = time.perf_counter() - t0
    base = CostModel()
    base_err = error(cs, estimates(cs, base))
    best = (base_err, base)
    for values in itertools.product(*GRID.values()):
        cost = replace(base, **dict(zip(GRID, values)))
        e = error(cs, estimates(cs, cost))
        if e < best[0] - 1e-12:
            best = (e, cost)
    err, fitted = best
    est_b, est_a = estimates(cs, base), estimates(cs, fitted)
    rows = [[c["model"], c["hardware"], c["policy"], c["pack_size"], round(c["sim_s"], 3), round(b, 3), round(a, 3)]
            for c, b, a in zip(cs, est_b, est_a)]
    print(render(["model", "hardware", "policy", "k", "simulated s", "default model s", "calibrated s"], rows,
                 align="lllrrrr"))
    print(f"\n{len(cs)} cases simulated in {t_sim:.0f} s; mean |log(estimate/simulated)|: "
          f"default {base_err:.3f} -> calibrated {err:.3f}")
    print("fitted constants: " + ", ".join(f"{k}={v}" for k, v in fitted.to_json().items()))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "what": "CostModel constants fitted against the simulator by bench/calibrate_cost.py",
        "fitted_on": {"models": MODELS, "hardware": HARDWARE, "policies": POLICIES, "pack_sizes": PACK_SIZES,
                      "microbatches": 16, "seq_len": 2048},
        "mean_abs_log_error": {"default": base_err, "calibrated": err},
        "machine": machine(), "constants": fitted.to_json()}, indent=2) + "\n")
    write_json("calibrate_cost.json", {"cases": [{k: v for k, v in c.items() if k != "args"} | {
        "default_s": b, "calibrated_s": a} for c, b, a in zip(cs, est_b, est_a)],
        "error_default": base_err, "error_calibrated": err, "constants": fitted.to_json()})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
