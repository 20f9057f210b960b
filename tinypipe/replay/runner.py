"""`tinypipe replay RUN_TRACE`: settle what the run was, recompile it, simulate it twice, report.

The settings come from the trace's `otherData.run` (written by `tinypipe run --trace`); options on
the command line replace them (a simulated timeline names its model and hardware in its meta and
needs `--policy` and `--seq-len`). The simulator is passed in (`simulate`): the core does not import
`tinypipe.sim`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError, TinypipeError
from tinypipe.compiler import WINDOW_ITERATIONS, compile_schedule
from tinypipe.describe.hardware import Hardware, load_hardware
from tinypipe.describe.hfconfig import from_hf_config, load_model
from tinypipe.describe.model import ModelSpec
from tinypipe.describe.trace import ProfileTrace, trace_for
from tinypipe.ir.order import pair_halves
from tinypipe.ir.schedule import Schedule
from tinypipe.ir.timeline import Record, Timeline, issue_s_per_iteration
from tinypipe.policy import Policy, load_policy
from tinypipe.policy.lora_spec import lora_text
from tinypipe.replay.report import ReplayReport, critical_gaps, kind_rows, resource_rows
from tinypipe.replay.trace_match import (
    RunTrace,
    TraceMismatch,
    effective_durations,
    issue_durations,
    lanes,
    load_run_trace,
    match_window,
    opt_threads,
)


@dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    """What `tinypipe replay` was asked (`cli.edge` reads the command line into it): the run's trace, and the
    settings that replace the trace's record of the run (None: the record's)."""

    trace: str  # Chrome trace (`tinypipe run --trace`) or timeline JSON of a run
    model: str | None = None
    hardware: str | None = None
    policy: str | None = None
    seq_len: int | None = None
    batch_tokens: int | None = None
    microbatches: int | None = None
    gpu_mem_bytes: int | None = None  # the GPU memory the run was planned for
    iterations: int | None = None
    schedule: str | None = None  # the schedule's text form the run executed (None: recompiled)
    warmup: int = 1  # iterations left out of the steady state
    window: int = 0  # which of the run's whole windows: 0 the first, 1 the next, -1 the last
    top: int = 8  # rows of the kind and gap tables
    json: bool = False


@dataclass(frozen=True)
class Setup:
    """What the run compiled: model, hardware, policy (with its microbatch count), profile, window length."""

    model: ModelSpec
    hardware: Hardware
    policy: Policy
    profile: ProfileTrace
    iterations: int
    gpu_mem_bytes: int | None
    schedule: Schedule | None = None  # what the run executed, when given (`--schedule`); else recompiled


def settle(trace: RunTrace, ask: ReplayOptions) -> Setup:
    """The run's settings: the command line's, else the trace's record; a missing one is an InputError."""
    run, meta, where = trace.run, trace.meta, trace.where
    for flag in ("seq_len", "batch_tokens", "microbatches", "iterations"):
        v = getattr(ask, flag)
        if v is not None and v < 1:
            raise InputError(f"--{flag.replace('_', '-')}: must be >= 1, got {v}")
    if ask.warmup < 0:
        raise InputError(f"--warmup: must be >= 0, got {ask.warmup}")

    def missing(flag: str, what: str) -> InputError:
        return InputError(f"{where}: the trace does not record {what}; give {flag}")

    if ask.model:
        model = load_model(ask.model)
    elif isinstance(run.get("model_config"), dict):
        model = from_hf_config(run["model_config"], name=str(run.get("model_name", "model")),
                               where=f"{where}: otherData.run.model_config")
    elif isinstance(run.get("model") or meta.get("model"), str):  # a run's record, or a timeline's meta
        model = load_model(run.get("model") or meta["model"])
    else:
        raise missing("--model", "its model")
    if ask.hardware:
        hardware = load_hardware(ask.hardware)
    elif isinstance(run.get("hardware"), dict):
        hardware = Hardware.from_json(run["hardware"], where=f"{where}: otherData.run.hardware")
    elif isinstance(meta.get("hardware"), str):  # a timeline's meta names its preset
        hardware = load_hardware(meta["hardware"])
    else:
        raise missing("--hardware", "its hardware")
    if len(hardware.gpus) != trace.gpus:
        raise InputError(f"hardware {hardware.name!r} has {len(hardware.gpus)} GPU(s) but the run used {trace.gpus}; "
                         "give --hardware describing the run's GPUs")
    if ask.policy:
        policy = load_policy(ask.policy)
    elif isinstance(run.get("policy"), dict):
        policy = Policy.from_json(run["policy"], where=f"{where}: otherData.run.policy")
    else:
        raise missing("--policy FILE", "its policy")
    seq_len = ask.seq_len or run.get("seq_len")
    if not isinstance(seq_len, int):
        raise missing("--seq-len", "its sequence length")
    if ask.batch_tokens and ask.microbatches:
        raise InputError("--batch-tokens and --microbatches: give one")
    if ask.batch_tokens:
        per_mb = policy.microbatch_size * seq_len
        if ask.batch_tokens % per_mb:
            raise InputError(f"--batch-tokens {ask.batch_tokens}: not a multiple of the microbatch "
                             f"({policy.microbatch_size} sequences x {seq_len} tokens = {per_mb})")
        policy = policy.replace(microbatches=ask.batch_tokens // per_mb)
    elif ask.microbatches:
        policy = policy.replace(microbatches=ask.microbatches)
    # `tinypipe run`'s compute dtype: recorded, else its default (backends/launch/prepare.py: bf16 on cuda, fp32 on cpu)
    dtype = str(run.get("dtype") or ("fp32" if trace.source == "cpu" else "bf16"))
    if isinstance(run.get("profile"), dict):  # the trace the run was planned with (`run --profile`, or shipped)
        profile = ProfileTrace.from_json(run["profile"], where=f"{where}: otherData.run.profile")
    else:
        profile = trace_for(model, hardware.gpus[0], policy.microbatch_size, seq_len, dtype,
                            lora=lora_text(policy.lora))
    iterations = ask.iterations or run.get("iterations") or min(WINDOW_ITERATIONS, trace.steps)
    gpu_mem = ask.gpu_mem_bytes or run.get("gpu_mem_bytes")
    schedule = _read_schedule(ask.schedule, trace.gpus) if ask.schedule else None
    return Setup(model, hardware, policy, profile, int(iterations), gpu_mem, schedule)


def _read_schedule(path: str, gpus: int) -> Schedule:
    """The schedule in `path` (its text form); an InputError names the file and what is wrong."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InputError(f"--schedule {path}: cannot read it ({e.strerror or e})") from None
    try:
        schedule = Schedule.loads(text, where=path)
    except TinypipeError as e:
        raise InputError(f"--schedule {path}: {e}") from None
    if schedule.num_gpus != gpus:
        raise InputError(f"--schedule {path}: a schedule for {schedule.num_gpus} GPU(s), but the run used {gpus}")
    return schedule


Simulate = Callable[..., Any]  # tinypipe.sim.simulate


def replay(trace: RunTrace, setup: Setup, *, simulate: Simulate, warmup: int = 1, which: int = 0) -> ReplayReport:
    """Recompile, check the trace against the schedule, simulate with measured and with profiled times."""
    s = setup
    schedule = s.schedule or compile_schedule(s.policy, s.model, s.hardware, s.profile, iterations=s.iterations,
                                              gpu_mem_bytes=s.gpu_mem_bytes)  # planned for the cap, as the run
    stride = trace.run.get("id_stride")
    if isinstance(stride, int) and stride != len(schedule.actions):
        raise TraceMismatch(f"{trace.where}: the run's schedule had {stride} actions, the recompiled one has "
                            f"{len(schedule.actions)}: not the same schedule (check the options)")
    first_step, window = match_window(schedule, trace, which)
    partner = pair_halves(schedule.actions)
    lane_lists = lanes(schedule, window, trace.source)
    issue = issue_durations(trace, first_step * len(schedule.actions), len(schedule.actions))  # CUDA runs only
    replayed = simulate(schedule, s.model, s.hardware, s.profile, on_capacity="record",
                        durations=effective_durations(window, partner), lanes=lane_lists, issue=issue)
    predicted = simulate(schedule, s.model, s.hardware, s.profile, gpu_mem_bytes=s.gpu_mem_bytes,
                         on_capacity="record")
    measured = Timeline(window, source=trace.source)
    firsts: dict[str, float] = {}
    for r in window:
        firsts[r.device] = min(firsts.get(r.device, r.start_s), r.start_s)
    gap_s, gaps = critical_gaps(schedule, window, lane_lists, partner)
    header = {"trace": trace.where, "model": s.model.name, "hardware": s.hardware.name, "policy": s.policy.name,
              "gpus": schedule.num_gpus, "source": trace.source or "?", "first_step": first_step,
              "iterations": schedule.iterations, "actions": len(schedule.actions), "records": len(trace.records),
              "predicted_fits": predicted.fits, "optimizer_threads": opt_threads(schedule),
              "first_start_s": {d: t - measured.start_s for d, t in sorted(firsts.items())}}
    return ReplayReport(
        header=header, measured_s=tuple(measured.iteration_times_s()), replayed_s=tuple(replayed.iteration_times_s),
        predicted_s=tuple(predicted.iteration_times_s), gap_s=gap_s, warmup=warmup,
        resources=resource_rows(schedule, measured, predicted.timeline, warmup, opt_threads(schedule)),
        kinds=kind_rows(s.model, window, sorted(predicted.timeline.records, key=lambda r: r.id), partner, warmup),
        gaps=gaps, issue_busy_s=issue_busy(trace, window, first_step * len(schedule.actions), warmup))


def issue_busy(trace: RunTrace, window: Sequence[Record], first_id: int, warmup: int) -> dict[str, float]:
    """Per device, the seconds per steady iteration its main thread spent issuing the window's actions
    (`RunTrace.issue`; the window's records renumbered from `first_id`); empty for a trace without them."""
    iteration_of = {r.id + first_id: r.iteration for r in window}
    steady = {i for i in iteration_of.values() if i >= warmup}
    return {d: issue_s_per_iteration(s, iteration_of, steady) for d, s in sorted(trace.issue_by_device().items())}


def replay_main(ask: ReplayOptions, *, simulate: Simulate) -> int:
    """The `tinypipe replay` command: the report as tables, or JSON with --json."""
    if ask.top < 1:
        raise InputError(f"--top: must be >= 1, got {ask.top}")
    trace = load_run_trace(ask.trace)
    report = replay(trace, settle(trace, ask), simulate=simulate, warmup=ask.warmup, which=ask.window)
    if ask.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.table(top=ask.top))
    return 0
