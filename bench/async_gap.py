"""Why the async H200 fidelity runs are slower than predicted: the gap, cause by cause, measured from the traces.

    python bench/async_gap.py [--traces bench/results/fidelity_h200_traces.tgz] [--out FILE]

For each Qwen3-1.7B run of bench/results/fidelity.jsonl (async and its sync counterpart, compiled 4 x 2048
and eager 2 x 2048) the gap between the record's measured iteration (mean of iterations 2..5, as
bench/fidelity.py compares) and bench/fidelity.py's prediction (the same profile: profile_h200_fid, the
compiled row with the eager folder's optimizer steps) is split into causes that add up to it:

- window: the record's mean minus the first window's steady iterations (2..3). `tinypipe run` runs the
  compiled 4 iterations as a window and drains the streams at its end (backends/worker.py), so step 4
  starts a new window; the simulator's steady state has no such drain.
- iterations: the prediction compiled for 3 iterations (bench/fidelity.py) against the run's 4 (steady 2..3).
- durations: the simulator run with the trace's own durations for a group of kinds (OPT_STEP; FWD / BWD;
  copies and EVICT) and the profile's for the rest; each group's share is its Shapley value over the
  three (the mean of its effect over the orders of adding them), so the shares add up to the replay.
- issue: the measured steady minus the replay (the simulator with every measured duration): waits the
  simulator has no cause for. Split into the compute stream's waits for the main thread to issue the
  next FWD / BWD (its start after everything it waits for had ended: added to the action, replayed again)
  and the rest.

Then, per run: the block OPT_STEPs by what the compute stream ran while each did (FWD, BWD, nothing: each
step's overlap with them), the per-phase step time that a fluid fit gives (each step's overlaps over the
phase's time sum to one step), the durations' effect split by the steps' main phase, the compute stream's
idle time by what it waited for, and the critical path of the steady iterations by resource and kind.

Last, the phase model's check (sim/engine.py: an OPT_STEP's rate follows its rank's compute phase, from
`OptimizerProfile.phases_s`, which `tinypipe profile` now measures; profile_h200_fid predates it): the
prediction again, with the block's step by phase taken from the fluid fit of (a) this run's own trace (is
the model's structure enough, given the right times?) and (b) the trace of an earlier run of the same
configuration on another lent machine (bench/results/cuda_h200_1gpu-preset-*qwen3*: compile_qwen3.sh's
calls), standing in for a profile taken apart from the run. The embedding's and the head's steps keep
the profile's one time. A phase a run never showed (the sync runs' steps never overlap a FWD) takes the
BWD phase's time.
Likewise the issue gaps (`LoopTimes.*_gap_s`, the loop's wait for the main thread before a back-to-back
FWD / BWD; profile_h200_fid predates them too): the mean wait of the run's recomputed block FWDs / BWDs
that followed a FWD / BWD on the compute stream and waited for nothing else, with and without an OPT_STEP
running when the one before ended, and the prediction with them as the block's gaps (this run's, an
earlier run's).
Writes bench/results/async_gap.json (or --out); tables on stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import tarfile
import tempfile
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from _common import write_json
from tinypipe.sim import simulate
from tinypipe.sim.result import critical_path

from tinypipe.common.table import render
from tinypipe.compiler import compile_schedule
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.trace import ProfileTrace, load_trace
from tinypipe.ir.order import pair_halves, predecessors
from tinypipe.ir.schedule import Action, Schedule
from tinypipe.ir.timeline import Record, Timeline
from tinypipe.replay.runner import add_replay_arguments, settle
from tinypipe.replay.trace_match import effective_durations, lanes, load_run_trace, match_window

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PROFILE = RESULTS / "profile_h200_fid"
CASES = ("1gpu-preset-async-fid-qwen3-mb4-compile", "1gpu-preset-fid-qwen3-mb4-compile",
         "1gpu-preset-async-fid-qwen3-mb2-eager", "1gpu-preset-fid-qwen3-mb2-eager")
WARMUP = 2  # the record's and the replay's steady state: iterations 2..
GROUPS: dict[str, Callable[[Action], bool]] = {
    "OPT_STEP": lambda a: a.kind.value == "OPT_STEP",
    "FWD/BWD": lambda a: a.kind.value in ("FWD", "BWD"),
    "copies": lambda a: a.kind.value not in ("OPT_STEP", "FWD", "BWD"),
}
PHASES = ("FWD", "BWD", "idle")
# an earlier run of each configuration (bench/device/compile_qwen3.sh, another lent machine): the phase model's check
EARLIER = {"1gpu-preset-async-fid-qwen3-mb4-compile": "cuda_h200_1gpu-preset-async-qwen3-mb4-compiled.trace.json",
           "1gpu-preset-fid-qwen3-mb4-compile": "cuda_h200_1gpu-preset-qwen3-mb4-compiled.trace.json",
           "1gpu-preset-async-fid-qwen3-mb2-eager": "cuda_h200_1gpu-preset-async-qwen3-mb2.trace.json",
           "1gpu-preset-fid-qwen3-mb2-eager": "cuda_h200_1gpu-preset-qwen3-mb2.trace.json"}
SLACK_S = 1e-4  # a predecessor that ended this much after the previous action on the stream is what it waited for


def steady(times: Sequence[float]) -> float:
    return statistics.fmean(times[WARMUP:])


def fidelity_profile(compiled: bool, microbatch_size: int) -> ProfileTrace:
    """The trace bench/fidelity.py predicts the row with: the compiled row's with the eager folder's steps."""
    eager = load_trace(str(PROFILE / "pq" / f"h200-qwen3-1.7b-mb{microbatch_size}-seq2048.json"))
    if not compiled:
        return eager
    obj = json.loads((PROFILE / "pq-compiled" / "h200-qwen3-1.7b-mb4-seq2048-compiled.json").read_text())
    for kind, p in obj["kinds"].items():
        p["optimizer"] = eager.kinds[kind].optimizer.to_json()  # type: ignore[union-attr]
    return ProfileTrace.from_json(obj)


def stream_waits(schedule: Schedule, window: Sequence[Record], resource: str, its: Sequence[int]
                 ) -> tuple[dict[str, float], dict[int, float]]:
    """Idle time of `resource` before its actions of iterations `its`, by the kind of what it waited for
    ("issue": nothing it depends on ended after the previous action on the stream), and the issue waits
    of its FWDs / BWDs by action id."""
    acts, preds = schedule.actions, predecessors(schedule.actions)
    by: dict[str, float] = defaultdict(float)
    issue: dict[int, float] = {}
    prev = None
    for a in (x for x in acts if x.resource == resource):
        r = window[a.id]
        if prev is not None and a.iteration in its and r.start_s > window[prev].end_s:
            gap = r.start_s - window[prev].end_s
            last = max(preds[a.id], key=lambda d: window[d].end_s, default=None)
            if last is not None and window[last].end_s > window[prev].end_s + SLACK_S:
                by[acts[last].kind.value] += gap
            else:
                by["issue"] += gap
                if a.kind.value in ("FWD", "BWD"):
                    issue[a.id] = gap
        prev = a.id
    return dict(by), issue


def step_phases(schedule: Schedule, window: Sequence[Record], ids: Sequence[int]) -> np.ndarray:
    """Per OPT_STEP of `ids`: seconds it overlapped a FWD, a BWD and neither on its GPU's compute stream."""
    busy = sorted((window[a.id].start_s, window[a.id].end_s, a.kind.value) for a in schedule.actions
                  if a.kind.value in ("FWD", "BWD"))
    out = []
    for i in ids:
        t0, t1 = window[i].start_s, window[i].end_s
        f = b = 0.0
        for x, y, k in busy:
            if x >= t1:
                break
            if y > t0:
                if k == "FWD":
                    f += min(t1, y) - max(t0, x)
                else:
                    b += min(t1, y) - max(t0, x)
        out.append((f, b, t1 - t0 - f - b))
    return np.array(out)


