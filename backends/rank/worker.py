"""One rank's life: build its layers and host state, run the schedule step after step, checkpoint, save.

`train_rank` is the whole life given a communicator and a control group, so the same code runs in
a process of its own (`rankprocess.process_main`, under `tinypipe run` or `torchrun`) and, for tests, as a
thread (`spawn.run_threads`). Step k runs the schedule's iteration min(k, K-1) as a template,
with the actions' steps shifted to k: iterations repeat, and the last compiled one is the steady
state. `window="schedule"` instead runs all K compiled iterations as one window (steps == K), so
the executed per-resource order can be compared with the schedule's whole lists.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tinypipe.compiler import window_steps
from tinypipe.ir.ledger import Ledger
from tinypipe.ir.schedule import Schedule, owned_layers, rank_actions
from tinypipe.ir.timeline import Record

from ..host.pinned import registered_bytes, torch_pinned_peak_bytes
from ..host.state import DTYPES, AdamWConfig
from ..model.compiled import COMPILE_BACKEND, LayerCaller
from ..save import checkpoint
from ..save.lora_save import LoraFiles, save_outputs
from .comm import Comm
from .cpustat import Steal
from .evaluation import EVAL_SPAN, eval_steps, evaluate
from .executor import Carried, RunLog, run_actions
from .gradclip import GradClip
from .groups import Group
from .hostwork import HostWorker, gc_pauses, host_settings, settle_heap_enabled, settled_heap
from .interpreter import ExecutionError, Interpreter, StepData
from .metrics import StepLog
from .rank_state import build_rank_state, rss_now
from .rank_state import strip_parameters as strip_parameters  # where tests and the profiler take it from
from .rss_guard import GuardSettings, LowMemory, RssGuard


@dataclass(frozen=True)
class Job:
    """Everything a rank needs to train (picklable: it travels to spawned processes)."""

    model: str
    schedule: Schedule
    steps: int
    seq_len: int
    microbatch_size: int
    data: str | None = None
    byte_tokens: bool = True  # a model without tokenizer files trains on byte ids (the planner checked)
    packing: bool = True  # examples packed end to end (else one per sequence, data.examples.pack)
    seed: int = 0
    optim: AdamWConfig = AdamWConfig()
    backend: str = "cpu"
    out: str | None = None
    checkpoint_every: int = 0
    checkpoint_s: float = 0.0  # also checkpoint after this much training time, and at the end (0: off)
    keep_checkpoints: int = checkpoint.DEFAULT_KEEP  # complete checkpoints kept (`--keep-checkpoints`)
    resume: bool = False
    threads: int = 0  # torch intra-op threads per rank (0: torch's default)
    gpu_mem_bytes: int | None = None  # CUDA: the caching allocator's cap per rank (None: the whole GPU)
    progress: bool = True
    write_metrics: bool = True  # OUT/metrics.jsonl (and TensorBoard), by rank 0
    grad_norm: bool = True  # each step's global gradient norm for the metrics (`--no-grad-norm`)
    max_grad_norm: float | None = None  # clip by the global gradient norm (the schedule must have grad_clip)
    eval_data: str | None = None  # held-out data file (`--eval-data`), else
    eval_fraction: float = 0.0  # the share of `data`'s sequences held out (`--eval-fraction`)
    eval_every: int = 0  # evaluate every N steps (0: at the end only), when there is held-out data
    save_every: int = 0  # also save the model to OUT/step-N every N steps (0: off)
    save_dtype: str | None = None  # the saved weights' dtype (DTYPES key; None: fp32, the masters')
    save_model: bool = True
    keep_masters: bool = False  # return the final fp32 masters in the result (tests)
    compile_blocks: bool = False  # torch.compile the decoder blocks (`--compile`, backends/model/compiled.py)
    compile_backend: str = COMPILE_BACKEND
    stop_after: int | None = None  # behave as if interrupted after this many steps (tests)
    trace_memory: bool = False  # CUDA: sample the allocator at each action (`--trace-memory`; run_actions(memory=))
    identity: dict[str, Any] = field(default_factory=dict)  # what a checkpoint must match on --resume
    record: dict[str, Any] = field(default_factory=dict)  # the run's options, recorded for --resume
    timeout_s: float = 600.0
    lora_files: LoraFiles = LoraFiles()  # LoRA: an adapter directory to continue from; --merge
    rss_guard: GuardSettings = GuardSettings()  # when host memory runs low the rank stops as Ctrl-C stops it

    @property
    def tokens_per_step(self) -> int:
        return self.schedule.microbatches * self.microbatch_size * self.seq_len


@dataclass
class RankResult:
    """What one rank reports at the end (gathered to rank 0)."""

    rank: int
    layers: list[int]
    losses: dict[int, float]
    records: list[Record]
    order: dict[str, list[int]]
    memory: list[tuple[float, int]]
    ledger_peak: dict[str, int]
    ledger_problems: list[str]
    held: dict[str, Any]  # HeldBytes.to_json()
    peak_device_bytes: int
    peak_rss_bytes: int
    start_step: int
    steps_run: int
    wall_s: float
    interrupted: bool = False
    peak_reserved_bytes: int = 0  # the caching allocator's peak reserved memory (CUDA)
    alloc_retries: int = 0  # allocations that found no cached block within the cap and freed cache (CUDA)
    masters: dict[int, dict[str, torch.Tensor]] | None = None
    issued: list[int] = field(default_factory=list)  # action ids in the order the host issued them
    peaks: list[tuple[float, int, int]] = field(default_factory=list)  # RunLog.peaks (CUDA with Job.trace_memory)
    issue: list[tuple[int, float, float]] = field(default_factory=list)  # RunLog.issue: the main thread's issue spans
    # (name, start, end) on the host clock: the rank's work between windows and garbage collections of 1 ms
    # or more (hostwork.gc_pauses), drawn on the trace's `gN.host`
    host: list[tuple[str, float, float]] = field(default_factory=list)
    # host RSS at points of the rank's life: phase -> (resident now, peak so far), bytes
    rss_phases: dict[str, tuple[int, int]] = field(default_factory=dict)
    # most pinned host bytes held at once: the slabs this rank registered with CUDA, and PyTorch's pinned
    # caching allocator (None where torch has no statistics for it); two peaks, so their sum is an upper bound
    pinned_peak_bytes: dict[str, int | None] = field(default_factory=dict)
    # the host's CPU time a hypervisor took (cpustat.Steal) over the training loop; None where unknown
    host_steal_share: float | None = None
    checkpoint_failures: list[str] = field(default_factory=list)  # checkpoint.Failed.line() of each not written
    eval_losses: dict[int, float] = field(default_factory=dict)  # step (0-based) -> held-out loss after it (rank 0)
    low_memory: LowMemory | None = None  # what this rank's host-memory guard saw when it stopped the run


def step_data(batches: Any, step: int) -> StepData:
    from ..model.layers import IGNORE_INDEX

    mbs = batches.step(step)
    denom = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in mbs)
    if denom == 0:
        raise ExecutionError(f"step {step}: no token carries loss (every label is {IGNORE_INDEX})")
    return StepData(microbatches=mbs, denom=float(denom), documents=batches.documents(step))


def train_rank(job: Job, rank: int, world: int, comm: Comm | None, group: Group, *,
               stop: threading.Event | None = None, local_rank: int = 0, norms: Group | None = None) -> RankResult:
    """Train `job.steps` steps as rank `rank` of `world`; returns what this rank saw. `norms`: the
    collective the optimizer thread sums the gradient norm over (a schedule that clips)."""
    host_spans: list[tuple[str, float, float]] = []  # RankResult.host
    stop = threading.Event() if stop is None else stop  # Ctrl-C's event, which the host-memory guard sets too
    with (host_settings(), gc_pauses(host_spans), settled_heap(host_spans) as settle_heap,
          RssGuard(stop, job.rss_guard, rank=rank) as guard):
        return _train_rank(job, rank, world, comm, group, stop=stop, local_rank=local_rank, norms=norms,
                           host_spans=host_spans, guard=guard,
                           settle_heap=settle_heap if settle_heap_enabled(job.compile_blocks, job.backend) else None)


def _train_rank(job: Job, rank: int, world: int, comm: Comm | None, group: Group, *,
                stop: threading.Event, local_rank: int, norms: Group | None, host_spans: list[tuple[str, float, float]],
                guard: RssGuard, settle_heap: Callable[[], None] | None) -> RankResult:
    from ..data.batches import make_batches
    from ..data.tokenizers import load_tokenizer

    sched = job.schedule
    if sched.num_gpus != world:
        raise ExecutionError(f"the schedule is for {sched.num_gpus} GPUs, this run has {world} ranks")
    device = torch.device("cuda", local_rank) if job.backend == "cuda" else torch.device("cpu")
    if device.type == "cuda" and job.gpu_mem_bytes is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, job.gpu_mem_bytes / total), device)
    layers = owned_layers(sched, rank)
    stack, host, rss = build_rank_state(job, layers, device)
    host.measure_grad_norm = job.grad_norm
    tokenizer = load_tokenizer(stack.source_dir, vocab_size=stack.spec.vocab_size,
                               byte_tokens=job.byte_tokens or job.data is None)
    shape = {"tokenizer": tokenizer, "seq_len": job.seq_len, "microbatch_size": job.microbatch_size,
             "microbatches": sched.microbatches, "seed": job.seed, "packing": job.packing}
    held = job.eval_fraction if job.eval_data is None else 0.0
    batches = make_batches(job.data, hold_out=held, **shape)  # type: ignore[arg-type]
    held_out = (make_batches(job.eval_data or job.data, hold_out=held, part="eval", **shape)  # type: ignore[arg-type]
                if job.eval_data or job.eval_fraction else None)
    interp = Interpreter(rank=rank, schedule=sched, layers=stack.layers, host=host, comm=comm, device=device,
                         hidden_size=stack.spec.hidden_size, tied=stack.tied,
                         caller=LayerCaller(compile_blocks=job.compile_blocks, backend=job.compile_backend),
                         clip=None if job.max_grad_norm is None else GradClip(job.max_grad_norm, norms, host))
    actions = rank_actions(sched, rank)
    by_prefix: dict[int, list[Any]] = {}  # n -> this rank's actions of iterations 0..n-1
    ledger = Ledger(sched.static_bytes, buffers=True)
    start, losses = 0, {}
    if job.resume and job.out:
        found = checkpoint.find(job.out)
        if found is not None:
            meta = checkpoint.read_meta(found, job.identity)
            state = checkpoint.load(found, rank)
            host.load_state_dict(state["host"])
            checkpoint.set_rng_state(state["rng"])
            start, losses = int(meta["step"]), dict(state["losses"])
    steplog = (StepLog(job.out if job.write_metrics else None, steps=job.steps, start=start,
                       tokens_per_step=job.tokens_per_step, ranks=world, lr_at=job.optim.lr_at,
                       progress=job.progress, norms=job.grad_norm,
                       eval_every=job.eval_every if held_out is not None else None) if rank == 0 else None)
    log = RunLog()
    t_begin = time.perf_counter()
    steal = Steal()  # the host's CPU time the hypervisor took while this rank trained
    interrupted = False
    saved = [start, time.monotonic()]  # step and time of the last checkpoint (or of the start)
    carry = Carried()  # OPT_STEPs still running when their window's device work ended
    failures: list[str] = []  # checkpoints not written (RankResult.checkpoint_failures)

    def finish_host_steps() -> None:
        log.records.extend(carry.collect(id_stride=len(sched.actions), ledger=ledger, wait=True))

    def save_checkpoint(step: int) -> None:
        assert job.out is not None
        if not job.keep_checkpoints:  # --keep-checkpoints 0: none written
            return
        finish_host_steps()  # the host state as of `step`
        done = checkpoint.save(job.out, rank=rank, step=step, identity=job.identity, group=group,
                               state={"host": host.state_dict(), "rng": checkpoint.rng_state(), "losses": losses},
                               run=job.record, keep=job.keep_checkpoints)
        if isinstance(done, checkpoint.Failed):  # one line; training goes on, the model is still saved
            if rank == 0:
                print(done.line(), file=sys.stderr, flush=True)
            failures.append(done.line())
        saved[:] = [step, time.monotonic()]

    def save_model(at: int | None) -> None:
        """The model in Hugging Face form: in OUT at the end, in OUT/step-N at step N."""
        assert job.out is not None
        finish_host_steps()
        where = job.out if at is None else str(Path(job.out) / f"step-{at}")
        save_outputs(host, stack, where, sched.lora, job.lora_files, job.model, rank, world, group.barrier,
                     dtype=DTYPES[job.save_dtype] if job.save_dtype else None)  # LoRA: a peft adapter directory
        group.barrier()  # every rank's shards are written when any rank goes on

    step = start
    optimizer = HostWorker(f"rank{rank}-optim")  # runs the OPT_STEPs beside GPU dispatch
    window_end = None  # when the last window's run_actions returned
    while step < job.steps:
        cuts = (job.checkpoint_every if job.out else 0, job.save_every if job.out else 0,
                job.eval_every if held_out is not None else 0)
        n = window_steps(step, iterations=1 if settle_heap else sched.iterations, steps=job.steps,
                         every=cuts)  # settle_heap: iteration 0 alone
        if job.stop_after is not None and step < job.stop_after:
            n = min(n, job.stop_after - step)
        window = by_prefix.get(n)
        if window is None:
            window = by_prefix[n] = [a for a in actions if a.iteration < n]
        t_data = time.perf_counter()
        data = {step + k: step_data(batches, step + k) for k in range(n)}
        t_run = time.perf_counter()
        host_spans.append(("step data", t_data, t_run))
        if window_end is not None:
            host_spans.append(("between windows", window_end, t_run))
        part = run_actions(interp, window, data, shift=step, ledger=ledger, id_stride=len(sched.actions),
                           host_worker=optimizer, carry=carry, memory=job.trace_memory)
        window_end = time.perf_counter()
        log.extend(part)
        losses.update(part.losses)
        if "first window run" not in rss:
            rss["first window run"] = rss_now()
        left = interp.leftovers()
        if left:
            raise ExecutionError(f"rank {rank}: steps {step}..{step + n - 1} ended still holding {', '.join(left[:6])}")
        at = step + n
        ev, eval_s = None, 0.0
        if held_out is not None and (at == job.steps or (job.eval_every and at % job.eval_every == 0)):
            finish_host_steps()  # the weights after step `at`
            t_eval = time.perf_counter()
            ev = evaluate(interp, by_prefix.get(1) or [a for a in actions if a.iteration < 1], held_out,
                          eval_steps(held_out), at=at, step_data=step_data, id_stride=len(sched.actions),
                          host_worker=optimizer)
            host_spans.append((EVAL_SPAN, t_eval, time.perf_counter()))  # not training: left out of its speed
            eval_s = host_spans[-1][2] - t_eval
        parts = group.gather(({k: losses[k] for k in part.losses}, host.take_grad_sq(), ev))
        if steplog is not None and parts is not None:
            steplog.window(step, at, window_end - t_run, [(p[0], p[1]) for p in parts],
                           eval_loss=next((p[2] for p in parts if p[2] is not None), None), eval_s=eval_s)
        step += n
        saving = bool(job.out and job.save_every and step % job.save_every == 0 and step < job.steps)
        if settle_heap:
            finish_host_steps()  # once: the optimizer's tail would wait for the GIL the collection holds
            settle_heap()
            settle_heap = None
        wants_stop = stop.is_set() or (job.stop_after is not None and step >= job.stop_after)
        interrupted = group.any_true(wants_stop) and step < job.steps
        every = job.checkpoint_every
        due = bool(job.checkpoint_s) and time.monotonic() - saved[1] >= job.checkpoint_s
        if job.checkpoint_s:  # each rank's clock votes; all ranks checkpoint together
            due = group.any_true(due)
        if job.out and (interrupted or due or (every and step % every == 0)):
            save_checkpoint(step)
        if saving and not interrupted:  # (a stopped run saves its model at the stop, below)
            save_model(step)
        if interrupted:
            break
    finish_host_steps()
    optimizer.close()
    parts = group.gather(({}, host.take_grad_sq(), None))
    if steplog is not None:
        steplog.close([(p[0], p[1]) for p in parts or ()])
    rss["training done"] = rss_now()
    wall = time.perf_counter() - t_begin
    # stopped with host memory low on any rank: no model at the stop (a copy of the weights; the checkpoint resumes)
    tripped = guard.tripped  # as this decision saw it (RankResult.low_memory)
    low_memory = interrupted and group.any_true(tripped is not None)
    if job.out and job.save_model and not low_memory:  # the fine-tuned model first: the run's result
        save_model(step if interrupted else None)  # Ctrl-C: the model as of the stop, beside the checkpoint
    if job.out and job.checkpoint_s and not interrupted and saved[0] != step:  # and at the end
        save_checkpoint(step)
    # the allocator's peak since the last reset, and before it the per-action peaks that reset it
    peak_dev = (max([torch.cuda.max_memory_allocated(device), *(b for _, _, b in log.peaks)])
                if device.type == "cuda" else max((b for _, b in log.memory), default=0))
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    return RankResult(
        rank=rank, layers=layers, losses=losses, records=log.records, order=dict(log.order), memory=log.memory,
        ledger_peak=ledger.peaks(), ledger_problems=list(ledger.problems), held=host.held().to_json(),
        peak_device_bytes=peak_dev, peak_rss_bytes=rss_now()[1], rss_phases=rss,
        start_step=start, steps_run=len({r.iteration for r in log.records}), wall_s=wall, interrupted=interrupted,
        peak_reserved_bytes=max(int(stats.get("reserved_bytes.all.peak", 0)), log.reserved_peak),
        alloc_retries=int(stats.get("num_alloc_retries", 0)),
        masters=host.masters() if job.keep_masters else None, issued=log.issued, peaks=log.peaks, issue=log.issue,
        host=[h for h in host_spans if h[2] >= t_begin],  # the training loop's, not the model build's
        pinned_peak_bytes={"slabs": registered_bytes()[1], "torch_allocator": torch_pinned_peak_bytes()},
        host_steal_share=steal.share(), checkpoint_failures=failures,
        eval_losses=dict(steplog.eval) if steplog is not None else {}, low_memory=tripped)
