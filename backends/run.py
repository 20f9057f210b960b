"""`tinypipe run`: train a model through the compiled schedule, then summarise measurement and prediction.

With no arguments it runs the embedded job: the tiny byte-level Llama (`tiny-llama`) learning
multi-digit addition generated from the seed, on 2 CPU worker processes, in about a minute. The
summary shows the loss curve, held-out addition accuracy before and after (for the embedded
task), tokens/s, peak device and host memory with bytes per parameter, and the simulator's
prediction for the same schedule beside each measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tinypipe.policy.modes import HostMemory

if importlib.util.find_spec("torch") is None:  # the CLI registers `run` only when this imports
    raise ImportError("torch is not installed")

from .calibrate import calibration_lines  # noqa: E402 - after the torch check
from .cpustat import NOTABLE_STEAL  # noqa: E402 - after the torch check
from .settings import DEFAULT_BETAS, DEFAULTS  # noqa: E402 - after the torch check
from .steady import steady_summary  # noqa: E402 - after the torch check
from .trust_options import add_machine_arguments  # noqa: E402 - after the torch check

SPARK = "▁▂▃▄▅▆▇█"
# a prediction from an analytic trace this many times off the measured step (either way) prints how to
# profile the job's layers here (`profile_hint`): the CPU stand-in's default job measures ~6 x its prediction
ANALYTIC_OFF = 2.0


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Register `tinypipe run`'s options on `p` (the CLI's subparser).

    Options a checkpoint records default to None here (see `settings.settle`): a new run takes
    `DEFAULTS`, `--resume` takes the checkpoint's record of the run.
    """
    d = DEFAULTS
    p.add_argument("--backend", choices=("cpu", "cuda"), default=None,
                   help="cpu: worker processes stand in for GPUs (gloo); cuda: one process per GPU (NCCL) "
                        f"(default {d['backend']})")
    p.add_argument("--gpus", type=int, default=None, help=f"devices = worker processes (default {d['gpus']})")
    p.add_argument("--model", default=None, help="shipped model name, config.json, or a local model "
                   f"directory with safetensors (default {d['model']})")
    p.add_argument("--data", default=None, help="JSONL (text, or prompt/completion) or plain-text file "
                   "(default: the embedded synthetic addition task)")
    p.add_argument("--policy", default=None, help=f"preset name or policy JSON (default {d['policy']}, with "
                   f"{d['microbatch_size']} sequences per microbatch)")
    p.add_argument("--microbatch-size", type=int, default=None, metavar="N",
                   help="sequences per microbatch (default: the policy's)")
    p.add_argument("--gpu-mem", default=None, metavar="BYTES",
                   help="CUDA: GPU memory each rank may use, e.g. 24GiB: the schedule is planned for it, the "
                        "caching allocator is capped at it, and a policy that does not fit is refused before "
                        "training (default: the whole GPU)")
    p.add_argument("--hardware", default=None, help="CUDA only: hardware preset or JSON the schedule is "
                   "compiled for (default: the preset of the local GPU model)")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {d['steps']}; with --resume, "
                   "the resumed run's)")
    p.add_argument("--seq-len", type=int, default=None, help=f"tokens per sequence (default {d['seq_len']})")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="tokens per optimizer step, all microbatches together; microbatches = batch-tokens / "
                        f"(policy microbatch_size x seq-len) (default {d['batch_tokens']})")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="compute dtype (default: fp32 on cpu, bf16 on cuda); masters are always fp32")
    p.add_argument("--lr", type=float, default=None, help=f"AdamW learning rate (default {d['lr']})")
    p.add_argument("--betas", type=float, nargs=2, default=None, metavar=("B1", "B2"),
                   help=f"AdamW betas, each in [0, 1) (default {' '.join(map(str, DEFAULT_BETAS))})")
    p.add_argument("--eps", type=float, default=None, help=f"AdamW epsilon (default {d['eps']})")
    p.add_argument("--weight-decay", type=float, default=None, help=f"AdamW weight decay (default {d['weight_decay']})")
    p.add_argument("--seed", type=int, default=None, help=f"initialisation and data seed (default {d['seed']})")
    p.add_argument("--out", default=None, help="output directory: the fine-tuned model and checkpoints "
                   "(default runs/run-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run whose checkpoint is in --out, with its "
                   "settings (options given again must match them; --steps may extend the run)")
    p.add_argument("--checkpoint-minutes", type=float, default=None, metavar="M",
                   help=f"checkpoint after every M minutes of training and at the end (default "
                        f"{d['checkpoint_minutes']:g}; 0: only by --checkpoint-every and on Ctrl-C); the last two "
                        "are kept")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="also checkpoint every N steps (default 0: off)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the decoder blocks: one graph per block structure, fused elementwise work; "
                        "the first step pays the compilation (default: on for cuda, off for cpu)")
    p.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace (Perfetto) of all ranks")
    p.add_argument("--trace-memory", action="store_true",
                   help="CUDA: sample the caching allocator at each action, its bytes in use (the trace's memory "
                        "counter) and its peak while the action is issued (otherData.action_peaks); two statistics "
                        "reads per action, ~0.2 ms each on the thread that issues the GPU's work")
    p.add_argument("--profile", action="append", default=None, metavar="DIR_OR_FILE",
                   help="measured traces (`tinypipe profile --out DIR`) for the schedule and the prediction: a "
                        "directory or a trace JSON, repeatable; a matching one is used before the shipped ones")
    add_machine_arguments(p)