def replayed(trace_path: Path) -> tuple[Any, Any, Any]:
    """A run trace's replay setup, its schedule recompiled as the run compiled it, and the run's records
    matched to that schedule's actions (`tinypipe replay`'s steps)."""
    ap = argparse.ArgumentParser()
    add_replay_arguments(ap)
    trace = load_run_trace(trace_path)
    setup = settle(trace, ap.parse_args([str(trace_path)]))
    sched = compile_schedule(setup.policy, setup.model, setup.hardware, setup.profile, iterations=setup.iterations)
    _, window = match_window(sched, trace)
    return setup, sched, window


def block_phases_s(trace_path: Path) -> tuple[float, float, float]:
    """The fluid fit of a run's block OPT_STEPs (the steady iterations' and the one before): seconds of a step
    wholly beside FWDs, BWDs, and neither; a phase no step overlapped takes the BWD phase's."""
    setup, sched, window = replayed(trace_path)
    blocks = [a.id for a in sched.actions if a.kind.value == "OPT_STEP" and setup.model.layers[a.layer].kind.value
              == "block" and WARMUP - 1 <= a.iteration < sched.iterations - 1]
    over = step_phases(sched, window, blocks)
    seen = over.sum(axis=0) > 0
    rates, *_ = np.linalg.lstsq(over[:, seen], np.ones(len(blocks)), rcond=None)
    t = dict(zip(np.flatnonzero(seen), 1 / rates))
    return t.get(0, t[1]), t[1], t[2]


