"""Loss curves with bf16 and 8-bit AdamW moments beside fp32, on the default job and on a text file.

For each job (the embedded addition task on tiny-llama, as plain `tinypipe run` trains it; and a plain
text file, docs/architecture.md, the same model and settings) this trains `--steps` steps through the
pipeline (2 CPU workers) with fp32, bf16 and 8-bit moments from seed 0, and with fp32 from seeds 1 and
2 (other initialisation and data order). The band: a low-precision curve counts as matching fp32 when
its mean loss over the last `--tail` steps differs from fp32's (seed 0) by no more than the spread of
that mean across the fp32 seeds (the run-to-run variation fp32 itself shows), and its curve smoothed
over `--window` steps stays within the fp32 seeds' envelope, widened by that spread, at every step.
Writes bench/results/optim_state_curves.json (every loss, per run) and prints the table.

    python bench/optim_state_curves.py [--steps 300] [--tail 50] [--window 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOBS = {"addition": None, "text": str(ROOT / "docs" / "architecture.md")}
RUNS = (("fp32", 0), ("bf16", 0), ("8bit", 0), ("fp32", 1), ("fp32", 2))


def train(data: str | None, state: str, seed: int, steps: int) -> list[float]:
    """The per-step losses of one run through the pipeline (2 CPU workers, no checkpoints, nothing saved)."""
    from tinypipe.backends.launch.prepare import make_run_plan
    from tinypipe.backends.launch.spawn import launch
    from tinypipe.backends.options.run_flags import add_run_arguments
    from tinypipe.cli.edge import run_options

    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    argv = ["--steps", str(steps), "--seed", str(seed), "--optimizer-state", state, "--keep-checkpoints", "0",
            "--out", str(ROOT / "bench" / "out" / f"curves-{time.time_ns()}")]
    if data:
        argv += ["--data", data]
    plan = make_run_plan(run_options(ap.parse_args(argv)))
    results = launch(dataclasses.replace(plan.job, progress=False, save_model=False, out=None), plan.world)
    assert results is not None
    losses: dict[int, float] = {}
    for r in results:
        losses.update(r.losses)
    return [losses[k] for k in sorted(losses)]


def smooth(xs: list[float], w: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tail", type=int, default=50)
    ap.add_argument("--window", type=int, default=20)
    a = ap.parse_args(argv)
    out: dict[str, Any] = {"steps": a.steps, "tail": a.tail, "window": a.window, "jobs": {}}
    for job, data in JOBS.items():
        curves = {}
        for state, seed in RUNS:
            t0 = time.perf_counter()
            curves[f"{state}/seed{seed}"] = train(data, state, seed, a.steps)
            print(f"{job} {state} seed {seed}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        tail = {k: statistics.fmean(v[-a.tail:]) for k, v in curves.items()}
        fp32_tails = [tail[f"fp32/seed{s}"] for s in (0, 1, 2)]
        spread = max(fp32_tails) - min(fp32_tails)
        sm = {k: smooth(v, a.window) for k, v in curves.items()}
        lo = [min(sm[f"fp32/seed{s}"][i] for s in (0, 1, 2)) - spread for i in range(a.steps)]
        hi = [max(sm[f"fp32/seed{s}"][i] for s in (0, 1, 2)) + spread for i in range(a.steps)]
        verdict = {}
        for state in ("bf16", "8bit"):
            key = f"{state}/seed0"
            outside = [i for i in range(a.steps) if not lo[i] <= sm[key][i] <= hi[i]]
            diff = tail[key] - tail["fp32/seed0"]
            verdict[state] = {"tail_mean": tail[key], "tail_minus_fp32": diff,
                              "within_seed_spread": abs(diff) <= spread, "steps_outside_envelope": len(outside),
                              "first_outside": outside[:5]}
        out["jobs"][job] = {"data": data or "embedded addition task", "tail_means": tail, "fp32_seed_spread": spread,
                            "verdict": verdict, "losses": curves}
        print(f"\n{job}: mean loss over the last {a.tail} of {a.steps} steps; fp32 seeds spread {spread:.4f}")
        for k, v in tail.items():
            print(f"  {k:12s} {v:.4f}")
        for state, v in verdict.items():
            print(f"  {state}: {v['tail_minus_fp32']:+.4f} vs fp32 (within the seed spread: "
                  f"{v['within_seed_spread']}); {v['steps_outside_envelope']} of {a.steps} smoothed steps outside "
                  "the fp32 envelope")
    print(f"\nwrote {write_json('optim_state_curves.json', out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
