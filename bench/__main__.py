"""tinypipe's benchmarks as one suite: `python -m bench SUITE [SCRIPT ...]`, `python -m bench --list`.

Each suite is a list of scripts run one after another, from the repository root, each in its own
process (as `python bench/SCRIPT.py` or `bash bench/device/SCRIPT.sh`). bench/README.md says what each
script measures and which table of README.md or docs/ it feeds.

    python -m bench --list              the suites and their scripts
    python -m bench sim                 every simulator table (no GPU; minutes on 2 cores)
    python -m bench sim pack_sweep      one script of a suite
    python -m bench cpu                 the default job, as README.md quotes it
    python -m bench device              the GPU scripts and how to run them (they need CUDA GPUs)
    python -m bench device peers -- --runs tinypipe roundpipe   run one, with its own arguments
    python -m bench test                the bench code's own tests (bench/peers/tests)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


@dataclass(frozen=True)
class Script:
    """One benchmark: how to run it, what it writes, and the table it feeds."""

    name: str
    command: tuple[str, ...]
    writes: str
    feeds: str


def _py(name: str, writes: str, feeds: str) -> Script:
    return Script(name, (sys.executable, f"bench/{name}.py"), writes, feeds)


def _sh(name: str, writes: str, feeds: str) -> Script:
    return Script(name, ("bash", f"bench/device/{name}.sh"), writes, feeds)


SUITES: dict[str, tuple[str, tuple[Script, ...]]] = {
    "sim": ("the simulator's tables: no GPU, one process per script", (
        _py("sim_bench", "results/sim.json", "docs/performance.md: How fast the tools are"),
        _py("compile_bench", "results/compile.json", "docs/performance.md: How fast the tools are"),
        _py("pack_sweep", "results/pack_sweep.json, pack_sweep.png", "docs/performance.md: Pack size"),
        _py("calibrate_cost", "results/calibrate_cost.json", "docs/performance.md: Pack size (the calibration)"),
        _py("search_bench", "results/search.json", "docs/performance.md: The search"),
        _py("sim_policies", "results/sim_policies.json", "docs/performance.md: Simulated comparisons"),
        _py("cli_speed", "results/cli_speed.json", "docs/performance.md: How fast the tools are (whole commands)"),
    )),
    "cpu": ("the default job on this machine's CPU", (
        _py("default_run", "results/default_run.json", "README.md: Try it"),
        _py("grad_norm_cost", "results/grad_norm_cost.json", "docs/training.md: Outputs (--no-grad-norm)"),
        _py("host_optim_precision", "results/host_optim_precision.json",
            "docs/memory.md: host optimizer speed per state precision; hostmem.STATE_TIME_FACTOR"),
        _py("optim_state_curves", "results/optim_state_curves.json", "docs/memory.md: loss curves per state precision"),
        _py("rss_phases", "results/rss_phases.json", "docs/memory.md: the start of a run"),
        _py("clip_cost", "results/clip_cost.json", "docs/training.md: Optimisation (--max-grad-norm)"),
        _py("packing_attention", "results/packing_attention.json",
            "docs/performance.md: Packed sequences (--device cuda on a GPU)"),
    )),
    "device": ("runs on CUDA GPUs (H200s for the published tables); each appends to results/ or $OUT", (
        _sh("peers", "$OUT/peers_h200.json (with --lora: peers_h200_lora.json)",
            "README.md and docs/performance.md: Beside the peers"),
        _sh("cuda_bench", "$OUT/cuda_h200.jsonl", "docs/performance.md: Llama-3.1-8B on H200s (eager)"),
        _sh("llama_compile", "$OUT/cuda_h200.jsonl", "docs/performance.md: Llama-3.1-8B on H200s (compiled)"),
        _sh("compile_qwen3", "$OUT/cuda_h200.jsonl, profiles", "docs/performance.md: compiled blocks"),
        _sh("fidelity_h200", "$OUT/cuda_h200.jsonl, profiles, traces", "docs/fidelity.md (then `fidelity`)"),
        _sh("profile_h200", "$OUT/p8, $OUT/pq, a run's trace and replay", "profiles for --profile"),
        _sh("frugal_h200", "$OUT/frugal_h200.jsonl, host_optim_precision_h200.json",
            "docs/memory.md: 8B with low-precision state, checkpoints on a 64 GiB disk"),
        _sh("frugal_8b", "$OUT/frugal_h200.jsonl, traces",
            "README.md and docs/memory.md: Llama-3.1-8B with 8-bit moments at 24 GiB, the host step in a run"),
        _sh("optim_threads_h200", "$OUT/frugal_h200.jsonl, host_optim_precision_h200.json, traces",
            "docs/memory.md: the host step per precision and thread count; the optimizer's threads in a run"),
        _sh("trust_h200", "$OUT/trust_h200.json, search.json, runs' summaries and traces",
            "docs/trust.md: predicted vs measured on a fresh machine (DRY=1: tiny-llama on the CPU)"),
        _sh("lora_h200", "$OUT/cuda_h200.jsonl (1gpu-lora cases)",
            "README.md: LoRA on a frozen, streamed base; docs/performance.md: LoRA"),
        _py("fidelity", "results/fidelity.jsonl", "README.md and docs/fidelity.md: prediction error"),
    )),
    "test": ("the bench code's own tests (pytest)", (
        Script("peers-tests", (sys.executable, "-m", "pytest", "-q", "bench/peers/tests"), "nothing",
               "no table: checks bench/peers"),
    )),
}


def shown(command: tuple[str, ...] | list[str]) -> str:
    """A command as a person would type it (`python`, not this interpreter's path)."""
    return " ".join(("python", *command[1:]) if command[0] == sys.executable else command)


def list_suites() -> str:
    lines = []
    for suite, (what, scripts) in SUITES.items():
        lines.append(f"{suite}: {what}")
        for s in scripts:
            lines.append(f"  {s.name:15s} {shown(s.command)}")
            lines.append(f"  {'':15s} -> {s.writes}; feeds {s.feeds}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    ap = argparse.ArgumentParser(prog="python -m bench", description="tinypipe's benchmark suites")
    ap.add_argument("suite", nargs="?", choices=sorted(SUITES))
    ap.add_argument("scripts", nargs="*", help="only these scripts of the suite (default: all)")
    ap.add_argument("--list", action="store_true", help="print the suites and their scripts")
    ap.add_argument("--run", action="store_true", help="device suite: run the scripts (default: print them)")
    a = ap.parse_args(argv)
    if a.list or a.suite is None:
        print(list_suites())
        return 0
    scripts = SUITES[a.suite][1]
    names = {s.name for s in scripts}
    unknown = [n for n in a.scripts if n not in names]
    if unknown:
        print(f"error: {a.suite} has no script {', '.join(unknown)} (it has: {', '.join(sorted(names))})",
              file=sys.stderr)
        return 2
    chosen = [s for s in scripts if not a.scripts or s.name in a.scripts]
    if a.suite == "device" and not (a.run or a.scripts):
        print("these need CUDA GPUs; run one with `python -m bench device NAME [-- ARGS]`:")
        print("\n".join(f"  {shown(s.command)}  -> {s.writes}" for s in chosen))
        return 0
    if a.suite == "device" and shutil.which("nvidia-smi") is None:
        print("warning: no nvidia-smi on PATH; the device scripts need CUDA GPUs", file=sys.stderr)
    failed = []
    for s in chosen:
        cmd = [*s.command, *extra]
        print(f"== {s.name}: {shown(cmd)}", flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            failed.append(s.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