def issue_gap_means(trace_path: Path) -> dict[str, float]:
    """A run's mean issue gap (s) before a block's FWD / BWD of the steady iterations that followed a FWD / BWD
    on the compute stream and waited for nothing else, keyed `fwd` / `bwd` and `*_beside` (an OPT_STEP was
    running when the previous one ended): what `tinypipe profile` measures as the loop's `*_gap_s`."""
    setup, sched, window = replayed(trace_path)
    acts, preds = sched.actions, predecessors(sched.actions)
    steps = sorted((window[a.id].start_s, window[a.id].end_s) for a in acts if a.kind.value == "OPT_STEP")
    gaps: dict[str, list[float]] = defaultdict(list)
    prev = None
    for a in (x for x in acts if x.resource.endswith(".compute")):
        p = acts[prev] if prev is not None else None
        if (p is not None and a.iteration >= WARMUP and a.kind.value in ("FWD", "BWD")
                and p.kind.value in ("FWD", "BWD") and setup.model.layers[a.layer].kind.value == "block"):
            t = window[p.id].end_s
            if all(window[d].end_s <= t + SLACK_S for d in preds[a.id]):
                beside = any(x <= t < y for x, y in steps)
                gaps[a.kind.value.lower() + ("_beside" if beside else "")].append(max(0.0, window[a.id].start_s - t))
        prev = a.id
    return {k: statistics.fmean(v) for k, v in sorted(gaps.items())}


def with_block_gaps(profile: ProfileTrace, gaps: Mapping[str, float]) -> ProfileTrace:
    """`profile` with its block's loop issue gaps from `issue_gap_means` (a condition not seen: the other one)."""
    block = profile.kinds["block"]
    assert block.loop is not None

    def gap(kind: str, beside: bool) -> float:
        key = kind + ("_beside" if beside else "")
        return gaps.get(key, gaps.get(kind + ("" if beside else "_beside"), 0.0))

    loop = replace(block.loop, fwd_gap_s=gap("fwd", False), recompute_bwd_gap_s=gap("bwd", False),
                   fwd_gap_beside_optimizer_s=gap("fwd", True), recompute_bwd_gap_beside_optimizer_s=gap("bwd", True))
    return replace(profile, kinds={**profile.kinds, "block": replace(block, loop=loop)})


def with_block_phases(profile: ProfileTrace, phases: tuple[float, float, float], layout: str, asynchronous: bool
                      ) -> ProfileTrace:
    """`profile` with its block's step by phase (FWD, BWD, idle seconds) for `layout` and the optimizer mode."""
    fwd, bwd, idle = phases
    block = profile.kinds["block"]
    assert block.optimizer is not None
    pre = "async_" if asynchronous else ""
    opt = replace(block.optimizer, **{f"{pre}beside_fwd_s": {layout: fwd}, f"{pre}beside_bwd_s": {layout: bwd},
                                      ("async_alone_s" if asynchronous else "alone_s"): {layout: idle}})
    return replace(profile, kinds={**profile.kinds, "block": replace(block, optimizer=opt)})


