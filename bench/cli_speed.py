"""Whole-command speed of `tinypipe simulate` (70B on 8 RTX 4090) and `tinypipe search` (8B on one H200), before
and after, side by side in one run.

    python bench/cli_speed.py [--before REF] [--repeat N]

"Before" is REF (default: the merge base of HEAD and main) checked out into a temporary git worktree with
its own virtual environment (an editable install, no downloads); "after" is this checkout. The two are
run alternately, REPEAT times each, so that what else runs on the machine weighs on both alike; the
table gives each one's median and range of wall-clock seconds. Writes bench/results/cli_speed.json. The
temporary worktree is removed at the end (`--keep` keeps it, and its venv, for the next run).
The targets (issue 26): simulate under 3 s, search under 10 s on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_json

from tinypipe.common.table import render

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "simulate 70B x 8 RTX 4090, 32 microbatches": ["simulate", "--model", "llama-3.1-70b", "--hardware",
                                                   "rtx4090x8-pcie4", "--microbatches", "32"],
    "search 8B on one H200, --gpu-mem 24GiB": ["search", "--model", "llama-3.1-8b", "--hardware", "h200x1",
                                              "--gpu-mem", "24GiB"],
}
TARGET_S = {"simulate 70B x 8 RTX 4090, 32 microbatches": 3.0, "search 8B on one H200, --gpu-mem 24GiB": 10.0}


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


def wall_s(python: str, cwd: Path, argv: list[str]) -> float:
    t0 = time.perf_counter()
    res = subprocess.run([python, "-m", "tinypipe.cli", *argv], cwd=cwd, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} in {cwd} exited {res.returncode}: {res.stderr.strip()[-400:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=None, help="git ref to compare with (default: merge-base HEAD main)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the before worktree and its venv for the next run")
    args = ap.parse_args()
    ref = args.before or _git("merge-base", "HEAD", "main")
    tree, sha = before_tree(ref)
    sides = {"before": (str(tree / ".venv" / "bin" / "python"), tree), "after": (sys.executable, ROOT)}
    times: dict[str, dict[str, list[float]]] = {c: {s: [] for s in sides} for c in COMMANDS}
    for _ in range(args.repeat):
        for name, argv in COMMANDS.items():
            for side, (python, cwd) in sides.items():
                times[name][side].append(wall_s(python, cwd, argv))
    rows = []
    for name in COMMANDS:
        b, a = times[name]["before"], times[name]["after"]
        rows.append([name, f"{statistics.median(b):.2f} ({min(b):.2f}-{max(b):.2f})",
                     f"{statistics.median(a):.2f} ({min(a):.2f}-{max(a):.2f})",
                     f"{statistics.median(b) / statistics.median(a):.2f}x", f"{TARGET_S[name]:g}"])
    print(f"whole-command wall seconds, median (range) of {args.repeat}; before = {sha[:10]}, after = this checkout")
    print(render(["command", "before s", "after s", "speed-up", "target s"], rows, align="lrrrr"))
    path = write_json("cli_speed.json", {"before": sha, "repeat": args.repeat, "target_s": TARGET_S,
                                         "wall_s": times})
    print(f"\nwrote {path}")
    if not args.keep:
        _git("worktree", "remove", "--force", str(tree))


if __name__ == "__main__":
    main()
