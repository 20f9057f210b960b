"""The frugal runs of issue 28 on one H200 (bench/device/frugal_h200.sh), or a dry run of them on the CPU.

Three parts, each appending JSON records to OUT/frugal_h200.jsonl (and `summary`, which prints the runs' records):
- `optim`: host AdamW speed per optimizer-state precision and thread count beside torch's fused fp32 AdamW
  (bench/host_optim_precision.py, 64M parameters; OUT/host_optim_precision_h200.json).
- `runs`: Llama-3.1-8B (all 32 layers), 1 GPU, --gpu-mem 24GiB, 65,536 tokens per step, the lean policy with
  one layer a pack (bench/policies/h200x1-24g-lean1-sync.json; with two a pack, predicted at 23.82 GiB, it
  leaves the allocator too little of the 24 GiB and is refused) with fp32, bf16 and 8-bit moments: steady
  tokens/s (mean after 2 warm-up iterations), peak host RSS (summed over ranks) and its bytes per parameter, the
  rank's RSS phases, peak GPU memory, and the simulator's prediction beside each. Targets: 8-bit peak RSS
  <= 60 GiB (<= 8 B/param) and >= 9,000 tokens/s.
- `checkpoint`: the 8B run with checkpoints on this machine's disk (64 GiB): `tinypipe run` refused before
  training (exit 2, the line it printed), then Qwen3-1.7B written and resumed with 8-bit moments: the
  checkpoint's files (no pickle) and the resumed run's exit code.

`--dry-run`: the same on the CPU with tiny-llama (2 CPU workers, a few steps, 1M parameters for the
optimizer), and the refusal shown by `frugal.check_disk` against 1 MiB of free space.

    python bench/device/frugal.py --out OUT [--parts optim runs checkpoint] [--dry-run]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
LEAN = str(ROOT / "bench" / "policies" / "h200x1-24g-lean1-sync.json")
WARMUP = 2


def record(out: Path, row: dict[str, Any]) -> None:
    row = {"date": datetime.datetime.now().isoformat(timespec="seconds"), **row}
    with open(out / "frugal_h200.jsonl", "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print(json.dumps(row, default=str)[:400], flush=True)


def part_optim(out: Path, dry: bool) -> None:
    params = str(1 << 20) if dry else str(1 << 26)
    threads = ["1", "2"] if dry else ["1", "4", "8", "15"]
    dest = out / "host_optim_precision_h200.json"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "host_optim_precision.py"), "--params", params,
                          "--threads", *threads, "--repeat", "3", "--out", str(dest)],
                         capture_output=True, text=True)
    print(res.stdout)
    row: dict[str, Any] = {"part": "optim", "rc": res.returncode, "stderr": res.stderr[-2000:]}
    if res.returncode == 0:
        row["result"] = json.loads(dest.read_text())
    record(out, row)


def run_once(argv: list[str], trace: Path | None = None) -> dict[str, Any]:
    """One `tinypipe run` in this process's launcher: what it measured and predicted, each resource's busy seconds
    per steady step, the main thread's issue share and the host rates the plan took (`trace`: the Chrome trace)."""
    from tinypipe.backends.host import fused_host_adamw
    from tinypipe.backends.launch.prepare import make_run_plan
    from tinypipe.backends.launch.run_report import issue_shares
    from tinypipe.backends.launch.runtrace import save_trace, timeline
    from tinypipe.backends.launch.spawn import launch
    from tinypipe.backends.options.run_flags import add_run_arguments
    from tinypipe.cli.edge import run_options
    from tinypipe.ir.timeline import Timeline

    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    plan = make_run_plan(run_options(ap.parse_args(argv)))
    results = launch(dataclasses.replace(plan.job, save_model=False, progress=False), plan.world)
    assert results is not None
    tl = timeline(plan, results)
    if trace is not None:
        save_trace(plan, results, trace, tl)
    each = tl.iteration_times_s()
    it = statistics.fmean(each[WARMUP:]) if len(each) > WARMUP else tl.steady_iteration_s()
    rss = sum(r.peak_rss_bytes for r in results)
    first = min((r.iteration for r in tl.records), default=0)
    steady = tuple(r for r in tl.records if r.iteration >= first + WARMUP)
    iters = len({r.iteration for r in steady}) or 1
    busy = {res: s / iters for res, s in sorted(Timeline(steady).busy_s().items())}
    return {"tokens_per_s": plan.batch_tokens / it if it > 0 else 0.0, "iteration_s_each": each,
            "busy_s_per_iteration": busy, "host_kernel": fused_host_adamw.name(),
            "main_thread_issue_share": list(issue_shares(tl, results, tl.steady_iteration_s()).values()),
            "calibration": plan.calibration, "predicted_iteration_s": plan.prediction.iteration_s,
            "peak_host_rss_bytes": rss, "host_rss_bytes_per_param": rss / plan.spec.params,
            "host_state_bytes_per_param": sum(r.held["total_bytes"] for r in results) / plan.spec.params,
            "rss_phases": [r.rss_phases for r in sorted(results, key=lambda r: r.rank)],
            "peak_gpu_bytes": max(r.peak_device_bytes for r in results),
            "predicted_tokens_per_s": plan.prediction.tokens_per_s,
            "predicted_peak_host_bytes": plan.prediction.peak_host_bytes,
            "predicted_peak_gpu_bytes": plan.prediction.peak_gpu_bytes, "policy": plan.policy.to_json()}


