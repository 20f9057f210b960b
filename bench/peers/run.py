"""tinypipe beside its peers on the same GPU: every configuration in its own process, one
after another, under a time limit each and a deadline for all; one JSON and a Markdown table.

    python bench/peers/run.py [--runs tinypipe roundpipe ...] [--caps 24,none] [--gpus 1,2]
                              [--model llama-3.1-8b --layers 12] [--steps 3 --warmup 1] [--lora 16]
                              [--timeout-s 150 --deadline-s 540] [--out bench/results/peers_h200.json]

On the GPU machine: `bash bench/device/peers.sh` (README.md in this folder says more). A peer that
fails or runs out of time is a result, not the end of the run; bad options end in one line `error: ...`
and exit code 2 before anything starts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:  # run as a script: `peers` is a package of bench/
    sys.path.insert(0, str(BENCH))

from peers.commands import Paths, launch_for, site_problem  # noqa: E402
from peers.execute import execute  # noqa: E402
from peers.report import read_records, row, table, write_json  # noqa: E402
from peers.runs import DEFAULT_RUNS, RUNS, Config, configurations, parse_caps, parse_gpus  # noqa: E402
from peers.workload import BETAS, EPS, LR, WEIGHT_DECAY, Workload, add_workload_arguments, workload_of  # noqa: E402

DEFAULT_OUT = BENCH / "results" / "peers_h200.json"
SITES = {"roundpipe": Path("/tmp/peers-rp"), "deepspeed": Path("/tmp/peers-ds")}
CPU_SYSTEMS = ("fsdp2", "tinypipe")  # the systems whose scripts also run on the CPU (tests)


class UsageError(Exception):
    """A bad option: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line (exit code 2, by `main`)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    from peers.modelconfig import DEFAULT_LAYERS, DEFAULT_MODEL

    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), metavar="RUN",
                   help=f"what to run, in this order (default all: {' '.join(DEFAULT_RUNS)})")
    p.add_argument("--caps", default="24", help="GPU memory caps per GPU in GiB, comma-separated; none: uncapped "
                                                 "(default 24; e.g. 24,none)")
    p.add_argument("--gpus", default="1", help="GPU counts, comma-separated (default 1; e.g. 1,2)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"shipped model or config.json whose shapes are used "
                                                          f"(default {DEFAULT_MODEL})")
    p.add_argument("--layers", type=int, default=None,
                   help=f"decoder layers instead of the model's own (default {DEFAULT_LAYERS}; with --lora the "
                        "model's own: its frozen base fits the host where full training's state does not)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run, warm-up included (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps left out of tokens/s (default 1; some "
                                                          "systems need one more, see runs.py)")
    p.add_argument("--timeout-s", type=float, default=150.0, help="time limit of each run (default 150)")
    p.add_argument("--deadline-s", type=float, default=540.0,
                   help="all runs end within this many seconds: a run gets what is left, if at least "
                        "--min-start-s (default 540)")
    p.add_argument("--min-start-s", type=float, default=45.0, help="a run starts only with this much time left "
                                                                    "(default 45)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"the JSON (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--workdir", default=None, help="model config, per-run records and logs (default: a new "
                                                   "temporary directory)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the scripts that can run on the CPU, with gloo (tests)")
    for name, site in SITES.items():
        p.add_argument(f"--{name}-site", default=str(site), help=f"{name}'s private install (default {site})")
    add_workload_arguments(p)
    return p


def check(a: argparse.Namespace) -> tuple[Workload, tuple[int, ...], tuple[float | None, ...]]:
    """The options' numbers; UsageError for the first that is wrong."""
    unknown = [r for r in a.runs if r not in RUNS]
    if unknown:
        raise UsageError(f"--runs: unknown {', '.join(unknown)} (known: {', '.join(RUNS)})")
    if len(set(a.runs)) != len(a.runs):
        raise UsageError("--runs: a run is named twice")
    try:
        caps, gpus = parse_caps(a.caps), parse_gpus(a.gpus)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if a.warmup < 0 or a.steps <= a.warmup:
        raise UsageError(f"--steps {a.steps} --warmup {a.warmup}: need 0 <= warm-up < steps (a timed step)")
    for opt, value in (("--timeout-s", a.timeout_s), ("--deadline-s", a.deadline_s), ("--min-start-s", a.min_start_s)):
        if not value > 0:
            raise UsageError(f"{opt}: must be > 0, got {value:g}")
    if a.lora is None and a.lora_alpha is not None:
        raise UsageError("--lora-alpha needs --lora R")
    work = workload_of(a)
    for g in gpus:
        why = work.problem(g)
        if why:
            raise UsageError(why)
    out = Path(a.out)
    if out.exists() and out.is_dir():
        raise UsageError(f"--out {out}: is a directory; give a file name")
    return work, gpus, caps


def main(argv: list[str] | None = None) -> int:
    from tinypipe.common.errors import InputError

    try:
        a = parser().parse_args(argv)
        work, gpus, caps = check(a)
        return run_all(a, work, gpus, caps, sys.argv[1:] if argv is None else argv)
    except (UsageError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run_all(a: argparse.Namespace, work: Workload, gpus: tuple[int, ...], caps: tuple[float | None, ...],
            argv: list[str]) -> int:
    from peers.modelconfig import adapter_params_of, model_config, params_of, write_config

    start = time.monotonic()
    name, config = model_config(a.model, _layers(a.layers, work), work.seq_len)
    layers = int(config["num_hidden_layers"])
    present = _gpu_count(a.device)
    out = Path(a.out)
    _writable(out)
    workdir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="peers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config_dir = write_config(workdir / "model", name, config)
    paths = Paths(python=sys.executable, bench=BENCH, config_dir=config_dir, work=workdir,
                  sites={k: Path(getattr(a, f"{k}_site")) for k in SITES})
    params = params_of(config_dir)
    lora = work.lora.to_json() if work.lora else None
    common = {"model": f"{name} with {layers} decoder layers", "layers": layers, "lora": lora,
              "tokens_per_step": work.batch_tokens, "seq_len": work.seq_len, "microbatch_size": work.microbatch_size}
    model: dict[str, Any] = {"name": name, "layers": layers, "params": params, "config": config}
    if work.lora:
        model["adapter_params"] = adapter_params_of(config_dir, work.lora)
    payload: dict[str, Any] = {
        "machine": _machine(), "runner": {"argv": argv, "workdir": str(workdir)}, "model": model,
        "workload": {**asdict(work), "lora": lora, "lr": LR, "betas": list(BETAS), "eps": EPS,
                     "weight_decay": WEIGHT_DECAY, "compute": "bf16", "master_weights": "fp32", "adamw_state": "fp32"},
        "results": []}
    configs = configurations(tuple(a.runs), gpus, caps)
    for i, cfg in enumerate(configs, 1):
        left = a.deadline_s - (time.monotonic() - start)
        result = _one(cfg, a, work, paths, common={**common, "params": params}, left_s=left, present=present)
        payload["results"].append(result)
        write_json(out, payload)
        tps = result.get("tokens_per_s")
        print(f"[{i}/{len(configs)}] {cfg.key}: {result['status']}"
              + (f", {tps:,.0f} tokens/s" if tps else "")
              + (f" ({result['error_summary']})" if result.get("error_summary") else "")
              + (f", {result['wall_s']:.0f} s" if result.get("wall_s") is not None else ""),
              file=sys.stderr, flush=True)
    print(table(payload["results"]))
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


def _one(cfg: Config, a: argparse.Namespace, work: Workload, paths: Paths, *, common: dict[str, Any],
         left_s: float, present: int) -> dict[str, Any]:
    """Run one configuration (or say why not) and return its row."""
    launch = launch_for(cfg, paths, work, timed_steps=a.steps - a.warmup, warmup=a.warmup, device=a.device)
    skip = None
    if work.lora is not None and cfg.run.no_lora:
        skip = f"no LoRA: {cfg.run.no_lora}"
    elif cfg.gpus > present:
        skip = f"needs {cfg.gpus} GPU(s), {present} here"
    elif a.device == "cpu" and cfg.run.system not in CPU_SYSTEMS:
        skip = f"{cfg.run.system} runs on CUDA only"
    elif left_s < a.min_start_s:
        skip = f"{max(0.0, left_s):.0f} s of the runner's deadline left, a run starts with at least {a.min_start_s:g} s"
    if skip is not None:
        return row(cfg, records=[], ranks=launch.ranks, outcome=None, common=common, skipped=skip)
    problem = site_problem(cfg, paths)
    if problem is not None:
        return {**row(cfg, records=[], ranks=launch.ranks, outcome=None, common=common), "error": problem,
                "error_summary": problem.splitlines()[0]}
    log = paths.work / f"{cfg.key}.log"
    for old in paths.work.glob(f"{cfg.key}.rank*.json"):  # an earlier runner's, in a reused --workdir
        old.unlink()
    # not the repository root: its tinypipe/ folder would shadow the installed package (whose
    # tinypipe.backends the package-dir mapping provides), since `python -m` puts the cwd first on sys.path
    outcome = execute(launch.argv, launch.env, timeout_s=min(a.timeout_s, left_s), log=log, cwd=paths.work)
    records = read_records(launch.result_prefix, launch.ranks)
    return row(cfg, records=records, ranks=launch.ranks, outcome=outcome, common=common, log=str(log))


def _layers(asked: int | None, work: Workload) -> int | None:
    """The decoder layers to build: those asked for; else DEFAULT_LAYERS for full training (its host state
    does not fit the 1-GPU machine for the whole 8B, modelconfig.py says why) and the model's own (None)
    for LoRA, whose frozen base does."""
    from peers.modelconfig import DEFAULT_LAYERS

    if asked is not None:
        return asked
    return None if work.lora else DEFAULT_LAYERS


def _gpu_count(device: str) -> int:
    """GPUs here (CPU: as many stand-ins as asked for)."""
    if device == "cpu":
        return 1 << 10
    try:
        import torch
    except ImportError:
        raise UsageError("--device cuda: torch is not importable here") from None
    if not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here (--device cpu runs the CPU stand-ins)")
    return int(torch.cuda.device_count())


def _writable(out: Path) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot make its folder ({exc.strerror or exc})") from None
    if not os.access(out if out.exists() else out.parent, os.W_OK):
        raise UsageError(f"--out {out}: not writable")


def _machine() -> dict[str, Any]:
    from _common import machine

    facts = machine()
    facts["date_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                facts["host_memory_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return facts


if __name__ == "__main__":
    sys.exit(main())
