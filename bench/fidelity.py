"""Fidelity on H200 (issue 10): the simulator's prediction from a profile beside each measured run.

    python bench/fidelity.py [--profile bench/results/profile_h200] [--out bench/results/fidelity.jsonl]

Measured: the real runs recorded in bench/results/cuda_h200.jsonl by `bench/cuda_bench.py`.
Predicted, never with numbers from the run being predicted:
- LLAMA_RUNS (eager, 2026-11-30 and 12-01): `tinypipe simulate` of the same model, policy, tokens
  per step and GPU cap, with the traces and host rates `tinypipe profile` measured on another lent
  H200 machine (`--profile`, bench/results/profile_h200/).
- RECORD_RUNS: the prediction each run's own plan made from the `--profile` it was given
  (bench/results/profile_h200_compile/, taken on the machine of the first seven, minutes before).
Iteration time: the mean after the warm-up iterations the run's record names.
One JSON object per configuration, replacing `--out`; a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tinypipe.units import GIB

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
POLICIES = ROOT / "bench" / "policies"
DEVICE = "NVIDIA H200 (lent machines)"

# (config name, model, GPUs, policy, microbatch size or None, the measured record)
LLAMA_RUNS = (("llama-3.1-8b 1 GPU compact sync", "1gpu-sync-compact", "h200x1-24g-sync-compact.json"),
              ("llama-3.1-8b 1 GPU compact async", "1gpu-async", "h200x1-24g-async.json"),
              ("llama-3.1-8b 2 GPUs compact sync", "2gpu-sync-compact", "h200x2-24g-sync-compact.json"),
              ("llama-3.1-8b 2 GPUs compact async", "2gpu-async", "h200x2-24g-async.json"))


# Runs whose record carries the prediction made at run time from `--profile` (bench/cuda_bench.py):
# (config, case in cuda_h200.jsonl, where the profile was taken). Qwen3-1.7B, and Llama-3.1-8B with
# compiled blocks: bench/device/compile_qwen3.sh and llama_compile.sh, 2026-12-01, profiles in
# bench/results/profile_h200_compile/ (taken on the machine of the first seven, minutes before).
SAME = "the run's machine, minutes before"
OTHER = "another lent machine (bench/results/profile_h200_compile)"
RECORD_RUNS = (
    ("qwen3-1.7b 1 GPU tinypipe preset (compact sync), 4 x 2048", "1gpu-preset-qwen3-mb4", SAME),
    ("qwen3-1.7b 1 GPU tinypipe preset (compact sync), 2 x 2048", "1gpu-preset-qwen3-mb2", SAME),
    ("qwen3-1.7b 1 GPU preset, async optimizer, 4 x 2048", "1gpu-preset-async-qwen3-mb4", SAME),
    ("qwen3-1.7b 1 GPU preset, async optimizer, 2 x 2048", "1gpu-preset-async-qwen3-mb2", SAME),
    ("qwen3-1.7b 1 GPU mobius preset, 4 x 2048", "1gpu-mobius-qwen3-mb4", SAME),
    ("qwen3-1.7b 1 GPU preset (sync), compiled blocks, 4 x 2048", "1gpu-preset-qwen3-mb4-compiled", SAME),
    ("qwen3-1.7b 1 GPU preset, async, compiled blocks, 4 x 2048", "1gpu-preset-async-qwen3-mb4-compiled", SAME),
    ("llama-3.1-8b 1 GPU compact sync, compiled blocks", "1gpu-sync-compact-compiled", OTHER),
    ("qwen3-1.7b 1 GPU preset (sync), compiled, carried steps, 4 x 2048", "1gpu-preset-qwen3-mb4-compiled-carry",
     OTHER),
    ("qwen3-1.7b 1 GPU preset, async, compiled, carried steps, 4 x 2048", "1gpu-preset-async-qwen3-mb4-compiled-carry",
     OTHER),
    ("qwen3-1.7b 1 GPU preset, async, carried steps, 2 x 2048", "1gpu-preset-async-qwen3-mb2-carry", OTHER),
)


def _bench_records() -> dict[str, dict[str, Any]]:
    """The latest successful record of each bench case."""
    out: dict[str, dict[str, Any]] = {}
    for line in (RESULTS / "cuda_h200.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("tokens_per_s"):
            out[rec["case"]] = rec
    return out


def _predict(model: str, gpus: int, policy: str, microbatch_size: int | None, profile: Path) -> dict[str, Any]:
    hw = profile / f"hardware-h200x{gpus}.json"
    cmd = [sys.executable, "-m", "tinypipe.cli", "simulate", "--model", model, "--hardware", str(hw),
           "--profile", str(profile), "--policy", policy, "--gpu-mem", "24GiB", "--seq-len", "2048",
           "--batch-tokens", "65536", "--json"]
    if microbatch_size is not None:
        cmd += ["--microbatch-size", str(microbatch_size)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)["results"][0]
    r["command"] = "tinypipe " + " ".join(cmd[3:])
    return dict(r)


def rows(profile: Path) -> list[dict[str, Any]]:
    recs = _bench_records()
    out = []
    for name, case, policy in LLAMA_RUNS:
        rec = recs[case]
        pred = _predict("llama-3.1-8b", rec["gpus"], str(POLICIES / policy), None, profile)
        out.append({"config": name, "measured_iteration_s": rec["iteration_s"],
                    "warmup_iterations": rec.get("warmup_iterations", 1),
                    "predicted_iteration_s": pred["iteration_s"], "measured_peak_gpu_bytes": rec["peak_gpu_bytes"],
                    "predicted_peak_gpu_bytes": pred["peak_gpu_bytes"], "measured_on": rec["date"],
                    "profiled_on": "another lent machine (bench/results/profile_h200)",
                    "predict_command": pred["command"], "device": DEVICE, "date": rec["date"]})
    for name, case, where in RECORD_RUNS:
        rec = recs[case]
        out.append({"config": name, "measured_iteration_s": rec["iteration_s"],
                    "warmup_iterations": rec.get("warmup_iterations", 1),
                    "predicted_iteration_s": rec["predicted_iteration_s"],
                    "measured_peak_gpu_bytes": rec["peak_gpu_bytes"],
                    "predicted_peak_gpu_bytes": rec["predicted_peak_gpu_bytes"], "measured_on": rec["date"],
                    "profiled_on": where, "predict_command": "the run's own plan: tinypipe run " + " ".join(
                        rec.get("run_options", [])), "device": DEVICE, "date": rec["date"]})
    for r in out:
        r["iteration_error"] = r["predicted_iteration_s"] / r["measured_iteration_s"] - 1
        r["peak_gpu_error"] = r["predicted_peak_gpu_bytes"] / r["measured_peak_gpu_bytes"] - 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=str(RESULTS / "profile_h200"))
    ap.add_argument("--out", default=str(RESULTS / "fidelity.jsonl"))
    a = ap.parse_args()
    rs = rows(Path(a.profile))
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rs))
    print(f"{'config':70s} {'measured s':>10s} {'predicted s':>11s} {'error':>7s} {'GPU GiB':>8s} "
          f"{'pred GiB':>8s} {'error':>7s}")
    for r in rs:
        print(f"{r['config']:70s} {r['measured_iteration_s']:10.3f} {r['predicted_iteration_s']:11.3f} "
              f"{100 * r['iteration_error']:+6.1f}% {r['measured_peak_gpu_bytes'] / GIB:8.2f} "
              f"{r['predicted_peak_gpu_bytes'] / GIB:8.2f} {100 * r['peak_gpu_error']:+6.1f}%")
    errs = [abs(r["iteration_error"]) for r in rs]
    mem = [abs(r["peak_gpu_error"]) for r in rs]
    print(f"{len(rs)} configurations: iteration |error| median {100 * statistics.median(errs):.1f}%, worst "
          f"{100 * max(errs):.1f}%; peak GPU |error| worst {100 * max(mem):.1f}%")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