def run_main(args: argparse.Namespace) -> int:
    """The `tinypipe run` command; returns the exit code (user mistakes raise InputError)."""
    from tinypipe.common.errors import InputError
    from tinypipe.common.progress import Progress

    from .settings import settle

    args = settle(args)  # before any heavy import: numbers, optimizer settings, output paths, --resume record
    lead = int(os.environ.get("RANK", "0")) == 0  # torchrun starts every rank here; rank 0 reports
    note = Progress("run") if lead else None

    def phase(text: str) -> None:
        if note is not None:
            note.phase(text)

    phase("tinypipe run: loading PyTorch")
    from .launch import launch
    from .prepare import make_run_plan

    plan = make_run_plan(args, phase=phase)
    if note is not None:
        note.close()
        print(_header(plan), file=sys.stderr)
        if plan.note:
            print(plan.note, file=sys.stderr)
    before = None
    if lead and plan.addition_task and not plan.job.resume:
        phase("measuring held-out addition accuracy before training")
        before = _accuracy(plan.job.model, plan.job.seed)
    phase(f"starting {plan.world} {plan.job.backend} worker process(es)")
    results = launch(plan.job, plan.world)
    if note is not None:
        note.close()
    if results is None:  # a torchrun rank other than 0
        return 0
    interrupted = any(r.interrupted for r in results)
    after = None
    if plan.addition_task and not interrupted and plan.job.out:
        phase("measuring held-out addition accuracy after training")
        after = _accuracy(plan.job.out, plan.job.seed)
        if note is not None:
            note.close()
    trace_error = None
    if args.trace:
        try:
            save_trace(plan, results, args.trace)
        except OSError as exc:
            trace_error = f"--trace {args.trace}: cannot write ({exc.strerror or exc}); the run itself is complete"
    print(summary(plan, results, before, after, trace_path=None if trace_error else args.trace))
    if trace_error:
        raise InputError(trace_error)
    return 130 if interrupted else 0


def _header(plan: Any) -> str:
    p, s = plan.policy, plan.schedule
    return (f"tinypipe run: {plan.spec.name} ({plan.spec.params:,} params), policy {p.name} "
            f"({p.swap} swap, {p.host_memory} host memory, {p.optimizer} optimizer), {plan.world} "
            f"{plan.job.backend} worker(s), {len(s.pack_layers)} packs on GPUs {list(s.pack_gpu)}, "
            f"{plan.job.steps} steps x {plan.batch_tokens} tokens ({s.microbatches} microbatches)")


def _accuracy(model: str, seed: int) -> float:
    """Held-out addition accuracy of a whole model (a shipped name or a saved directory)."""
    import torch

    from .data.addition import AdditionTask, task_accuracy
    from .hf import build_model

    stack = build_model(model, seed=seed)
    with torch.no_grad():
        return task_accuracy(stack.logits, task=AdditionTask(seed=seed))


def timeline(plan: Any, results: list[Any]) -> Any:
    """All ranks' records and device-memory samples as one Timeline (source cpu or cuda)."""
    from tinypipe.ir.timeline import Timeline

    records = tuple(r for res in results for r in res.records)
    memory = {f"g{res.rank}": tuple(res.memory) for res in results}
    return Timeline(records, memory, source=plan.job.backend,
                    meta={"model": plan.spec.name, "policy": plan.policy.name, "hardware": plan.hardware.name})


