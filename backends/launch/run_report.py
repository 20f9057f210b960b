"""`tinypipe run`'s end-of-run report: the loss curve, accuracy, speed and memory beside the prediction."""

from __future__ import annotations

import shlex
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tinypipe.describe.layershape import borrowed_from
from tinypipe.ir.timeline import Timeline

from ..rank.cpustat import NOTABLE_STEAL
from ..rank.evaluation import EVAL_SPAN
from .calibrate import calibration_lines
from .runtrace import timeline
from .steady import common, steady_summary

if TYPE_CHECKING:
    from ..rank.worker import RankResult
    from .prepare import RunPlan

SPARK = "▁▂▃▄▅▆▇█"
# a prediction from an analytic trace this many times off the measured step (either way) prints how to
# profile the job's layers here (`profile_hint`): the CPU stand-in's default job measures ~6 x its prediction
ANALYTIC_OFF = 2.0


def header(plan: RunPlan) -> str:
    """The line that opens a run: model, policy, workers, packs, steps."""
    p, s = plan.policy, plan.schedule
    return (f"tinypipe run: {plan.spec.name} ({plan.spec.params:,} params), policy {p.name} "
            f"({p.swap} swap, {p.host_memory} host memory, {p.optimizer} optimizer), {plan.world} "
            f"{plan.job.backend} worker(s), {len(s.pack_layers)} packs on GPUs {list(s.pack_gpu)}, "
            f"{plan.job.steps} steps x {plan.batch_tokens} tokens ({s.microbatches} microbatches), {_lr(plan)}")


def _lr(plan: RunPlan) -> str:
    o = plan.job.optim
    sched = o.schedule
    if sched is None:
        return f"lr {o.lr:g}"
    warm = f", {sched.warmup_steps} warmup steps" if sched.warmup_steps else ""
    return f"lr {o.lr:g} {sched.text()}{warm}"


def sparkline(values: list[float], width: int = 48) -> str:
    """A compact text curve: `values` binned to `width` columns, min..max mapped to ▁..█."""
    if not values:
        return ""
    step = max(1, -(-len(values) // width))
    bins = [statistics.fmean(values[i:i + step]) for i in range(0, len(values), step)]
    lo, hi = min(bins), max(bins)
    span = hi - lo or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1) + 0.5))] for v in bins)


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{100 * v:.1f}%"


def _mib(b: float) -> str:
    from tinypipe.common.units import MIB

    return f"{b / MIB:,.1f} MiB"


HELD_PARTS = (("master_bytes", "fp32 master"), ("upload_copy_bytes", "upload copy"), ("grad_bytes", "gradients"),
              ("optim_state_bytes", "AdamW state"), ("scratch_bytes", "optimizer scratch"),
              ("stale_bytes", "stale copies"), ("pinned_rounding_bytes", "pinned rounding"))


def _host_lines(plan: RunPlan, results: Sequence[RankResult]) -> list[str]:
    """Host state measured, by part, against `hostmem`'s formula for the layers each rank holds.

    The formula's headline (`inspect model`) is for one rank holding the whole model; here each
    rank has its own gradient ring (compact: 4 slots of its largest layer) and optimizer scratch
    (compact: its largest tensor, plus the chunked step's workspace), which the formula leaves
    out, and AdamW keeps a 4-byte step counter per tensor. Measured on tiny-llama (2 ranks,
    compact): master 4.00 + AdamW 8.00 + rings 6.55 + scratch 2.17 = 20.72 B/param against 15.27
    for the whole model on one rank and 18.55 for these ranks' layers: on a 181k-parameter model
    the per-rank parts weigh as much as the per-parameter ones. (Replicated measured 20.00 there,
    its per-rank formula exactly: no pinned memory on the CPU, an fp32 upload copy.)
    """
    from tinypipe.estimate.hostmem import host_bytes
    from tinypipe.estimate.lora_costs import frozen_host_bytes

    spec, sched, sim = plan.spec, plan.schedule, plan.prediction
    n = spec.params
    held = {k: sum(int(r.held.get(k, 0)) for r in results) for k, _ in HELD_PARTS}
    total = sum(int(r.held["total_bytes"]) for r in results)
    pinned = plan.job.backend == "cuda"
    per_rank = 0
    for r in results:
        f = (host_bytes(spec, sched.host_memory, compute_dtype=sched.compute_dtype, layers=tuple(r.layers),
                        optimizer=plan.policy.optimizer, grad_clip=sched.grad_clip) if sched.lora is None
             else frozen_host_bytes(spec, compute_dtype=sched.compute_dtype, layers=tuple(r.layers),
                                    nf4=sched.lora.nf4))
        per_rank += f.total_bytes - (0 if pinned else f.pinned_rounding_bytes)
    whole = (host_bytes(spec, sched.host_memory, compute_dtype=sched.compute_dtype, optimizer=plan.policy.optimizer,
                        grad_clip=sched.grad_clip)
             if sched.lora is None else frozen_host_bytes(spec, compute_dtype=sched.compute_dtype, nf4=sched.lora.nf4))
    parts = ", ".join(f"{label} {held[k] / n:.2f}" for k, label in HELD_PARTS if held[k])
    rss = sum(r.peak_rss_bytes for r in results)
    layout = sched.host_memory if sched.lora is None else f"frozen base, LoRA {sched.lora.text()}"
    out = [f"host      state {_mib(total)} = {total / n:.2f} B/param measured ({layout}: {parts})",
           f"          formula {per_rank / n:.2f} B/param for the layers each of the {len(results)} rank(s) holds "
           f"({whole.bytes_per_param:.2f} for the whole model on one rank); it leaves out the optimizer scratch, "
           f"stale copies ({(held['scratch_bytes'] + held['stale_bytes']) / n:.2f}) and AdamW's step counters"]
    if len(results) > 1 and sched.host_memory.grad_ring and per_rank > whole.total_bytes * 1.05:
        out.append(f"          each rank has its own gradient ring and scratch, sized by its largest layer: on a model "
                   f"of {n:,} parameters they weigh as much as the per-parameter state")
    out.append(f"          predicted peak {_mib(sim.peak_host_bytes)}; peak RSS of the workers {_mib(rss)}")
    return out


