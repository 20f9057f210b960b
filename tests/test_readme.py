"""The README quotes the default job's numbers from the command's own recorded output, not by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_default_job_numbers_come_from_bench_default_run() -> None:
    """Loss, accuracy, tokens/s, wall time and the simulator's figure in the README's "Training for
    real" paragraph equal bench/results/default_run.json, which `python bench/default_run.py` writes
    from what `tinypipe run` printed."""
    readme = (ROOT / "README.md").read_text()
    r = json.loads((ROOT / "bench" / "results" / "default_run.json").read_text())
    m = re.search(r"loss ([\d.]+) -> ([\d.]+), held-out\s+addition accuracy ([\d.]+)% -> ([\d.]+)%, ([\d,]+) tokens/s, "
                  r"(\d+) s wall", readme)
    assert m is not None
    assert (float(m[1]), float(m[2])) == (round(r["loss_first"], 2), round(r["loss_last"], 2))
    assert (float(m[3]), float(m[4])) == (r["accuracy_before_pct"], r["accuracy_after_pct"])
    assert int(m[5].replace(",", "")) == r["steady_tokens_per_s"] and int(m[6]) == round(r["wall_s"])
    assert f"({r['predicted_tokens_per_s']:,} tokens/s)" in readme
    assert f"loss      {r['loss_first']:.4f}" in r["summary"] and f"{r['loss_last']:.4f}" in r["summary"]


def test_readme_replay_table_comes_from_bench_replay_h200() -> None:
    """Each row of the README's replay table (steady iterations 2..3) equals bench/results/replay_h200.json,
    which `python bench/replay_h200.py` writes from `tinypipe replay`'s report."""
    readme = (ROOT / "README.md").read_text()
    cases = json.loads((ROOT / "bench" / "results" / "replay_h200.json").read_text())["cases"]
    labels = {"1gpu-sync-compact": "1 GPU, compact, sync (2026-11-30)", "1gpu-async": "1 GPU, compact, async",
              "2gpu-sync-compact": "2 GPUs, compact, sync", "2gpu-async": "2 GPUs, compact, async"}
    for case, label in labels.items():
        r = cases[case]["warmup2"]
        s = r["steady_s"]
        kinds = ", ".join(f"{k['kind']} {k['ratio']:.2f}x" for k in r["kinds"][:3])
        row = (f"| {label} | {s['measured']:.3f} | {s['replayed']:.3f} ({100 * r['replay_error']:+.2f}%) | "
               f"{s['predicted']:.3f} ({100 * r['prediction_error']:+.1f}%) | {kinds} |")
        assert row in readme, row
