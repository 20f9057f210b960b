"""Fidelity on H200s (docs/fidelity.md): every run predicted from a profile, beside its measurement.

    python bench/fidelity.py [--records bench/results/cuda_h200.jsonl] [--profile DIR] [--profile-2gpu DIR]
                             [--out bench/results/fidelity.jsonl] [--optimizer-from own|eager] [--phases]

Measured: the runs of bench/device/fidelity_h200.sh, the records of --records whose case has `-fid-`
(the latest of each case and policy; none marked `not_fidelity`): the iteration time is the mean of the
iterations after the record's warm-up ones, peak GPU memory the allocator's peak (max_memory_allocated).
Predicted: `tinypipe simulate` of the record's model and policy (the JSON the run resolved, microbatch size
inside), 65,536 tokens per step, seq 2048 and its GPU cap, with the profile folder of its model and block
mode (pq / pq-compiled: Qwen3-1.7B, pl / pl-compiled: Llama-3.1-8B) under the record's `profile_root` (the
profile taken on the run's own machine just before it; bench/device/ingest.py records it), else under
--profile (1 GPU) or --profile-2gpu (2 GPUs), and the hardware.json of that folder, else of pq/. Nothing
of the run goes into its prediction. Each folder's own host optimizer steps are used (`--optimizer-from
own`; `eager`: the eager folder's for compiled rows too); the steps by phase are left out unless --phases
(`tinypipe profile --optimizer-phases`).
Writes one JSON object per configuration to --out and prints the table, with `steal`: the share of the
host's CPU time the hypervisor took during the run (backends/rank/cpustat.py); runs above 1% are listed, and
the errors given without them as well.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tinypipe.backends.rank.cpustat import NOTABLE_STEAL
from tinypipe.common.units import GIB

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEVICE = "NVIDIA H200"
FOLDER = {"qwen3-1.7b": "pq", "llama-3.1-8b": "pl"}


def fidelity_records(path: Path) -> list[dict[str, Any]]:
    """The latest successful record of each `-fid-` case and policy, in the order first seen (a search
    pick's label, `-rank-K`, names another policy when the search ran on another profile)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "-fid-" in rec.get("case", "") and rec.get("tokens_per_s") and not rec.get("not_fidelity"):
            policy = {k: v for k, v in rec.get("policy", {}).items() if k != "name"}
            out[rec["case"], json.dumps(policy, sort_keys=True)] = rec
    return list(out.values())


def profile_folder(rec: dict[str, Any], profile: Path) -> Path:
    compiled = "--compile" in rec.get("run_options", [])
    return profile / (FOLDER[rec["model"]] + ("-compiled" if compiled else ""))


PHASE_FIELDS = ("async_alone_s", "beside_fwd_s", "beside_bwd_s", "async_beside_fwd_s", "async_beside_bwd_s")


def prepared(folder: Path, eager: Path | None, phases: bool, into: Path) -> Path:
    """A copy of `folder`'s traces in `into`: each kind's optimizer steps taken from `eager`'s traces (unless
    None), and without the steps by phase unless `phases` (`tinypipe profile` measures them only with
    --optimizer-phases; the profile of 2026-12-01 call 3 was taken while it did by default)."""
    steps = {}
    for f in sorted(eager.glob("h200-*.json")) if eager is not None else ():
        for kind, p in json.loads(f.read_text())["kinds"].items():
            if "optimizer" in p:
                steps[kind] = p["optimizer"]
    into.mkdir(parents=True, exist_ok=True)
    for f in sorted(folder.glob("h200-*.json")):
        trace = json.loads(f.read_text())
        for kind, p in trace["kinds"].items():
            if kind in steps:
                p["optimizer"] = dict(steps[kind])
            for key in () if phases or "optimizer" not in p else PHASE_FIELDS:
                p["optimizer"].pop(key, None)
        (into / f.name).write_text(json.dumps(trace))
    return into


def predict(rec: dict[str, Any], profile: Path, optimizer_from: str, phases: bool = False) -> dict[str, Any]:
    folder = profile_folder(rec, profile)
    hw = folder / "hardware.json"
    if not hw.exists():
        hw = profile / "pq" / "hardware.json"
    tmp = Path(tempfile.mkdtemp(prefix="fidelity-"))
    shown = folder
    eager = profile / FOLDER[rec["model"]] if optimizer_from == "eager" and folder.name.endswith("-compiled") else None
    folder = prepared(folder, eager, phases, tmp / folder.name)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(rec["policy"], f)
    cmd = [sys.executable, "-m", "tinypipe.cli", "simulate", "--model", rec["model"], "--hardware", str(hw),
           "--profile", str(folder), "--policy", f.name, "--gpu-mem", f"{rec['gpu_mem_cap_gib']:g}GiB",
           "--seq-len", "2048", "--batch-tokens", str(rec["tokens_per_step"]), "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    finally:
        Path(f.name).unlink()
        shutil.rmtree(tmp, ignore_errors=True)
    r = json.loads(out.stdout)["results"][0]
    note = " (its optimizer steps from the eager folder)" if eager is not None else ""
    cmd[cmd.index("--profile") + 1] = str(shown) + note
    rel = [str(Path(x).relative_to(ROOT)) if x.startswith(str(ROOT)) else x for x in cmd[3:]]
    r["command"] = "tinypipe " + " ".join(rel).replace(f.name, "<the record's policy JSON>")
    return dict(r)


def describe(rec: dict[str, Any]) -> str:
    p = rec["policy"]
    mode = "compiled" if "--compile" in rec.get("run_options", []) else "eager"
    gpus = f"{rec['gpus']} GPU" + ("s" if rec["gpus"] > 1 else "")
    return (f"{rec['model']} {gpus} {p['name']} ({p['host_memory']}, {p['optimizer']}), {p['microbatch_size']} x 2048, "
            f"{mode}")


def rows(profiles: dict[int, Path], records: Path, optimizer_from: str, phases: bool = False) -> list[dict[str, Any]]:
    out = []
    for rec in fidelity_records(records):
        # the profile taken on the run's own machine, where the record names it
        profile = ROOT / rec["profile_root"] if "profile_root" in rec else profiles.get(rec["gpus"])
        if profile is None or not profile.exists():
            print(f"{rec['case']}: left out, no profile for {rec['gpus']} GPU(s) ({profile})", file=sys.stderr)
            continue
        pred = predict(rec, profile, optimizer_from, phases)
        out.append({"config": describe(rec), "case": rec["case"], "measured_iteration_s": rec["iteration_s"],
                    "warmup_iterations": rec["warmup_iterations"], "predicted_iteration_s": pred["iteration_s"],
                    "measured_peak_gpu_bytes": rec["peak_gpu_bytes"],
                    "predicted_peak_gpu_bytes": pred["peak_gpu_bytes"],
                    "iteration_error": pred["iteration_s"] / rec["iteration_s"] - 1,
                    "peak_gpu_error": pred["peak_gpu_bytes"] / rec["peak_gpu_bytes"] - 1,
                    "predict_command": pred["command"], "device": DEVICE, "date": rec["date"],
                    "machine_call": rec.get("machine_call", ""), "run": run_label(rec),
                    "run_host_steal_share": rec.get("host_steal_share")})
    return out


def run_label(rec: dict[str, Any]) -> str:
    """Where a record was measured, short: s4c2 (session 4's device call 2), marked * when its profile was
    taken on another lent machine; `s1` for the first session's records, which name no call."""
    m = re.search(r"session (\d+), device call (\d+)", rec.get("machine_call", ""))
    if m is None:
        return "s1"
    return f"s{m.group(1)}c{m.group(2)}" + ("*" if "another lent machine" in rec["machine_call"] else "")


def summary(rs: list[dict[str, Any]], what: str) -> str:
    errs = [abs(r["iteration_error"]) for r in rs]
    mem = [abs(r["peak_gpu_error"]) for r in rs]
    return (f"{what}: iteration |error| median {100 * statistics.median(errs):.1f}%, worst {100 * max(errs):.1f}%; "
            f"peak GPU |error| median {100 * statistics.median(mem):.1f}%, worst {100 * max(mem):.1f}%")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=str(RESULTS / "profile_h200_fid"), help="the 1-GPU runs' profile")
    ap.add_argument("--profile-2gpu", default=str(RESULTS / "profile_h200x2_fid"), help="the 2-GPU runs' profile")
    ap.add_argument("--records", default=str(RESULTS / "cuda_h200.jsonl"))
    ap.add_argument("--out", default=str(RESULTS / "fidelity.jsonl"))
    ap.add_argument("--optimizer-from", choices=("eager", "own"), default="own",
                    help="the host optimizer's steps of compiled rows: the eager folder's, or the compiled folder's")
    ap.add_argument("--phases", action="store_true",
                    help="keep the optimizer's steps by phase where a profile has them (left out by default)")
    a = ap.parse_args()
    rs = rows({1: Path(a.profile), 2: Path(a.profile_2gpu)}, Path(a.records), a.optimizer_from, a.phases)
    if not rs:
        print(f"error: {a.records}: no `-fid-` records", file=sys.stderr)
        return 2
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rs))
    w = max(len(r["config"]) for r in rs)
    print(f"{'config':{w}s} {'run':5s} {'measured s':>10s} {'predicted s':>11s} {'error':>7s} {'GPU GiB':>8s} "
          f"{'pred GiB':>8s} {'error':>7s} {'steal':>6s}")
    for r in rs:
        steal = r["run_host_steal_share"]
        print(f"{r['config']:{w}s} {r['run']:5s} {r['measured_iteration_s']:10.3f} {r['predicted_iteration_s']:11.3f} "
              f"{100 * r['iteration_error']:+6.1f}% {r['measured_peak_gpu_bytes'] / GIB:8.2f} "
              f"{r['predicted_peak_gpu_bytes'] / GIB:8.2f} {100 * r['peak_gpu_error']:+6.1f}% "
              + ("     -" if steal is None else f"{100 * steal:5.1f}%"))
    print(summary(rs, f"{len(rs)} configurations"))
    stolen = [r for r in rs if (r["run_host_steal_share"] or 0) > NOTABLE_STEAL]
    if stolen:
        print(f"{len(stolen)} run(s) saw the hypervisor take more than {100 * NOTABLE_STEAL:.0f}% of the host's CPU "
              f"time (steal; `-` where not recorded): "
              + "; ".join(f"{r['config']} ({r['run']}, {100 * r['iteration_error']:+.1f}%)" for r in stolen))
        print(summary([r for r in rs if r not in stolen], "without them"))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