def save_trace(plan: Any, results: list[Any], path: str | Path, tl: Any = None) -> None:
    """Write the run's Chrome trace to `path`: its records (`tl`, else `timeline`), each rank's issue spans
    (`RankResult.issue`) and other host spans (`RankResult.host`), and `trace_data`."""
    tl = tl or timeline(plan, results)
    tl.save_chrome_trace(path, other_data=trace_data(plan, results, origin_s=tl.start_s),
                         issue={f"g{res.rank}": res.issue for res in results},
                         host={f"g{res.rank}": res.host for res in results})


def trace_data(plan: Any, results: list[Any], origin_s: float | None = None) -> dict[str, Any]:
    """A run's Chrome trace otherData: `run` (`replay_record`); with `origin_s` (the trace's zero on
    `time.perf_counter`'s clock) `origin_unix_s`, that instant on the wall clock, to line the trace up with
    what other tools sampled meanwhile (e.g. the host's /proc/stat); and, with
    --trace-memory, `action_peaks`: per device, [record id, the allocator's peak bytes up to the end of that
    action's issue] (RunLog.peaks)."""
    out: dict[str, Any] = {"run": replay_record(plan)}
    if origin_s is not None:
        out["origin_unix_s"] = time.time() - (time.perf_counter() - origin_s)
    peaks = {f"g{res.rank}": [[rid, b] for _, rid, b in res.peaks] for res in results if res.peaks}
    if peaks:
        out["action_peaks"] = peaks
    return out


def replay_record(plan: Any) -> dict[str, Any]:
    """What `tinypipe replay` needs to recompile this run's schedule (a trace's `otherData.run`): the
    model's config, the hardware and policy as compiled, the workload, the window (K, id stride), and
    the profile trace the run was planned with (its prediction's costs)."""
    from tinypipe.common.jsonio import load_json
    from tinypipe.describe.hfconfig import config_path

    s, job = plan.schedule, plan.job
    # packs pinned as --resume pins them: the packer's choice can depend on rates measured at start-up
    policy = (plan.compiled_policy or plan.policy).replace(packing=tuple(len(p) for p in s.pack_layers),
                                                           mapping=tuple(s.pack_gpu))
    return {"model": job.model, "model_name": plan.spec.name, "model_config": load_json(config_path(job.model)[0]),
            "hardware": plan.hardware.to_json(), "policy": policy.to_json(),
            "seq_len": job.seq_len, "microbatches": s.microbatches, "microbatch_size": job.microbatch_size,
            "batch_tokens": plan.batch_tokens, "gpus": plan.world, "gpu_mem_bytes": job.gpu_mem_bytes,
            "dtype": s.compute_dtype, "backend": job.backend, "steps": job.steps, "iterations": s.iterations,
            "id_stride": len(s.actions), "profile": plan.trace.to_json()}


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


def _host_lines(plan: Any, results: list[Any]) -> list[str]:
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

    spec, sched, sim = plan.spec, plan.schedule, plan.prediction
    n = spec.params
    held = {k: sum(int(r.held.get(k, 0)) for r in results) for k, _ in HELD_PARTS}
    total = sum(int(r.held["total_bytes"]) for r in results)
    pinned = plan.job.backend == "cuda"
    per_rank = 0
    for r in results:
        f = host_bytes(spec, sched.host_memory, compute_dtype=sched.compute_dtype, layers=tuple(r.layers),
                       optimizer=plan.policy.optimizer)
        per_rank += f.total_bytes - (0 if pinned else f.pinned_rounding_bytes)
    whole = host_bytes(spec, sched.host_memory, compute_dtype=sched.compute_dtype, optimizer=plan.policy.optimizer)
    parts = ", ".join(f"{label} {held[k] / n:.2f}" for k, label in HELD_PARTS if held[k])
    rss = sum(r.peak_rss_bytes for r in results)
    out = [f"host      state {_mib(total)} = {total / n:.2f} B/param measured ({sched.host_memory}: {parts})",
           f"          formula {per_rank / n:.2f} B/param for the layers each of the {len(results)} rank(s) holds "
           f"({whole.bytes_per_param:.2f} for the whole model on one rank); it leaves out the optimizer scratch, "
           f"stale copies ({(held['scratch_bytes'] + held['stale_bytes']) / n:.2f}) and AdamW's step counters"]
    if len(results) > 1 and sched.host_memory == HostMemory.COMPACT and per_rank > whole.total_bytes * 1.05:
        out.append(f"          each rank has its own gradient ring and scratch, sized by its largest layer: on a model "
                   f"of {n:,} parameters they weigh as much as the per-parameter state")
    out.append(f"          predicted peak {_mib(sim.peak_host_bytes)}; peak RSS of the workers {_mib(rss)}")
    return out