def part_runs(out: Path, dry: bool, runs: list[str] | None = None, model: str = "llama-3.1-8b",
              label: str = "", hardware: str | None = None) -> None:
    """One run of `model` per `STATE[:POLICY]` of `runs` (default: 8bit, bf16 and fp32 moments with the lean policy);
    `label` tags its records and trace files (with the rank's TINYPIPE_THREADS, where set)."""
    for spec in runs or ["8bit", "bf16", "fp32"]:
        state, _, policy = spec.partition(":")
        with tempfile.TemporaryDirectory(prefix=f"frugal-{state}-") as tmp:
            if dry:
                argv = ["--model", "tiny-llama", "--steps", "4", "--optimizer-state", state]
            else:
                argv = ["--backend", "cuda", "--gpus", "1", "--model", model, "--seq-len", "2048",
                        "--batch-tokens", "65536", "--steps", "6", "--policy", policy or LEAN, "--gpu-mem", "24GiB",
                        "--optimizer-state", state, *(["--hardware", hardware] if hardware else [])]
            argv += ["--out", tmp, "--keep-checkpoints", "0", "--checkpoint-minutes", "0"]
            t0 = time.perf_counter()
            try:
                trace = None if dry else out / f"run-{label}{state}.trace.json"
                row = {"part": "runs", "optimizer_state": state, "label": label,
                       "threads_env": os.environ.get("TINYPIPE_THREADS"), "argv": argv, **run_once(argv, trace)}
            except Exception as exc:  # noqa: BLE001 - a failed case is a result too
                row = {"part": "runs", "optimizer_state": state, "argv": argv, "error": f"{type(exc).__name__}: {exc}"}
            row["wall_s"] = time.perf_counter() - t0
            record(out, row)


