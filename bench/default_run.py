"""The README's numbers for the default job: run plain `tinypipe run` and record what it prints.

    python bench/default_run.py

Runs the command in a fresh temporary directory, as a user would, and writes
bench/results/default_run.json: the summary it printed, the numbers parsed from it, its wall
time, and the machine with the commit it ran at (`_common.machine`). Prints the README's sentence.
Loss and accuracy repeat exactly on one machine at one commit (here also with 4 threads per worker
instead of 1); another CPU's kernels may round differently and end elsewhere, so the README says which
machine its numbers come from.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import machine, write_json


def parse(summary: str) -> dict[str, Any]:
    """The numbers of `tinypipe run`'s summary that the README quotes."""
    loss = re.search(r"^loss\s+([\d.]+) \S+ ([\d.]+)", summary, re.M)
    acc = re.search(r"held-out addition: ([\d.]+)% before -> ([\d.]+)% after", summary)
    speed = re.search(r"([\d,]+) tokens/s measured .*?([\d,]+) tokens/s over (\d+) steps in ([\d.]+) s", summary)
    pred = re.search(r"([\d,]+) tokens/s predicted by the simulator", summary)
    if not (loss and acc and speed and pred):
        raise SystemExit(f"cannot read the summary:\n{summary}")
    return {"loss_first": float(loss[1]), "loss_last": float(loss[2]), "accuracy_before_pct": float(acc[1]),
            "accuracy_after_pct": float(acc[2]), "steady_tokens_per_s": int(speed[1].replace(",", "")),
            "steps": int(speed[3]), "training_s": float(speed[4]),
            "predicted_tokens_per_s": int(pred[1].replace(",", ""))}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def main() -> None:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "tinypipe.cli", "run"], cwd=tmp, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"tinypipe run failed ({res.returncode}):\n{res.stderr}")
    numbers = {**parse(res.stdout), "wall_s": round(wall, 1)}
    path = write_json("default_run.json", {"command": "tinypipe run", "cpu": cpu_model(), "torch": torch.__version__,
                                           **numbers, "summary": res.stdout})
    n = numbers
    print(f"loss {n['loss_first']:.2f} -> {n['loss_last']:.2f}, held-out addition accuracy "
          f"{n['accuracy_before_pct']:.1f}% -> {n['accuracy_after_pct']:.1f}%, {n['steady_tokens_per_s']:,} tokens/s, "
          f"{n['wall_s']:.0f} s wall ({machine()['cpus']} cores, {cpu_model()}); wrote {path}")


if __name__ == "__main__":
    main()