ISSUE_BOUND = 0.8  # a main thread issuing this share of each step or more: the GPU waits for its host


def issue_shares(tl: Any, results: list[Any], iteration_s: float) -> dict[int, float]:
    """Per rank, the share of a steady step (the iterations after the first) its main thread spent issuing
    device actions (`RankResult.issue`)."""
    from tinypipe.ir.timeline import issue_s_per_iteration

    iteration = {r.id: r.iteration for r in tl.records}
    steady = sorted(set(iteration.values()))[1:]
    if not steady or iteration_s <= 0:
        return {}
    return {res.rank: issue_s_per_iteration(res.issue, iteration, steady) / iteration_s
            for res in sorted(results, key=lambda r: r.rank)}


def profile_hint(plan: Any, iteration_s: float) -> list[str]:
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


def _steal_lines(results: list[Any]) -> list[str]:
    """A line when the hypervisor took more than cpustat.NOTABLE_STEAL of the host's CPU time during the
    run (`RankResult.host_steal_share`): the host optimizer's steps then run slow."""
    shares = [r.host_steal_share for r in results if r.host_steal_share is not None]
    if not shares or max(shares) <= NOTABLE_STEAL:
        return []
    return [f"host      the hypervisor took {max(shares):.1%} of the host's CPU time during the run: the host "
            f"optimizer's steps can run up to 2x slow, and the run slower than predicted"]


def _issue_lines(tl: Any, results: list[Any], iteration_s: float, *, compiled: bool) -> list[str]:
    shares = issue_shares(tl, results, iteration_s)
    if not shares:
        return []
    text = ", ".join(f"g{rank} {share:.0%}" for rank, share in shares.items())
    hint = ""
    if max(shares.values()) >= ISSUE_BOUND:
        hint = "; the GPU likely waits for its host" + ("" if compiled else
                                                         " (--compile issues a block in fewer calls)")
    return [f"host      main thread issuing the GPU's work: {text} of each steady step{hint}"]


def summary(plan: Any, results: list[Any], before: float | None, after: float | None, *,
            trace_path: str | None = None) -> str:
    """The end-of-run report for people."""
    from tinypipe.describe.hardware import HOST

    losses: dict[int, float] = {}
    for r in results:
        losses.update(r.losses)
    curve = [losses[k] for k in sorted(losses)]
    tl = timeline(plan, results)
    iteration_s, how = steady_summary(tl)
    tokens = plan.batch_tokens
    measured_tps = tokens / iteration_s if iteration_s > 0 else 0.0
    wall = max(r.wall_s for r in results)
    steps_run = max(r.steps_run for r in results)
    sim = plan.prediction
    lines = []
    if curve:
        first, last = curve[0], curve[-1]
        lines.append(f"loss      {first:.4f} {sparkline(curve)} {last:.4f}   "
                     f"(steps {min(losses) + 1}..{max(losses) + 1})")
    if before is not None or after is not None:
        lines.append(f"accuracy  held-out addition: {_pct(before)} before -> {_pct(after)} after")
    lines.append(f"speed     {measured_tps:,.0f} tokens/s measured (step {iteration_s * 1e3:.1f} ms, {how}; "
                 f"{tokens * steps_run / max(wall, 1e-9):,.0f} tokens/s over {steps_run} steps in {wall:.1f} s)")
    lines.append(f"          {sim.tokens_per_s:,.0f} tokens/s predicted by the simulator "
                 f"(step {sim.iteration_s * 1e3:.1f} ms; {plan.hardware.name}, "
                 f"{'analytic' if plan.trace.analytic else 'measured'} trace)")
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
        lines.append(f"stopped   after step {steps_run + min(r.start_step for r in results)}; checkpoint in "
                     f"{plan.job.out}; continue with --resume --out {plan.job.out}")
    elif plan.job.out:
        lines.append(f"saved     {plan.job.out} (AutoModelForCausalLM.from_pretrained loads it)")
    return "\n".join(lines)
