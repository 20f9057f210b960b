"""`Trainer`: one rank's training loop, window by window: run the window's actions, evaluate, report, checkpoint, save.

`worker.train_rank` builds one inside the rank's host settings and guards and runs it. Step k runs the
schedule's iteration min(k, K-1) as a template, with the actions' steps shifted to k (worker.py's docstring).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tinypipe.compiler import window_steps
from tinypipe.ir.ledger import Ledger
from tinypipe.ir.schedule import Schedule, owned_layers, rank_actions

from ..host.pinned import registered_bytes, torch_pinned_peak_bytes
from ..host.state import DTYPES
from ..model.compiled import LayerCaller
from ..save import checkpoint
from ..save.lora_save import save_outputs
from .comm import Comm
from .cpustat import Steal
from .evaluation import EVAL_SPAN, eval_steps, evaluate
from .executor import Carried, RunLog, run_actions
from .gradclip import GradClip
from .groups import Group
from .hostwork import HostWorker
from .interpreter import ExecutionError, Interpreter, StepData
from .job import Job, RankResult
from .metrics import StepLog
from .rank_state import build_rank_state, rss_now
from .rss_guard import RssGuard


def step_data(batches: Any, step: int) -> StepData:
    """Step `step`'s microbatches from `batches`, with the count of tokens that carry loss (the loss's divisor)."""
    from ..model.layers import IGNORE_INDEX

    mbs = batches.step(step)
    denom = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in mbs)
    if denom == 0:
        raise ExecutionError(f"step {step}: no token carries loss (every label is {IGNORE_INDEX})")
    return StepData(microbatches=mbs, denom=float(denom), documents=batches.documents(step))


def _device(job: Job, local_rank: int) -> torch.device:
    """The rank's device; on CUDA with `job.gpu_mem_bytes`, the caching allocator capped to it."""
    device = torch.device("cuda", local_rank) if job.backend == "cuda" else torch.device("cpu")
    if device.type == "cuda" and job.gpu_mem_bytes is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, job.gpu_mem_bytes / total), device)
    return device


def _batches(job: Job, source_dir: Any, vocab_size: int) -> tuple[Any, Any]:
    """(the training batches, the held-out batches or None) of `job`, tokenised for the model."""
    from ..data.batches import make_batches
    from ..data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(source_dir, vocab_size=vocab_size, byte_tokens=job.byte_tokens or job.data is None)
    shape = {"tokenizer": tokenizer, "seq_len": job.seq_len, "microbatch_size": job.microbatch_size,
             "microbatches": job.schedule.microbatches, "seed": job.seed, "packing": job.packing}
    held = job.eval_fraction if job.eval_data is None else 0.0
    batches = make_batches(job.data, hold_out=held, split=job.data_split, config=job.data_config,
                           **shape)  # type: ignore[arg-type]
    held_out = (make_batches(job.eval_data or job.data, hold_out=held, part="eval",
                             split=None if job.eval_data else job.data_split,
                             config=None if job.eval_data else job.data_config, **shape)  # type: ignore[arg-type]
                if job.eval_data or job.eval_fraction else None)
    return batches, held_out