def analyse(case: str, trace_path: Path, record: Mapping[str, Any]) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    add_replay_arguments(ap)
    trace = load_run_trace(trace_path)
    setup = settle(trace, ap.parse_args([str(trace_path)]))
    compiled = "--compile" in record["run_options"]
    # bench/fidelity.py's hardware (the profile folder's measured rates), not the run's own record of it
    model, policy = setup.model, setup.policy
    hw = load_hardware(str(PROFILE / ("pq-compiled" if compiled else "pq") / "hardware.json"))
    sched = compile_schedule(policy, model, hw, setup.profile, iterations=setup.iterations)
    _, window = match_window(sched, trace)
    partner = pair_halves(sched.actions)
    measured_durations = effective_durations(window, partner)
    run_lanes = lanes(sched, window, trace.source)
    profile = fidelity_profile(compiled, policy.microbatch_size)
    acts = sched.actions

    def sim(durations: Mapping[int, float] | None = None, schedule: Schedule = sched) -> list[float]:
        r = simulate(schedule, model, hw, profile, durations=durations, on_capacity="record",
                     lanes=run_lanes if schedule is sched else None)
        return list(r.iteration_times_s)

    fidelity_sched = compile_schedule(policy, model, hw, profile, iterations=3)
    fidelity_s = simulate(fidelity_sched, model, hw, profile, on_capacity="record").iteration_s
    phase_model = {}
    for name, path in (("this run's fit", trace_path), ("an earlier run's fit", RESULTS / EARLIER[case])):
        fit = block_phases_s(path)
        with_phases = with_block_phases(profile, fit, policy.host_memory, policy.optimizer == "async")
        phase_model[name] = {"block_step_ms": dict(zip(PHASES, (1e3 * t for t in fit))), "trace": path.name,
                             "predicted_s": simulate(fidelity_sched, model, hw, with_phases,
                                                     on_capacity="record").iteration_s}
    gap_model = {}
    for name, path in (("this run's gaps", trace_path), ("an earlier run's gaps", RESULTS / EARLIER[case])):
        gaps = issue_gap_means(path)
        with_gaps = with_block_gaps(profile, gaps)
        gap_model[name] = {"gap_ms": {k: 1e3 * v for k, v in gaps.items()}, "trace": path.name,
                           "predicted_s": simulate(fidelity_sched, model, hw, with_gaps,
                                                   on_capacity="record").iteration_s}
    measured = steady(Timeline(window).iteration_times_s())
    with_group: dict[frozenset[str], float] = {}
    for k in range(len(GROUPS) + 1):
        for sel in itertools.combinations(GROUPS, k):
            d = {i: t for i, t in measured_durations.items() if any(GROUPS[g](acts[i]) for g in sel)}
            with_group[frozenset(sel)] = steady(sim(d))
    n = len(GROUPS)
    shapley = {g: sum(math.factorial(len(s)) * math.factorial(n - len(s) - 1) / math.factorial(n)
                      * (with_group[s | {g}] - with_group[s]) for s in with_group if g not in s) for g in GROUPS}
    replayed = with_group[frozenset(GROUPS)]
    its = range(WARMUP, sched.iterations)
    compute = next(r for r in sched.resources if r.endswith(".compute"))
    waits, issue = stream_waits(sched, window, compute, its)
    with_issue = dict(measured_durations)
    for i, gap in stream_waits(sched, window, compute, range(sched.iterations))[1].items():
        with_issue[i] += gap
    replayed_issue = steady(sim(with_issue))
    causes = {"window": record["iteration_s"] - measured, "iterations": with_group[frozenset()] - fidelity_s,
              **{f"durations: {g}": v for g, v in shapley.items()},
              "issue: compute waits for the main thread": replayed_issue - replayed,
              "issue: other": measured - replayed_issue}
    # the OPT_STEPs by the phase they overlapped most; the block steps of the steady iterations and the one
    # before (whose steps overlap the first steady one) fitted and averaged per phase
    steps = [a.id for a in acts if a.kind.value == "OPT_STEP"]
    main = dict(zip(steps, (PHASES[int(np.argmax(o))] for o in step_phases(sched, window, steps))))
    blocks = [i for i in steps if model.layers[acts[i].layer].kind.value == "block"
              and WARMUP - 1 <= acts[i].iteration < sched.iterations - 1]
    rates, *_ = np.linalg.lstsq(step_phases(sched, window, blocks), np.ones(len(blocks)), rcond=None)
    by_phase: dict[str, dict[str, Any]] = {}
    for k, p in enumerate(PHASES):
        mine = [i for i in blocks if main[i] == p]
        effect = steady(sim({i: measured_durations[i] for i in steps if main[i] == p})) - with_group[frozenset()]
        by_phase[p] = {"steps": len(mine), "mean_ms": 1e3 * statistics.fmean(measured_durations[i] for i in mine)
                       if mine else None, "fluid_fit_ms": 1e3 / rates[k] if mine and rates[k] > 0 else None,
                       "effect_s": effect}
    tl = Timeline(window)
    ends = tl.iteration_ends_s()
    cp = critical_path(sched, tl, partner, run_lanes)
    end = {r.id: r.end_s for r in window}
    on_path: dict[str, float] = defaultdict(float)
    for prev, aid in zip((None, *cp.actions), cp.actions):
        t0 = max(end[prev] if prev is not None else tl.start_s, ends[WARMUP - 1])
        t1 = min(end[aid], ends[-1])
        if t1 > t0:
            a = acts[aid]
            on_path[f"{a.resource} {a.kind.value} {model.layers[a.layer].kind.value}"] += (t1 - t0) / len(its)
    opt = profile.kinds["block"].optimizer
    return {"case": case, "measured_s": record["iteration_s"], "measured_each_s": record["iteration_s_each"],
            "first_window_steady_s": measured, "predicted_s": fidelity_s, "replayed_s": replayed,
            "gap_s": record["iteration_s"] - fidelity_s, "causes_s": causes,
            "profile_block_step_ms": None if opt is None else 1e3 * (opt.step_s(
                policy.host_memory, opt.params, asynchronous=policy.optimizer == "async") or 0.0),
            "block_steps_by_phase": by_phase,
            "phase_model": phase_model, "issue_gap_model": gap_model,
            "compute_idle_s_per_iteration": {k: v / len(its) for k, v in sorted(waits.items())},
            "critical_path_s_per_iteration": dict(sorted(on_path.items(), key=lambda kv: -kv[1]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default=str(RESULTS / "fidelity_h200_traces.tgz"))
    ap.add_argument("--records", default=str(RESULTS / "cuda_h200.jsonl"))
    ap.add_argument("--out", default="async_gap.json", help="file name under bench/results")
    a = ap.parse_args()
    records = {}
    for line in Path(a.records).read_text().splitlines():
        r = json.loads(line)
        records[r["case"]] = r
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(a.traces) as tar:
            tar.extractall(tmp, filter="data")
        for case in CASES:
            out.append(analyse(case, Path(tmp) / f"{case}.trace.json", records[case]))
    for r in out:
        print(f"\n{r['case']}: measured {r['measured_s']:.3f} s (iterations 2..5), predicted {r['predicted_s']:.3f} s, "
              f"gap {r['gap_s']:+.3f} s; first window's steady {r['first_window_steady_s']:.3f}, replayed "
              f"{r['replayed_s']:.3f}")
        print(render(["cause", "s per iteration"], [[k, f"{v:+.3f}"] for k, v in r["causes_s"].items()]
                     + [["sum", f"{sum(r['causes_s'].values()):+.3f}"]], align="lr"))
        print(f"block OPT_STEPs by what the compute stream ran meanwhile (profile: {r['profile_block_step_ms']:.1f} "
              "ms)")
        print(render(["phase", "steps", "mean ms", "fluid fit ms", "their durations' effect s"],
                     [[p, v["steps"], _ms(v["mean_ms"]), _ms(v["fluid_fit_ms"]), f"{v['effect_s']:+.3f}"]
                      for p, v in r["block_steps_by_phase"].items()], align="lrrrr"))
        print("the prediction with the block's step by phase (the phase model), fitted on: " + "; ".join(
            f"{k} ({v['trace']}: " + ", ".join(f"{p} {t:.1f}" for p, t in v["block_step_ms"].items())
            + f" ms) {v['predicted_s']:.3f} s ({100 * (v['predicted_s'] / r['measured_s'] - 1):+.1f}%)"
            for k, v in r["phase_model"].items()))
        print("the prediction with the block's issue gaps (mean ms before a back-to-back FWD / BWD, alone / beside "
              "a step), from: " + "; ".join(
                  f"{k} ({v['trace']}: " + ", ".join(f"{g} {t:.3f}" for g, t in v["gap_ms"].items())
                  + f") {v['predicted_s']:.3f} s ({100 * (v['predicted_s'] / r['measured_s'] - 1):+.1f}%)"
                  for k, v in r["issue_gap_model"].items()))
        print("compute idle s per iteration by what it waited for: "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["compute_idle_s_per_iteration"].items()))
        print("critical path s per iteration: " + ", ".join(
            f"{k} {v:.3f}" for k, v in r["critical_path_s_per_iteration"].items() if v >= 0.01))
    path = write_json(a.out, {"cases": out, "profile": str(PROFILE.relative_to(ROOT)), "warmup": WARMUP})
    print(f"\nwrote {path}")
    return 0


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
