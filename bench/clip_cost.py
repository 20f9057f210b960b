"""What `--max-grad-norm` costs: the simulator's prediction and a measured CPU run, with and without clipping.

    python bench/clip_cost.py

Clipping by the global norm makes every OPT_STEP of a step wait for the step's last GRAD_OUT on every
GPU (`compiler.optimizer.optimizer_pass`), so the host optimizer no longer overlaps the backward; behind
the barrier the steps go in layer order, and the compact layout holds a whole gradient instead of its
ring. This writes bench/results/clip_cost.json with
- predicted: the simulated iteration and host peak of Llama-3.1-8B on the shipped 2 x H200 preset (the
  tinypipe policy, 16 microbatches of 2,048 tokens), per host layout and optimizer mode, with and
  without clipping;
- measured: `tinypipe run` of tiny-llama on 2 CPU workers (the default policy: compact host layout,
  200 steps of 512 tokens), the steady step the summary prints, with and without `--max-grad-norm 1`,
  beside the simulator's prediction for the same run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import machine, write_json

STEPS = 200


def predicted() -> dict[str, dict[str, float]]:
    from tinypipe.compiler import compile_schedule
    from tinypipe.describe.hardware import load_hardware
    from tinypipe.describe.hfconfig import load_model
    from tinypipe.describe.trace import trace_for
    from tinypipe.policy import PRESETS
    from tinypipe.sim import simulate

    model, hw = load_model("llama-3.1-8b"), load_hardware("h200x2")
    out = {}
    for layout in ("replicated", "compact"):
        for mode in ("sync", "async"):
            policy = PRESETS["tinypipe"].replace(host_memory=layout, optimizer=mode, microbatches=16)
            trace = trace_for(model, hw.gpus[0], microbatch_size=policy.microbatch_size, seq_len=2048, dtype="bf16",
                              profiles=())
            row = {}
            for clip in (False, True):
                s = compile_schedule(policy, model, hw, trace, iterations=3, grad_clip=clip)
                r = simulate(s, model, hw, trace)
                name = "clipped" if clip else "plain"
                row[f"{name}_s"], row[f"{name}_host_gib"] = r.iteration_s, r.peak_host_bytes / 2**30
            out[f"{layout}_{mode}"] = row
    return out


def measured(clip: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "tinypipe.cli", "run", "--steps", str(STEPS),
               "--out", str(Path(tmp) / "out")] + (["--max-grad-norm", "1"] if clip else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"tinypipe run failed:\n{r.stderr[-3000:]}")
    step = re.search(r"measured \(step ([\d.]+) ms", r.stdout)
    pred = re.search(r"predicted by the simulator \(step ([\d.]+) ms", r.stdout)
    loss = re.search(r"^loss\s+[\d.]+ \S+ ([\d.]+)", r.stdout, re.M)
    assert step and pred and loss, r.stdout
    return {"steady_step_ms": float(step[1]), "predicted_step_ms": float(pred[1]), "loss_last": float(loss[1])}


def main() -> None:
    pred = predicted()
    runs = {"plain": measured(False), "clipped": measured(True)}
    for name, p in pred.items():
        print(f"Llama-3.1-8B on 2 x H200 (simulated), {name}: {p['plain_s']:.3f} s -> {p['clipped_s']:.3f} s per "
              f"iteration with clipping ({p['clipped_s'] / p['plain_s'] - 1:+.1%}); host peak "
              f"{p['plain_host_gib']:.1f} -> {p['clipped_host_gib']:.1f} GiB")
    for name, r in runs.items():
        print(f"tiny-llama on 2 CPU workers, {name}: steady step {r['steady_step_ms']:.1f} ms measured, "
              f"{r['predicted_step_ms']:.1f} ms predicted, last loss {r['loss_last']:.4f}")
    path = write_json("clip_cost.json", {"predicted_llama_3_1_8b_h200x2": pred, "measured_tiny_llama_cpu": runs,
                                         "steps": STEPS, "machine": machine()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
