"""What `--max-grad-norm` costs: the simulator's prediction and a measured CPU run, with and without clipping.

    python bench/clip_cost.py

Clipping by the global norm makes every OPT_STEP of a step wait for the step's last GRAD_OUT on every
GPU (`compiler.optimizer.norm_barrier`), so the host optimizer no longer overlaps the backward. This
writes bench/results/clip_cost.json with
- predicted: the simulated iteration of Llama-3.1-8B on the shipped 2 x H200 preset (replicated host
  layout, sync optimizer, 16 microbatches of 2,048 tokens), with and without the barrier;
- measured: `tinypipe run` of tiny-llama on 2 CPU workers (replicated host layout, 200 steps of 512
  tokens), the steady step the summary prints, with and without `--max-grad-norm 1`, beside the
  simulator's prediction for the same run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import machine, write_json

STEPS = 200


def predicted() -> dict[str, float]:
    from tinypipe.sim import simulate

    from tinypipe.compiler import compile_schedule
    from tinypipe.describe.hardware import load_hardware
    from tinypipe.describe.hfconfig import load_model
    from tinypipe.describe.trace import trace_for
    from tinypipe.policy import PRESETS

    model, hw = load_model("llama-3.1-8b"), load_hardware("h200x2")
    policy = PRESETS["tinypipe"].replace(host_memory="replicated", optimizer="sync", microbatches=16)
    trace = trace_for(model, hw.gpus[0], microbatch_size=policy.microbatch_size, seq_len=2048, dtype="bf16",
                      profiles=())
    out = {}
    for clip in (False, True):
        s = compile_schedule(policy, model, hw, trace, iterations=3, grad_clip=clip)
        out["clipped_s" if clip else "plain_s"] = simulate(s, model, hw, trace).iteration_s
    return out


def measured(clip: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        pol = Path(tmp) / "replicated.json"
        pol.write_text(json.dumps({"name": "replicated", "swap": "layer", "host_memory": "replicated",
                                   "microbatch_size": 4}))
        cmd = [sys.executable, "-m", "tinypipe.cli", "run", "--policy", str(pol), "--steps", str(STEPS),
               "--out", str(Path(tmp) / "out")] + (["--max-grad-norm", "1"] if clip else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"tinypipe run failed:\n{r.stderr[-3000:]}")
    step = re.search(r"steady step ([\d.]+) ms", r.stdout)
    pred = re.search(r"predicted by the simulator \(step ([\d.]+) ms", r.stdout)
    loss = re.search(r"^loss\s+[\d.]+ \S+ ([\d.]+)", r.stdout, re.M)
    assert step and pred and loss, r.stdout
    return {"steady_step_ms": float(step[1]), "predicted_step_ms": float(pred[1]), "loss_last": float(loss[1])}


def main() -> None:
    pred = predicted()
    runs = {"plain": measured(False), "clipped": measured(True)}
    print(f"Llama-3.1-8B on 2 x H200 (simulated): {pred['plain_s']:.3f} s -> {pred['clipped_s']:.3f} s per iteration "
          f"with the clipping barrier ({pred['clipped_s'] / pred['plain_s'] - 1:+.1%})")
    for name, r in runs.items():
        print(f"tiny-llama on 2 CPU workers, {name}: steady step {r['steady_step_ms']:.1f} ms measured, "
              f"{r['predicted_step_ms']:.1f} ms predicted, last loss {r['loss_last']:.4f}")
    path = write_json("clip_cost.json", {"predicted_llama_3_1_8b_h200x2": pred, "measured_tiny_llama_cpu": runs,
                                         "steps": STEPS, "machine": machine()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
