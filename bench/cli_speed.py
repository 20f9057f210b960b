"""Whole-command speed of `tinypipe simulate` (70B on 8 RTX 4090) and `tinypipe search` (8B on one H200), before
and after, side by side in one run.

    python bench/cli_speed.py [--before REF] [--repeat N] [--keep]

"Before" is REF (default: the merge base of HEAD and main) checked out into a temporary git worktree with
its own virtual environment (an editable install, no downloads); "after" is this checkout. The two are
run alternately, REPEAT times each, so that what else runs on the machine weighs on both alike. Per run it
records the wall-clock seconds, the CPU seconds of the command and of the worker processes it waited for
(user + system), and the machine's load meanwhile: the share of all cores that other processes kept busy
(from /proc/stat, less the command's own CPU) and the 1-minute load average at the start. The table gives
medians and ranges. Writes bench/results/cli_speed.json. The temporary worktree is removed at the end
(`--keep` keeps it, and its venv, for the next run). The targets (issue 26): simulate under 3 s, search
under 10 s on 2 cores; the 32-microbatch simulate is timed beside them (no target).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import write_json

from tinypipe.common.table import render

ROOT = Path(__file__).resolve().parent.parent
COMMANDS: dict[str, tuple[list[str], float | None]] = {  # name -> (arguments, target wall seconds)
    "simulate 70B x 8 RTX 4090": (["simulate", "--model", "llama-3.1-70b", "--hardware", "rtx4090x8-pcie4"], 3.0),
    "simulate 70B x 8 RTX 4090, 32 microbatches": (["simulate", "--model", "llama-3.1-70b", "--hardware",
                                                    "rtx4090x8-pcie4", "--microbatches", "32"], None),
    "search 8B on one H200, --gpu-mem 24GiB": (["search", "--model", "llama-3.1-8b", "--hardware", "h200x1",
                                               "--gpu-mem", "24GiB"], 10.0),
}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def before_tree(ref: str) -> tuple[Path, str]:
    """A worktree of `ref` with its own venv (cached under the temp directory by commit); its python."""
    sha = _git("rev-parse", ref)
    tree = Path(tempfile.gettempdir()) / f"tinypipe-bench-{sha[:12]}"
    python = tree / ".venv" / "bin" / "python"
    if not python.exists():
        if not tree.exists():
            _git("worktree", "add", "--detach", str(tree), sha)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(tree / ".venv")], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                        str(tree)], check=True)
    return tree, sha


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all cores since boot (/proc/stat), or None where there is none."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def run(python: str, cwd: Path, argv: list[str]) -> dict[str, Any]:
    """One run of `tinypipe ARGV`: wall seconds, CPU seconds (it and the workers it waited for), the load."""
    load = os.getloadavg()[0]
    ticks0, ru0 = _cpu_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([python, "-m", "tinypipe.cli", *argv], cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    ticks1, ru1 = _cpu_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} in {cwd} exited {res.returncode}: {res.stderr.strip()[-400:]}")
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    others = None
    if ticks0 is not None and ticks1 is not None and ticks1[1] > ticks0[1]:
        hz = os.sysconf("SC_CLK_TCK")
        busy, total = (ticks1[0] - ticks0[0]) / hz, (ticks1[1] - ticks0[1]) / hz
        others = max(0.0, min(1.0, (busy - cpu) / total))
    return {"wall_s": wall, "cpu_s": cpu, "others_busy": others, "loadavg_1min": load}


def _spread(xs: list[float], digits: int = 2) -> str:
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=None, help="git ref to compare with (default: merge-base HEAD main)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the before worktree and its venv for the next run")
    args = ap.parse_args()
    ref = args.before or _git("merge-base", "HEAD", "main")
    tree, sha = before_tree(ref)
    sides = {"before": (str(tree / ".venv" / "bin" / "python"), tree), "after": (sys.executable, ROOT)}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {s: [] for s in sides} for c in COMMANDS}
    for _ in range(args.repeat):
        for name, (argv, _target) in COMMANDS.items():
            for side, (python, cwd) in sides.items():
                runs[name][side].append(run(python, cwd, argv))
    rows = []
    for name, (_argv, target) in COMMANDS.items():
        b, a = runs[name]["before"], runs[name]["after"]
        wall_b, wall_a = [r["wall_s"] for r in b], [r["wall_s"] for r in a]
        others = [r["others_busy"] for r in b + a if r["others_busy"] is not None]
        speedup = statistics.median(wall_b) / statistics.median(wall_a)
        rows.append([name, _spread(wall_b), _spread(wall_a), f"{speedup:.2f}x",
                     _spread([r["cpu_s"] for r in b]), _spread([r["cpu_s"] for r in a]),
                     f"{100 * statistics.median(others):.0f}%" if others else "?",
                     "-" if target is None else f"{target:g}"])
    print(f"whole commands, median (range) of {args.repeat}, before = {sha[:10]}, after = this checkout; CPU s: the "
          f"command and its workers; others: the share of the {os.cpu_count()} cores other processes kept busy "
          "meanwhile")
    print(render(["command", "before wall s", "after wall s", "speed-up", "before CPU s", "after CPU s", "others",
                  "target s"], rows, align="lrrrrrrr"))
    path = write_json("cli_speed.json", {
        "before": sha, "repeat": args.repeat, "target_s": {n: t for n, (_, t) in COMMANDS.items()},
        "commands": {n: ["tinypipe", *argv] for n, (argv, _) in COMMANDS.items()},
        "env": {"PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE", "")}, "runs": runs})
    print(f"\nwrote {path}")
    if not args.keep:
        _git("worktree", "remove", "--force", str(tree))


if __name__ == "__main__":
    main()