def part_checkpoint(out: Path, dry: bool) -> None:
    if dry:
        from tinypipe.backends.launch.prepare import make_run_plan
        from tinypipe.backends.options import frugal
        from tinypipe.backends.options.run_flags import add_run_arguments
        from tinypipe.cli.edge import run_options
        from tinypipe.common.errors import InputError

        ap = argparse.ArgumentParser()
        add_run_arguments(ap)
        with tempfile.TemporaryDirectory() as tmp:
            plan = make_run_plan(run_options(ap.parse_args(["--model", "tiny-llama", "--steps", "2", "--out",
                                                            f"{tmp}/run"])))
            try:
                frugal.check_disk(f"{tmp}/run", plan.spec, plan.schedule, keep=1, checkpoints=True, free=1 << 20)
                line = "not refused"
            except InputError as exc:
                line = f"error: {exc}"
        record(out, {"part": "checkpoint", "case": "refused (1 MiB free, dry run)", "line": line})
        model, extra = "tiny-llama", []
    else:
        with tempfile.TemporaryDirectory(prefix="frugal-ckpt-", dir=str(Path.home())) as tmp:
            cmd = ["tinypipe", "run", "--backend", "cuda", "--model", "llama-3.1-8b", "--seq-len", "2048",
                   "--batch-tokens", "65536", "--steps", "4", "--policy", LEAN, "--gpu-mem", "24GiB",
                   "--optimizer-state", "8bit", "--out", f"{tmp}/run8b"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            record(out, {"part": "checkpoint", "case": "8B on this disk", "cmd": cmd, "rc": res.returncode,
                         "stderr_tail": res.stderr[-1500:], "stdout_tail": res.stdout[-1500:]})
        model, extra = "qwen3-1.7b", ["--backend", "cuda", "--seq-len", "2048", "--batch-tokens", "16384",
                                      "--gpu-mem", "24GiB"]
    with tempfile.TemporaryDirectory(prefix="frugal-resume-", dir=str(Path.home())) as tmp:
        base = ["tinypipe", "run", "--model", model, "--optimizer-state", "8bit", "--out", f"{tmp}/run",
                "--checkpoint-every", "2", *extra]
        first = subprocess.run([*base, "--steps", "2"], capture_output=True, text=True)
        files = sorted(p.name for p in (Path(tmp) / "run" / "checkpoint").glob("*")) if first.returncode == 0 else []
        second = subprocess.run(["tinypipe", "run", "--resume", "--out", f"{tmp}/run", "--steps", "4"],
                                capture_output=True, text=True)
        pickles = [str(p) for p in Path(tmp).rglob("*") if p.suffix in (".pt", ".pkl", ".bin")]
        record(out, {"part": "checkpoint", "case": f"{model} written and resumed", "first_rc": first.returncode,
                     "checkpoint_files": files, "resumed_rc": second.returncode, "pickle_files": pickles,
                     "first_stderr_tail": first.stderr[-800:], "resumed_stdout_tail": second.stdout[-800:],
                     "resumed_stderr_tail": second.stderr[-800:]})


SUMMARY_KEYS = ("label", "optimizer_state", "tokens_per_s", "predicted_tokens_per_s", "peak_host_rss_bytes",
                "predicted_peak_host_bytes", "peak_gpu_bytes", "predicted_peak_gpu_bytes", "error", "wall_s",
                "busy_s_per_iteration", "main_thread_issue_share", "calibration", "host_kernel", "iteration_s_each")


def part_summary(out: Path, dry: bool) -> None:
    """Print each `runs` record of OUT/frugal_h200.jsonl in short (bytes in GiB)."""
    path = out / "frugal_h200.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        if r.get("part") == "runs":
            print({k: (round(r[k] / 2**30, 2) if k.endswith("bytes") else r[k]) for k in SUMMARY_KEYS if k in r})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", nargs="+", default=["optim", "runs", "checkpoint"],
                    choices=("optim", "runs", "checkpoint", "summary"))
    ap.add_argument("--dry-run", action="store_true", help="on the CPU with tiny-llama")
    ap.add_argument("--runs", nargs="+", default=None, metavar="STATE[:POLICY]",
                    help="the `runs` part's optimizer states, each with its policy file (default: the lean one)")
    ap.add_argument("--model", default="llama-3.1-8b", help="the `runs` part's model (a name or a config.json)")
    ap.add_argument("--label", default="", help="a tag for the `runs` part's records and trace files")
    ap.add_argument("--hardware", default=None, help="the `runs` part's hardware preset (default: the local GPU's)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in a.parts:
        if name == "runs":
            part_runs(out, a.dry_run, a.runs, a.model, a.label, a.hardware)
        else:
            {"optim": part_optim, "checkpoint": part_checkpoint, "summary": part_summary}[name](out, a.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