ISSUE_BOUND = 0.8  # a main thread issuing this share of each step or more: the GPU waits for its host


def issue_shares(tl: Timeline, results: Sequence[RankResult], iteration_s: float) -> dict[int, float]:
    """Per rank, the share of a steady step (the iterations after the first) its main thread spent issuing
    device actions (`RankResult.issue`)."""
    from tinypipe.ir.timeline import issue_s_per_iteration

    iteration = {r.id: r.iteration for r in tl.records}
    steady = sorted(set(iteration.values()))[1:]
    if not steady or iteration_s <= 0:
        return {}
    return {res.rank: issue_s_per_iteration(res.issue, iteration, steady) / iteration_s
            for res in sorted(results, key=lambda r: r.rank)}


def profile_hint(plan: RunPlan, iteration_s: float) -> list[str]:
    """A line when a prediction from an analytic trace is more than ANALYTIC_OFF x off the measured step:
    the `tinypipe profile` command that measures this job's layers here, for `run --profile`."""
    predicted = plan.prediction.iteration_s
    if not plan.trace.analytic or iteration_s <= 0 or predicted <= 0:
        return []
    ratio = iteration_s / predicted
    if 1 / ANALYTIC_OFF <= ratio <= ANALYTIC_OFF:
        return []
    job = plan.job
    cmd = (f"tinypipe profile --model {shlex.quote(job.model)} --seq-len {job.seq_len} "
           f"--microbatch-size {job.microbatch_size} --backend {job.backend} --dtype {plan.trace.dtype}"
           + (f" --threads {job.threads}" if job.threads else "")
           + (" --compile" if job.compile_blocks else " --no-compile" if job.backend == "cuda" else ""))
    return [f"          the step took {ratio:.1f} x the prediction: an analytic trace is FLOPs and bytes at the "
            f"hardware's rates, without each operator's fixed cost (which dominates small layers); for a measured "
            f"one, `{cmd} --out DIR`, then `run --profile DIR`"]


def _steal_lines(results: Sequence[RankResult]) -> list[str]:
    """A line when the hypervisor took more than cpustat.NOTABLE_STEAL of the host's CPU time during the
    run (`RankResult.host_steal_share`): the host optimizer's steps then run slow."""
    shares = [r.host_steal_share for r in results if r.host_steal_share is not None]
    if not shares or max(shares) <= NOTABLE_STEAL:
        return []
    return [f"host      the hypervisor took {max(shares):.1%} of the host's CPU time during the run: the host "
            f"optimizer's steps can run up to 2x slow, and the run slower than predicted"]


def _issue_lines(tl: Timeline, results: Sequence[RankResult], iteration_s: float, *, compiled: bool) -> list[str]:
    shares = issue_shares(tl, results, iteration_s)
    if not shares:
        return []
    text = ", ".join(f"g{rank} {share:.0%}" for rank, share in shares.items())
    hint = ""
    if max(shares.values()) >= ISSUE_BOUND:
        hint = "; the GPU likely waits for its host" + ("" if compiled else
                                                         " (--compile issues a block in fewer calls)")
    return [f"host      main thread issuing the GPU's work: {text} of each steady step{hint}"]


def _evaluating(results: Sequence[RankResult]) -> dict[int, list[tuple[float, float]]]:
    """Each rank's held-out evaluations (start, end), which its training speed leaves out."""
    return {r.rank: [(a, b) for name, a, b in r.host if name == EVAL_SPAN] for r in results}


