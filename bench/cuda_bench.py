"""CUDA benchmark: `tinypipe run --backend cuda` on Llama-3.1-8B shapes (or `--model`), beside its floor
and the simulator's prediction, one JSON object per run appended to bench/results/cuda_h200.jsonl.

Each case is the run a user would type (random init, bf16 compute, fp32 masters and AdamW state, seq
2048, 65,536 tokens per optimizer step, `--gpu-mem` cap), run in this process's launcher (one worker
process per GPU, NCCL), with the saved model switched off (writing 32 GB is not what is measured).
Measured: steady-state tokens/s (the mean iteration after the first WARMUP ones, CUDA events), peak
GPU memory (the caching allocator's max_memory_allocated, max over ranks), peak host RSS (ru_maxrss,
summed over ranks), the host state's bytes per parameter (`HostState.held`). Beside them: the
simulator's prediction for the same schedule and the floor (`tinypipe.estimate.floor`): max(compute at the
trace's measured per-layer times, PCIe bytes over the measured link rates, host optimizer time).

    python bench/cuda_bench.py --cases 1gpu-sync 2gpu-sync --steps 6 --trace-dir $OUT --out $OUT/cuda_h200.jsonl

Policies: the files in bench/policies/, written by `tinypipe search` (the command is in each case below).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tinypipe.common.units import GIB

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "bench" / "policies"
MODEL = "llama-3.1-8b"
SEQ = 2048
BATCH_TOKENS = 65536
# Iterations left out of the steady state: the first fills the pipeline; the second waits for every
# layer's first AdamW step, which allocates and first touches its moments (8 B per parameter: ~3.5 s
# more on the 2x H200 8B run of 2026-12-01, where later iterations took 5.0 s). All are recorded.
WARMUP = 2

# name -> (GPUs, policy file or preset). `*-24g-sync.json` are the winners of `tinypipe search --model
# llama-3.1-8b --hardware h200x{N} --gpu-mem 24GiB --batch-tokens 65536 --out FILE` (2026-11-30);
# `-compact` is that winner with host_memory compact, `-async` that with the async optimizer too;
# `lean` is the 1-GPU winner with compact host memory, boundary activations kept on the GPU and no
# resident layers (simulated: 20.6 GiB peak GPU, 12.2 B/param host), which the host-RSS target needs.
CASES: dict[str, tuple[int, str]] = {
    "1gpu-sync": (1, "h200x1-24g-sync.json"),
    "1gpu-sync-compact": (1, "h200x1-24g-sync-compact.json"),
    "1gpu-async": (1, "h200x1-24g-async.json"),
    "1gpu-lean-sync": (1, "h200x1-24g-lean-sync.json"),
    "1gpu-lean-async": (1, "h200x1-24g-lean-async.json"),
    "2gpu-sync": (2, "h200x2-24g-sync.json"),
    "2gpu-sync-compact": (2, "h200x2-24g-sync-compact.json"),
    "2gpu-async": (2, "h200x2-24g-async.json"),
    "1gpu-preset": (1, "tinypipe"),
    "2gpu-preset": (2, "tinypipe"),
    "1gpu-preset-async": (1, "tinypipe-async.json"),
    "1gpu-mobius": (1, "mobius"),
    # LoRA on a frozen base, with `--extra --lora 16 --lora-alpha 32 --lora-targets all` (bench/device/lora_h200.sh):
    # the winner of `tinypipe search --model llama-3.1-8b --hardware h200x1 --gpu-mem 24GiB --batch-tokens 65536
    # --lora 16 --lora-alpha 32 --lora-targets all` (2026-12-02; simulated 11,073 tokens/s, 18.8 GiB GPU, 30.8 GiB
    # host), and `-lean` that with no resident layers (simulated 11,037 tokens/s, 7.1 GiB GPU, 31.0 GiB host)
    "1gpu-lora": (1, "h200x1-24g-lora16.json"),
    "1gpu-lora-lean": (1, "h200x1-24g-lora16-lean.json"),
    "1gpu-lora-preset": (1, "tinypipe"),  # Qwen3-32B shapes, the whole GPU (simulated: 2,382 tokens/s, 107 GiB)
    # Llama-3.1-70B on a 4-bit base (`--extra --lora 16 --lora-alpha 32 --lora-targets all --load-in-4bit`,
    # `--batch-tokens 16384`; bench/device/lora4_h200.sh): the winner of `tinypipe search --model llama-3.1-70b
    # --hardware h200x1 --gpu-mem 24GiB --batch-tokens 16384 --lora 16 --lora-alpha 32 --lora-targets all
    # --load-in-4bit` (simulated with the analytic trace: 1,195 tokens/s, 14.5 GiB GPU, 59.8 GiB host)
    "1gpu-lora-70b-4bit": (1, "h200x1-24g-lora16-70b-4bit.json"),
    # Qwen3-30B-A3B (mixture of experts) with `--extra --lora 16 --lora-alpha 32 --lora-targets all`,
    # `--batch-tokens 16384`: the winner of `tinypipe search --model qwen3-30b-a3b --hardware h200x1 --gpu-mem 24GiB
    # --batch-tokens 16384 --lora 16 --lora-alpha 32 --lora-targets all` (simulated with the analytic trace: 7,293
    # tokens/s, 21.1 GiB GPU, 56.9 GiB host)
    "1gpu-lora-30b-a3b": (1, "h200x1-24g-lora16-30b-a3b.json"),
}


def _policy_arg(spec: str) -> str:
    path = POLICIES / spec
    return str(path) if path.exists() else spec


def run_case(name: str, *, steps: int, gpu_mem: str, trace_dir: str | None, extra: list[str], model: str = MODEL,
             label: str = "", batch_tokens: int = BATCH_TOKENS) -> dict[str, Any]:
    """Run one case; the JSON record of what it measured and predicted."""
    import torch

    from tinypipe.backends.launch.prepare import make_run_plan
    from tinypipe.backends.launch.run_report import issue_shares
    from tinypipe.backends.launch.runtrace import save_trace, timeline
    from tinypipe.backends.launch.spawn import launch
    from tinypipe.backends.options.run_flags import add_run_arguments
    from tinypipe.cli.edge import run_options
    from tinypipe.estimate.floor import schedule_floor

    gpus, policy = CASES[name]
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    out = tempfile.mkdtemp(prefix=f"tp-{name}-")
    argv = ["--backend", "cuda", "--gpus", str(gpus), "--model", model, "--seq-len", str(SEQ),
            "--batch-tokens", str(batch_tokens), "--steps", str(steps), "--policy", _policy_arg(policy),
            "--gpu-mem", gpu_mem, "--out", out, "--checkpoint-minutes", "0", *extra]
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    plan = make_run_plan(run_options(args))
    job = dataclasses.replace(plan.job, save_model=False)
    results = launch(job, plan.world)
    assert results is not None
    wall = time.perf_counter() - t0
    tl = timeline(plan, results)
    if trace_dir:
        save_trace(plan, results, Path(trace_dir) / f"{name}{label}.trace.json", tl)
    shutil.rmtree(out, ignore_errors=True)
    each = tl.iteration_times_s()
    iteration_s = statistics.fmean(each[WARMUP:]) if len(each) > WARMUP else tl.steady_iteration_s()
    floor = schedule_floor(plan.schedule, plan.spec, plan.hardware, plan.trace)
    sim = plan.prediction
    params = plan.spec.params
    held = sum(r.held["total_bytes"] for r in results)
    tps = batch_tokens / iteration_s if iteration_s > 0 else 0.0
    floor_tps = batch_tokens / floor.iteration_s
    busy = _busy_by_resource(tl)
    return {
        "case": name + label, "model": model, "gpus": gpus, "gpu_mem_cap_gib": _gib_arg(gpu_mem),
        "policy": plan.policy.to_json(),
        "optimizer": plan.policy.optimizer, "host_memory": plan.policy.host_memory,
        "run_options": extra, "tokens_per_step": batch_tokens, "steps": steps, "warmup_iterations": WARMUP,
        "iteration_s_each": each, "iteration_s": iteration_s, "tokens_per_s": tps,
        "peak_gpu_bytes": max(r.peak_device_bytes for r in results),
        "peak_gpu_bytes_per_rank": [r.peak_device_bytes for r in sorted(results, key=lambda r: r.rank)],
        "peak_reserved_gpu_bytes": max(r.peak_reserved_bytes for r in results),
        "alloc_retries": sum(r.alloc_retries for r in results),
        "peak_host_rss_bytes": sum(r.peak_rss_bytes for r in results),
        "host_steal_share": results[0].host_steal_share,  # the hypervisor's share of the host's CPU time (cpustat)
        "host_rss_bytes_per_param": sum(r.peak_rss_bytes for r in results) / params,
        "host_rss_phases_per_rank": [r.rss_phases for r in sorted(results, key=lambda r: r.rank)],
        "host_state_bytes": held, "host_state_bytes_per_param": held / params,
        "predicted_tokens_per_s": sim.tokens_per_s, "predicted_iteration_s": sim.iteration_s,
        "predicted_peak_gpu_bytes": sim.peak_gpu_bytes,
        "predicted_peak_host_bytes": sim.peak_host_bytes,
        "floor": floor.to_json(), "floor_tokens_per_s": floor_tps, "achieved_over_floor": tps / floor_tps,
        # per rank, the share of a steady step its main thread spent issuing (backends.report.issue_shares)
        "main_thread_issue_share": list(issue_shares(tl, results, tl.steady_iteration_s()).values()),
        "busy_s_per_iteration": busy, "wall_s": wall,
        "device": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
    }


def _busy_by_resource(tl: Any) -> dict[str, float]:
    """Seconds each resource was busy per steady iteration (its records after the WARMUP iterations;
    one resource's actions run one after another, so their durations add up)."""
    from tinypipe.ir.timeline import Timeline

    first = min((r.iteration for r in tl.records), default=0)
    steady = tuple(r for r in tl.records if r.iteration >= first + WARMUP)
    iters = len({r.iteration for r in steady}) or 1
    return {res: s / iters for res, s in sorted(Timeline(steady).busy_s().items())}


def _gib_arg(text: str) -> float:
    from tinypipe.common.units import parse_bytes

    return parse_bytes(text, "--gpu-mem") / GIB


def table(rows: list[dict[str, Any]]) -> str:
    head = ("case", "tokens/s", "floor tok/s", "of floor", "predicted", "GPU GiB", "pred GiB", "RSS B/param",
            "state B/param", "bound by")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append((r["case"], "failed: " + r["error"][:80], "", "", "", "", "", "", "", ""))
            continue
        lines.append((r["case"], f"{r['tokens_per_s']:,.0f}", f"{r['floor_tokens_per_s']:,.0f}",
                      f"{100 * r['achieved_over_floor']:.1f}%", f"{r['predicted_tokens_per_s']:,.0f}",
                      f"{r['peak_gpu_bytes'] / GIB:.2f}", f"{r['predicted_peak_gpu_bytes'] / GIB:.2f}",
                      f"{r['host_rss_bytes_per_param']:.2f}", f"{r['host_state_bytes_per_param']:.2f}",
                      str(r["floor"]["bound_by"])))
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=["1gpu-sync", "2gpu-sync"], choices=sorted(CASES))
    ap.add_argument("--steps", type=int, default=6, help=f"optimizer steps per case (the first {WARMUP} are warm-up)")
    ap.add_argument("--gpu-mem", default="24GiB")
    ap.add_argument("--trace-dir", default=None, help="write each case's Chrome trace here")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cuda_h200.jsonl"))
    ap.add_argument("--model", default=MODEL, help=f"shipped model (default {MODEL})")
    ap.add_argument("--label", default="", help="appended to each case's name in the record and the trace file")
    ap.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS, help=f"tokens per step (default {BATCH_TOKENS})")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `tinypipe run` options")
    a = ap.parse_args()
    rows = []
    for name in a.cases:
        if CASES[name][0] > _gpus():
            print(f"{name}: skipped, needs {CASES[name][0]} GPUs", file=sys.stderr)
            continue
        try:
            row = run_case(name, steps=a.steps, gpu_mem=a.gpu_mem, trace_dir=a.trace_dir, extra=a.extra,
                           model=a.model, label=a.label, batch_tokens=a.batch_tokens)
        except Exception as exc:  # noqa: BLE001 - a failed case is a result too
            row = {"case": name + a.label, "model": a.model, "run_options": a.extra, "gpus": CASES[name][0],
                   "error": f"{type(exc).__name__}: {exc}",
                   "date": datetime.date.today().isoformat()}
        rows.append(row)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)
    print(table(rows))
    return 0


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