class Trainer:
    """One rank's state for training (its layers, host state, interpreter, data, ledger, logs) and its loop."""

    def __init__(self, job: Job, rank: int, world: int, comm: Comm | None, group: Group, *,
                 stop: threading.Event, local_rank: int, norms: Group | None,
                 host_spans: list[tuple[str, float, float]], guard: RssGuard,
                 settle_heap: Callable[[], None] | None) -> None:
        sched: Schedule = job.schedule
        if sched.num_gpus != world:
            raise ExecutionError(f"the schedule is for {sched.num_gpus} GPUs, this run has {world} ranks")
        self.job, self.rank, self.world, self.group, self.stop, self.guard = job, rank, world, group, stop, guard
        self.host_spans = host_spans  # RankResult.host
        self.settle_heap = settle_heap  # once, after the first window (hostwork.settled_heap); then None
        self.sched = sched
        self.device = _device(job, local_rank)
        self.layers = owned_layers(sched, rank)
        self.stack, self.host, self.rss = build_rank_state(job, self.layers, self.device)
        self.host.measure_grad_norm = job.grad_norm
        self.batches, self.held_out = _batches(job, self.stack.source_dir, self.stack.spec.vocab_size)
        self.interp = Interpreter(
            rank=rank, schedule=sched, layers=self.stack.layers, host=self.host, comm=comm, device=self.device,
            hidden_size=self.stack.spec.hidden_size, tied=self.stack.tied,
            caller=LayerCaller(compile_blocks=job.compile_blocks, backend=job.compile_backend),
            clip=None if job.max_grad_norm is None else GradClip(job.max_grad_norm, norms, self.host))
        self.actions = rank_actions(sched, rank)
        self.by_prefix: dict[int, list[Any]] = {}  # n -> this rank's actions of iterations 0..n-1
        self.ledger = Ledger(sched.static_bytes, buffers=True)
        self.start, self.losses = self._resume()
        self.steplog = (StepLog(job.out if job.write_metrics else None, steps=job.steps, start=self.start,
                                tokens_per_step=job.tokens_per_step, ranks=world, lr_at=job.optim.lr_at,
                                progress=job.progress, norms=job.grad_norm,
                                eval_every=job.eval_every if self.held_out is not None else None,
                                report_to=job.report_to, config=job.record,
                                on_row=None if job.feed is None else job.feed.put)
                        if rank == 0 else None)
        self.log = RunLog()
        self.carry = Carried()  # OPT_STEPs still running when their window's device work ended
        self.failures: list[str] = []  # checkpoints not written (RankResult.checkpoint_failures)
        self.saved = (self.start, time.monotonic())  # step and time of the last checkpoint (or of the start)
        self.window_end: float | None = None  # when the last window's run_actions returned
        self.optimizer: HostWorker | None = None  # runs the OPT_STEPs beside GPU dispatch, while training

    def _resume(self) -> tuple[int, dict[int, float]]:
        """(the first step, the losses so far): from the latest checkpoint on --resume, else (0, {})."""
        job = self.job
        if job.resume and job.out:
            found = checkpoint.find(job.out)
            if found is not None:
                meta = checkpoint.read_meta(found, job.identity)
                state = checkpoint.load(found, self.rank)
                self.host.load_state_dict(state["host"])
                checkpoint.set_rng_state(state["rng"])
                return int(meta["step"]), dict(state["losses"])
        return 0, {}

    def run(self) -> RankResult:
        """Train from the first step to `job.steps` (or to a stop every rank agrees on); what this rank saw."""
        job = self.job
        t_begin = time.perf_counter()
        steal = Steal()  # the host's CPU time the hypervisor took while this rank trained
        interrupted = False
        self.saved = (self.start, time.monotonic())
        step = self.start
        self.optimizer = HostWorker(f"rank{self.rank}-optim")
        while step < job.steps:
            n = self._window_size(step)
            part, t_run = self._train_window(step, n)
            self._report(step, step + n, part, t_run)
            step += n
            interrupted = self._after_window(step)
            if interrupted:
                break
        return self._finish(step, interrupted, t_begin, steal)

    def _window_size(self, step: int) -> int:
        """Steps in the window from `step`: whole compiled iterations, cut at checkpoints, saves, evaluations."""
        job = self.job
        cuts = (job.checkpoint_every if job.out else 0, job.save_every if job.out else 0,
                job.eval_every if self.held_out is not None else 0)
        n = window_steps(step, iterations=1 if self.settle_heap else self.sched.iterations, steps=job.steps,
                         every=cuts)  # settle_heap: iteration 0 alone
        if job.stop_after is not None and step < job.stop_after:
            n = min(n, job.stop_after - step)
        return n

    def _train_window(self, step: int, n: int) -> tuple[RunLog, float]:
        """Steps `step`..`step + n - 1` through the executor; (what it logged, when it began)."""
        assert self.optimizer is not None
        window = self.by_prefix.get(n)
        if window is None:
            window = self.by_prefix[n] = [a for a in self.actions if a.iteration < n]
        t_data = time.perf_counter()
        data = {step + k: step_data(self.batches, step + k) for k in range(n)}
        t_run = time.perf_counter()
        self.host_spans.append(("step data", t_data, t_run))
        if self.window_end is not None:
            self.host_spans.append(("between windows", self.window_end, t_run))
        part = run_actions(self.interp, window, data, shift=step, ledger=self.ledger,
                           id_stride=len(self.sched.actions), host_worker=self.optimizer, carry=self.carry,
                           memory=self.job.trace_memory)
        self.window_end = time.perf_counter()
        self.log.extend(part)
        self.losses.update(part.losses)
        if "first window run" not in self.rss:
            self.rss["first window run"] = rss_now()
        left = self.interp.leftovers()
        if left:
            raise ExecutionError(f"rank {self.rank}: steps {step}..{step + n - 1} ended still holding "
                                 f"{', '.join(left[:6])}")
        return part, t_run

    def _report(self, step: int, at: int, part: RunLog, t_run: float) -> None:
        """The window's losses and gradient norms (and held-out loss, when due) gathered to rank 0's log."""
        job = self.job
        ev, eval_s = None, 0.0
        if self.held_out is not None and (at == job.steps or (job.eval_every and at % job.eval_every == 0)):
            ev, eval_s = self._evaluate(at)
        parts = self.group.gather(({k: self.losses[k] for k in part.losses}, self.host.take_grad_sq(), ev))
        if self.steplog is not None and parts is not None:
            assert self.window_end is not None
            self.steplog.window(step, at, self.window_end - t_run, [(p[0], p[1]) for p in parts],
                                eval_loss=next((p[2] for p in parts if p[2] is not None), None), eval_s=eval_s)

    def _evaluate(self, at: int) -> tuple[float | None, float]:
        """(the held-out loss after step `at` on the rank with the head, else None; the seconds it took)."""
        assert self.optimizer is not None
        self.finish_host_steps()  # the weights after step `at`
        t_eval = time.perf_counter()
        ev = evaluate(self.interp, self.by_prefix.get(1) or [a for a in self.actions if a.iteration < 1],
                      self.held_out, eval_steps(self.held_out), at=at, step_data=step_data,
                      id_stride=len(self.sched.actions), host_worker=self.optimizer)
        self.host_spans.append((EVAL_SPAN, t_eval, time.perf_counter()))  # not training: left out of its speed
        return ev, self.host_spans[-1][2] - t_eval

    def _after_window(self, step: int) -> bool:
        """Settle the heap once, vote on stopping, checkpoint and save when due; whether the run stops here."""
        job = self.job
        saving = bool(job.out and job.save_every and step % job.save_every == 0 and step < job.steps)
        if self.settle_heap:
            self.finish_host_steps()  # once: the optimizer's tail would wait for the GIL the collection holds
            self.settle_heap()
            self.settle_heap = None
        wants_stop = (self.stop.is_set() or (job.stop_after is not None and step >= job.stop_after)
                      or (job.feed is not None and job.feed.stop_asked()))  # the Python API's callback asked
        interrupted = self.group.any_true(wants_stop) and step < job.steps
        every = job.checkpoint_every
        due = bool(job.checkpoint_s) and time.monotonic() - self.saved[1] >= job.checkpoint_s
        if job.checkpoint_s:  # each rank's clock votes; all ranks checkpoint together
            due = self.group.any_true(due)
        if job.out and (interrupted or due or (every and step % every == 0)):
            self.save_checkpoint(step)
        if saving and not interrupted:  # (a stopped run saves its model at the stop, in `_finish`)
            self.save_model(step)
        return interrupted

    def finish_host_steps(self) -> None:
        """Wait for the optimizer steps still running on the host and log them."""
        self.log.records.extend(self.carry.collect(id_stride=len(self.sched.actions), ledger=self.ledger, wait=True))

    def save_checkpoint(self, step: int) -> None:
        """This rank's part of the checkpoint at `step` (none under --keep-checkpoints 0); a failure is one line."""
        job = self.job
        assert job.out is not None
        if not job.keep_checkpoints:  # --keep-checkpoints 0: none written
            return
        self.finish_host_steps()  # the host state as of `step`
        done = checkpoint.save(job.out, rank=self.rank, step=step, identity=job.identity, group=self.group,
                               state={"host": self.host.state_dict(), "rng": checkpoint.rng_state(),
                                      "losses": self.losses},
                               run=job.record, keep=job.keep_checkpoints)
        if isinstance(done, checkpoint.Failed):  # one line; training goes on, the model is still saved
            if self.rank == 0:
                print(done.line(), file=sys.stderr, flush=True)
            self.failures.append(done.line())
        self.saved = (step, time.monotonic())

    def save_model(self, at: int | None) -> None:
        """The model in Hugging Face form: in OUT at the end, in OUT/step-N at step N."""
        job = self.job
        assert job.out is not None
        self.finish_host_steps()
        where = job.out if at is None else str(Path(job.out) / f"step-{at}")
        # LoRA: a peft adapter directory
        save_outputs(self.host, self.stack, where, self.sched.lora, job.lora_files, job.model, self.rank, self.world,
                     self.group.barrier, dtype=DTYPES[job.save_dtype] if job.save_dtype else None)
        self.group.barrier()  # every rank's shards are written when any rank goes on

    def _finish(self, step: int, interrupted: bool, t_begin: float, steal: Steal) -> RankResult:
        """The last host steps, the log closed, the model and a last checkpoint saved; what this rank saw."""
        job, group, host, log = self.job, self.group, self.host, self.log
        assert self.optimizer is not None
        self.finish_host_steps()
        self.optimizer.close()
        parts = group.gather(({}, host.take_grad_sq(), None))
        if self.steplog is not None:
            self.steplog.close([(p[0], p[1]) for p in parts or ()])
        self.rss["training done"] = rss_now()
        wall = time.perf_counter() - t_begin
        # stopped with host memory low on any rank: no model at the stop (a copy of the weights; the checkpoint resumes)
        tripped = self.guard.tripped  # as this decision saw it (RankResult.low_memory)
        low_memory = interrupted and group.any_true(tripped is not None)
        if job.out and job.save_model and not low_memory:  # the fine-tuned model first: the run's result
            self.save_model(step if interrupted else None)  # Ctrl-C: the model as of the stop, beside the checkpoint
        if job.out and job.checkpoint_s and not interrupted and self.saved[0] != step:  # and at the end
            self.save_checkpoint(step)
        device = self.device
        # the allocator's peak since the last reset, and before it the per-action peaks that reset it
        peak_dev = (max([torch.cuda.max_memory_allocated(device), *(b for _, _, b in log.peaks)])
                    if device.type == "cuda" else max((b for _, b in log.memory), default=0))
        stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
        return RankResult(
            rank=self.rank, layers=self.layers, losses=self.losses, records=log.records, order=dict(log.order),
            memory=log.memory, ledger_peak=self.ledger.peaks(), ledger_problems=list(self.ledger.problems),
            held=host.held().to_json(), peak_device_bytes=peak_dev, peak_rss_bytes=rss_now()[1], rss_phases=self.rss,
            start_step=self.start, steps_run=len({r.iteration for r in log.records}), wall_s=wall,
            interrupted=interrupted,
            peak_reserved_bytes=max(int(stats.get("reserved_bytes.all.peak", 0)), log.reserved_peak),
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
            masters=host.masters() if job.keep_masters else None, issued=log.issued, peaks=log.peaks, issue=log.issue,
            host=[h for h in self.host_spans if h[2] >= t_begin],  # the training loop's, not the model build's
            pinned_peak_bytes={"slabs": registered_bytes()[1], "torch_allocator": torch_pinned_peak_bytes()},
            host_steal_share=steal.share(), checkpoint_failures=self.failures,
            eval_losses=dict(self.steplog.eval) if self.steplog is not None else {}, low_memory=tripped)