def steady_step_s(plan: RunPlan, results: Sequence[RankResult]) -> float:
    """The steady step's seconds the report's `speed` line measures (0 when no step ran)."""
    if not any(r.steps_run for r in results):
        return 0.0
    return steady_summary(timeline(plan, list(results)), pauses=common(_evaluating(results).values()))[0]


def summary(plan: RunPlan, results: Sequence[RankResult], before: float | None, after: float | None, *,
            trace_path: str | None = None) -> str:
    """The end-of-run report for people."""
    from tinypipe.describe.hardware import HOST

    losses: dict[int, float] = {}
    for r in results:
        losses.update(r.losses)
    curve = [losses[k] for k in sorted(losses)]
    if not any(r.steps_run for r in results):  # --resume at the step reached: the model saved, nothing trained
        done = f"loss      {curve[-1]:.4f} at step {max(losses) + 1}" if curve else "loss      -"
        return "\n".join([done, f"saved     {plan.job.out} at step {plan.job.steps}, nothing left to train "
                                f"(AutoModelForCausalLM.from_pretrained loads it)"])
    tl = timeline(plan, list(results))
    evaluating = _evaluating(results)
    iteration_s, how = steady_summary(tl, pauses=common(evaluating.values()))  # while every rank evaluated
    tokens = plan.batch_tokens
    measured_tps = tokens / iteration_s if iteration_s > 0 else 0.0
    eval_s = {rank: sum(b - a for a, b in spans) for rank, spans in evaluating.items()}
    wall = max(r.wall_s - eval_s[r.rank] for r in results)  # training's: the evaluations are not in it
    steps_run = max(r.steps_run for r in results)
    sim = plan.prediction
    lines = []
    if curve:
        first, last = curve[0], curve[-1]
        lines.append(f"loss      {first:.4f} {sparkline(curve)} {last:.4f}   "
                     f"(steps {min(losses) + 1}..{max(losses) + 1})")
    if before is not None or after is not None:
        lines.append(f"accuracy  held-out addition: {_pct(before)} before -> {_pct(after)} after")
    evals = {k: v for r in results for k, v in r.eval_losses.items()}
    if evals:
        shown = ", ".join(f"{evals[k]:.4f} at step {k + 1}" for k in sorted(evals)[-4:])
        n, took = max(len(v) for v in evaluating.values()) or len(evals), max(eval_s.values())
        lines.append(f"eval      held-out loss {shown}; {n} evaluation{'s' if n != 1 else ''} took {took:.1f} s, "
                     "left out of the speed below")
    lines.append(f"speed     {measured_tps:,.0f} tokens/s measured (step {iteration_s * 1e3:.1f} ms, {how}; "
                 f"{tokens * steps_run / max(wall, 1e-9):,.0f} tokens/s over {steps_run} steps in {wall:.1f} s)")
    trace = "analytic trace" if plan.trace.analytic else "measured trace" + borrowed_from(plan.trace.model, plan.spec)
    lines.append(f"          {sim.tokens_per_s:,.0f} tokens/s predicted by the simulator "
                 f"(step {sim.iteration_s * 1e3:.1f} ms; {plan.hardware.name}, {trace})")
    lines += profile_hint(plan, iteration_s)
    if plan.job.backend == "cuda":
        lines += _issue_lines(tl, results, iteration_s, compiled=plan.job.compile_blocks)
    ranks = sorted(results, key=lambda r: r.rank)
    dev = ", ".join(f"g{r.rank} {_mib(r.peak_device_bytes)}" for r in ranks)
    planned = ", ".join(f"g{r.rank} {_mib(r.ledger_peak.get(f'g{r.rank}', 0))}" for r in ranks)
    pred = ", ".join(f"{d} {_mib(b)}" for d, b in sorted(sim.peak_bytes.items()) if d != HOST)
    lines.append(f"device    peak {dev} measured; {planned} by the schedule's ledger as it ran; {pred} predicted")
    lines += _host_lines(plan, results)
    lines += calibration_lines(plan)
    lines += _steal_lines(results)
    if trace_path:
        lines.append(f"trace     {trace_path} (open in Perfetto)")
    if any(r.interrupted for r in results):
        at = steps_run + min(r.start_step for r in results)
        lines.append(f"stopped   after step {at}; checkpoint in {plan.job.out}"
                     + (f", the model in {plan.job.out}/step-{at}" if plan.job.save_model else "")
                     + f"; continue with --resume --out {plan.job.out}")
    elif not plan.job.save_model:
        lines.append("saved     nothing (--no-save)")
    elif plan.job.out and plan.schedule.lora is not None:
        lines.append(f"saved     {plan.job.out}: a LoRA adapter (peft.PeftModel.from_pretrained(base, DIR) loads it)"
                     + (f"; the merged model in {plan.job.out}/merged" if plan.job.lora_files.merge else ""))
    elif plan.job.out:
        lines.append(f"saved     {plan.job.out} (AutoModelForCausalLM.from_pretrained loads it)")
    return "\n".join(lines)
