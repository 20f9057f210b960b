"""What a run needs before any worker starts: its inputs checked, the machine it runs on, the schedule.

Every user mistake found here is an `InputError` (one line, exit code 2) raised before a process is
spawned: a model that cannot be found or trained, a data file that is not JSONL, a policy that
does not fit the model or the devices (the compiler's checks, then the simulator's memory ledgers
at the devices' capacities), more devices than exist, batch sizes that do not divide.

The schedule is compiled for a `Hardware` describing where the run happens (`devices.py`). On CUDA
that is the shipped preset of the GPU model when one matches, else a description of the local GPUs;
on the CPU backend, N worker processes stand in for GPUs and `cpu_hardware` describes them with
rates measured in a fraction of a second: the simulator's prediction printed beside the measurement
is made with it and an analytic trace.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tinypipe.common.errors import InputError
from tinypipe.common.table import gib
from tinypipe.compiler import WINDOW_ITERATIONS, window_steps
from tinypipe.describe.hardware import Hardware
from tinypipe.describe.model import ModelSpec
from tinypipe.describe.target import gpu_mem_bytes
from tinypipe.describe.trace import ProfileTrace, load_profiles, trace_for, unmatched_note
from tinypipe.ir.schedule import Schedule
from tinypipe.policy import Policy, load_policy
from tinypipe.policy.lora_spec import LoraSpec, lora_text
from tinypipe.sim import SimResult
from tinypipe.sim.guard import simulate_policy

from ..data.batches import Batches
from ..data.tokenizers import Tokenizer
from ..host.optim_rules import default_lr, lr_schedule, warmup_steps
from ..host.state import AdamWConfig
from ..model.hf import ModelSource, hf_name_maps
from ..model.lora_adapters import expert_ranks
from ..options.record import RunOptions
from ..options.settings import DEFAULT_MICROBATCH_SIZE, DEFAULT_POLICY, rank_threads
from ..rank.rss_guard import GuardSettings
from ..rank.worker import Job
from ..save.lora_save import LoraFiles, check_adapter, lora_files
from .calibrate import calibrate_run
from .devices import cpu_hardware, cuda_hardware, first_gpus
from .hostfit import check_host_fits, run_host_limit
from .inputs import check_checkpoint, check_eval, check_lora_libraries, check_lora_policy

MAX_CPU_WORKERS_PER_CORE = 4  # more CPU workers than this per core is a mistake, not a test


@dataclass(frozen=True)
class RunPlan:
    """A checked run: the job the workers execute and what the summary compares it with."""

    job: Job
    world: int
    policy: Policy
    spec: ModelSpec
    hardware: Hardware
    trace: ProfileTrace
    schedule: Schedule
    prediction: SimResult  # the simulator's run of `schedule` on `hardware`
    batch_tokens: int
    addition_task: bool  # the data is the embedded addition task (accuracy is measured)
    note: str | None = None  # a choice made for the user, shown under the header
    compiled_policy: Policy | None = None  # what `schedule` was compiled from (packs pinned on --resume)
    calibration: str | None = None  # the host rates the plan took from this machine, and when (None: --calibrate off)
    data_lines: tuple[str, ...] = ()  # what the run read from --data (data.summary), printed under the header


def _check_model(name: str) -> ModelSource:
    """The model's source, its weights checked (index, shards, every tensor the model needs); a Hugging Face Hub
    id's weights and tokenizer in the Hugging Face cache (downloaded there if need be) before any worker reads them."""
    from tinypipe.describe.hubcache import is_hub_id, model_dir

    from ..model.hf import load_source
    from .inputs import check_weights

    if is_hub_id(name):
        model_dir(name, weights=True)
    source = load_source(name)
    d = source.directory
    if d is not None and Path(name).is_dir() and not source.has_weights:
        raise InputError(f"{d}: no model weights (model.safetensors or model.safetensors.index.json); "
                         "give a model directory with safetensors, or a config.json / shipped name to train "
                         "from a seeded random initialisation")
    if d is not None and source.has_weights:
        check_weights(d, [hf for names in hf_name_maps(source.config) for hf in names.values()])
    return source


def make_run_plan(opts: RunOptions, *, phase: Callable[[str], None] | None = None) -> RunPlan:
    """Check the settled `tinypipe run` options (`settings.settle` builds them) and compile the schedule;
    InputError on any mistake. `phase(text)` hears what starts next (the CLI shows it as progress)."""
    from ..data.addition import ADDITION
    from ..data.tokenizers import load_tokenizer

    guard = GuardSettings.from_env()  # the workers' host-memory guard (backends/rank/rss_guard.py)
    if opts.backend == "cpu" and opts.gpus > MAX_CPU_WORKERS_PER_CORE * (os.cpu_count() or 1):
        raise InputError(f"--gpus {opts.gpus}: too many CPU workers for {os.cpu_count()} cores "
                         f"(at most {MAX_CPU_WORKERS_PER_CORE} per core)")
    if opts.record is not None:  # --resume: the rank files complete and holding what meta.json says, before any work
        check_checkpoint(opts.out, opts.record, opts.gpus)
    say = phase or (lambda text: None)
    profiles = load_profiles(opts.profile)  # measured traces (`tinypipe profile`)
    # `--model` a peft adapter directory: its base model, and its LoraSpec (backends/save/lora_save.py)
    files, base, adapter_lora = lora_files(opts.model, lora=opts.lora, optimizer_state=opts.optimizer_state,
                                           merge=opts.merge, save=opts.save, save_every=opts.save_every)
    opts = dataclasses.replace(opts, model=base)
    say(f"checking the model {opts.model}")
    source = _check_model(opts.model)
    spec = source.spec
    if opts.seq_len > spec.max_seq_len:
        raise InputError(f"--seq-len {opts.seq_len}: {spec.name} handles at most {spec.max_seq_len} positions")
    data = None if opts.data is None or (opts.data == ADDITION and not Path(ADDITION).exists()) else opts.data
    tokenizer = load_tokenizer(source.directory, vocab_size=spec.vocab_size,
                               byte_tokens=data is None or opts.byte_tokens)
    policy, pinned = _run_policy(opts, source, files, adapter_lora)
    opts, batches = _batches(opts, data, tokenizer, policy, say)
    machine = _machine(opts, spec, policy, profiles, say)
    evaluating = bool(opts.eval_data or opts.eval_fraction)
    eval_every = (opts.eval_every or max(1, opts.steps // 10)) if evaluating else 0
    iterations = window_steps(0, iterations=WINDOW_ITERATIONS, steps=opts.steps,
                              every=(opts.checkpoint_every, opts.save_every, eval_every))
    say("compiling and simulating the schedule")
    policy, compiled, (schedule, prediction), spread_note = _schedule(opts, spec, policy, pinned, machine, iterations)
    note = "\n".join(n for n in (machine.note, spread_note) if n is not None) or None
    job = _job(opts, spec, policy, schedule, machine, data=data, eval_every=eval_every, files=files, guard=guard)
    return RunPlan(job=job, world=opts.gpus, policy=policy, spec=spec, hardware=machine.hardware, trace=machine.trace,
                   schedule=schedule, prediction=prediction, batch_tokens=opts.batch_tokens, addition_task=data is None,
                   note=note, compiled_policy=compiled, calibration=machine.calibration, data_lines=batches.lines())


def _run_policy(opts: RunOptions, source: ModelSource, files: LoraFiles, adapter_lora: LoraSpec | None
                ) -> tuple[Policy, Policy]:
    """The run's policy with the microbatch count of --batch-tokens, and what the schedule is compiled from: the
    same, with a resumed run's packs pinned on its ranks (the packer's choice may depend on rates measured now)."""
    policy = _policy(opts, adapter_lora)
    check_lora_policy(policy, opts.policy)
    if opts.record and opts.policy is None and isinstance(opts.record.get("policy"), dict):
        policy = Policy.from_json(opts.record["policy"], where=f"{opts.out}: the checkpoint's policy")
    check_lora_libraries(policy.lora)
    if policy.lora is not None and source.spec.is_moe:  # InputError for what peft refuses on a MoE model's experts
        expert_ranks(policy.lora)
    if files.adapter is not None and policy.lora is not None:  # an adapter made for another base is refused here
        check_adapter(files.adapter, source.spec, hf_name_maps(source.config), policy.lora, opts.model)
    packs = opts.record.get("pack_sizes") if opts.record else None
    pinned = policy if packs is None or opts.record is None else policy.replace(
        packing=tuple(packs), mapping=tuple(opts.record["pack_gpu"]))
    tokens_per_mb = policy.microbatch_size * opts.seq_len
    if opts.batch_tokens % tokens_per_mb:
        raise InputError(f"--batch-tokens {opts.batch_tokens}: not a multiple of the microbatch "
                         f"({policy.microbatch_size} sequences x {opts.seq_len} tokens = {tokens_per_mb})")
    policy = policy.replace(microbatches=opts.batch_tokens // tokens_per_mb)
    return policy, pinned.replace(microbatches=policy.microbatches)


def _batches(opts: RunOptions, data: str | None, tokenizer: Tokenizer, policy: Policy, say: Callable[[str], None]
             ) -> tuple[RunOptions, Batches]:
    """The training data as the run's steps (the options with --epochs' step count), the held-out data and the
    first step checked."""
    from ..data.batches import make_batches
    from ..data.examples import PackedSequences
    from ..rank.interpreter import ExecutionError
    from ..rank.worker import step_data

    if data is not None:
        say(f"reading and tokenizing {data}")
    batches = make_batches(data, tokenizer=tokenizer, seq_len=opts.seq_len, microbatch_size=policy.microbatch_size,
                           microbatches=policy.microbatches, seed=opts.seed, packing=opts.packing,
                           hold_out=0.0 if opts.eval_data else (opts.eval_fraction or 0.0), split=opts.data_split,
                           config=opts.data_config)
    if opts.epochs is not None and not opts.resume and isinstance(batches.source, PackedSequences):
        opts = dataclasses.replace(opts, steps=max(1, math.ceil(opts.epochs * len(batches.source)
                                                                * opts.seq_len / opts.batch_tokens)))
    if opts.eval_data or opts.eval_fraction:
        check_eval(opts, batches, tokenizer)
    first = int(opts.record["step"]) if opts.record else 0
    try:
        step_data(batches, first)
    except ExecutionError as exc:
        raise InputError(f"--seq-len {opts.seq_len}: {exc}; give longer sequences") from None
    return opts, batches


@dataclass(frozen=True)
class _Machine:
    """Where the run happens and what it plans with: the hardware (calibrated), the compute dtype, the GPU cap,
    whether blocks compile, the trace, a note on the traces, and the calibration's line."""

    hardware: Hardware
    dtype: str
    gpu_mem: int | None
    compile_blocks: bool
    trace: ProfileTrace
    note: str | None
    calibration: str | None


def _machine(opts: RunOptions, spec: ModelSpec, policy: Policy, profiles: tuple[ProfileTrace, ...],
             say: Callable[[str], None]) -> _Machine:
    """The devices (CUDA's preset, or this CPU measured as stand-in GPUs), calibrated to this host, and the trace."""
    threads = max(1, (os.cpu_count() or 1) // opts.gpus)
    gpu_mem = gpu_mem_bytes(opts.gpu_mem) if opts.gpu_mem else None
    if gpu_mem is not None and opts.backend != "cuda":
        raise InputError("--gpu-mem: only with --backend cuda (CPU workers have no device memory to cap)")
    if opts.backend == "cuda":
        hardware = cuda_hardware(opts.gpus, opts.hardware)
        dtype = opts.dtype or "bf16"
        if gpu_mem is not None and gpu_mem > min(g.memory_bytes for g in hardware.gpus):
            raise InputError(f"--gpu-mem {opts.gpu_mem}: more than the {gib(hardware.gpus[0].memory_bytes)} "
                             f"of {hardware.gpus[0].model}")
    else:
        say(f"measuring this CPU as {opts.gpus} worker(s)")
        hardware = cpu_hardware(opts.gpus, threads=threads)
        dtype = opts.dtype or "fp32"
    if len(hardware.gpus) > opts.gpus:
        hardware = first_gpus(hardware, opts.gpus)
    compile_blocks = opts.backend == "cuda" if opts.compile is None else opts.compile
    lora = lora_text(policy.lora)
    asked = trace_for(spec, hardware.gpus[0], policy.microbatch_size, opts.seq_len, dtype, profiles=profiles,
                      compiled=compile_blocks, lora=lora)
    note = unmatched_note(profiles, asked, spec, compiled=compile_blocks)
    hardware, planning, calibration = calibrate_run(
        opts.calibrate or "auto", opts.backend, hardware, profiles, say=say, dtype=dtype,
        threads=rank_threads(opts.backend, opts.gpus, os.cpu_count() or 1))
    trace = trace_for(spec, hardware.gpus[0], policy.microbatch_size, opts.seq_len, dtype, profiles=planning,
                      compiled=compile_blocks, lora=lora)
    return _Machine(hardware, dtype, gpu_mem, compile_blocks, trace, note, calibration)


def _schedule(opts: RunOptions, spec: ModelSpec, policy: Policy, pinned: Policy, m: _Machine, iterations: int
              ) -> tuple[Policy, Policy, tuple[Schedule, SimResult], str | None]:
    """The compiled schedule and its prediction, checked against the host's and the GPUs' memory; a policy that
    leaves a GPU without a pack gives way, in the default job, to one that spreads its layers (with a note).
    Returns the policy, what the schedule was compiled from, the schedule and prediction, and that note."""
    hardware, trace, gpu_mem = m.hardware, m.trace, m.gpu_mem
    clip = opts.max_grad_norm is not None
    schedule, prediction = _compile(pinned, spec, hardware, trace, iterations, gpu_mem, grad_clip=clip)
    check_host_fits(pinned, prediction.peak_host_bytes, run_host_limit(hardware, opts.host_mem),
                    lambda p: _host_peak(p, spec, hardware, trace, iterations, gpu_mem, grad_clip=clip))
    if not prediction.fits:
        cap = "" if gpu_mem is None else f" with --gpu-mem {gib(gpu_mem)}"
        slack = hardware.gpus[0].allocator_slack_bytes
        kept = f" ({gib(slack)} of each GPU's room is kept for PyTorch's allocator)" if slack else ""
        raise InputError(f"policy {policy.name!r} does not fit {spec.name} on {hardware.name}{cap}: "
                         f"{prediction.violation}{kept}")
    used = sorted(set(schedule.pack_gpu))
    if used == list(range(opts.gpus)):
        return policy, pinned, (schedule, prediction), None
    spread = _on_every_gpu(policy, spec, hardware, trace, iterations, grad_clip=clip)
    why = (f"policy {policy.name!r} puts packs on GPUs {used}, but the run has --gpus {opts.gpus}: every GPU "
           "needs at least one pack" + (f" ({spec.name} ties its LM head to its token embedding, so the head's "
                                        "pack runs on the first pack's GPU)" if spec.tied_embeddings else ""))
    if spread is None:
        raise InputError(f"{why}; no policy with more packs fits either: try fewer --gpus")
    if opts.policy is not None or (opts.record.get("pack_sizes") if opts.record else None) is not None:
        change = {"packing": spread[0].packing, "num_packs": spread[0].num_packs, "mapping": spread[0].mapping}
        raise InputError(f"{why}; with {json.dumps(change)} in the policy it runs here")  # the user's choice
    policy = spread[0]  # the default job: take the spread-out variant
    return policy, policy, spread[1], (f"note: the {policy.name} policy leaves a GPU without a pack here, so its "
                                       f"{len(spec.layers)} layers run in {policy.num_packs} balanced packs dealt "
                                       "round-robin")


def _job(opts: RunOptions, spec: ModelSpec, policy: Policy, schedule: Schedule, m: _Machine, *, data: str | None,
         eval_every: int, files: LoraFiles, guard: GuardSettings) -> Job:
    """What the workers execute; the disk checked for the run's outputs, a resumed run's checkpoint for its
    identity."""
    from ..options.frugal import check_disk
    from ..options.settings import record

    lr = default_lr(spec.params) if opts.lr is None else opts.lr
    warm = warmup_steps(opts.steps, steps=opts.warmup_steps, ratio=opts.warmup_ratio)
    out = opts.out
    identity = {"model": opts.model, "data": opts.data, "seed": opts.seed, "seq_len": opts.seq_len,
                "batch_tokens": opts.batch_tokens, "gpus": opts.gpus, "policy": policy.to_json(),
                "lr": lr, "betas": list(opts.betas), "eps": opts.eps, "weight_decay": opts.weight_decay,
                "dtype": m.dtype, "pack_sizes": [len(p) for p in schedule.pack_layers],
                "pack_gpu": list(schedule.pack_gpu)}
    save_dtype = opts.save_dtype or model_dtype(opts.model)
    check_disk(out, spec, schedule, keep=opts.keep_checkpoints, checkpoints=True, save_dtype=save_dtype,
               save_model=opts.save or bool(opts.save_every), merge=opts.merge,
               model_copies=1 + (opts.steps // opts.save_every if opts.save_every else 0))
    if opts.resume:  # the same checks the workers make, before any of them starts
        from ..save import checkpoint

        found = checkpoint.find(out)
        assert found is not None  # settle read it
        checkpoint.read_meta(found, identity)
    return Job(model=opts.model, schedule=schedule, steps=opts.steps, seq_len=opts.seq_len,
               microbatch_size=policy.microbatch_size, data=data, data_split=opts.data_split,
               data_config=opts.data_config, seed=opts.seed,
               byte_tokens=opts.byte_tokens, packing=opts.packing, save_every=opts.save_every, grad_norm=opts.grad_norm,
               max_grad_norm=opts.max_grad_norm, eval_data=opts.eval_data, eval_fraction=opts.eval_fraction or 0.0,
               eval_every=eval_every, report_to=opts.report_to,
               save_dtype=save_dtype, save_model=opts.save,
               optim=AdamWConfig(lr=lr, betas=opts.betas, eps=opts.eps, weight_decay=opts.weight_decay,
                                 schedule=lr_schedule(lr, opts.lr_schedule, opts.lr_schedule_kwargs, warm, opts.steps),
                                 decay_exempt=not opts.decay_all),
               backend=opts.backend, out=out,
               checkpoint_every=opts.checkpoint_every, checkpoint_s=60.0 * opts.checkpoint_minutes,
               resume=opts.resume, identity=identity, record=record(opts), gpu_mem_bytes=m.gpu_mem,
               keep_checkpoints=opts.keep_checkpoints,
               threads=rank_threads(opts.backend, opts.gpus, os.cpu_count() or 1),
               compile_blocks=m.compile_blocks, trace_memory=opts.trace_memory, lora_files=files, rss_guard=guard)


def _compile(policy: Policy, spec: ModelSpec, hardware: Hardware, trace: ProfileTrace,
             iterations: int, gpu_mem: int | None = None, *, grad_clip: bool = False) -> tuple[Schedule, SimResult]:
    schedule, result = simulate_policy(policy, spec, hardware, trace, iterations=iterations, gpu_mem_bytes=gpu_mem,
                                       grad_clip=grad_clip)
    return schedule, result


def _host_peak(policy: Policy, spec: ModelSpec, hardware: Hardware, trace: ProfileTrace, iterations: int,
               gpu_mem: int | None, *, grad_clip: bool = False) -> int | None:
    """`policy`'s predicted host peak, None when it does not compile here."""
    try:
        return int(_compile(policy, spec, hardware, trace, iterations, gpu_mem, grad_clip=grad_clip)[1].peak_host_bytes)
    except InputError:
        return None


def _on_every_gpu(policy: Policy, spec: ModelSpec, hardware: Hardware, trace: ProfileTrace,
                  iterations: int, *, grad_clip: bool = False) -> tuple[Policy, tuple[Schedule, SimResult]] | None:
    """`policy` with its layers in more, balanced packs dealt round-robin, the fewest packs that put
    at least one on every GPU and fit; None when none does. (A tied model's head shares the first
    pack's GPU, so it needs a pack more than there are GPUs.)"""
    gpus = len(hardware.gpus)
    for k in range(gpus + (1 if spec.tied_embeddings else 0), len(spec.layers) + 1):
        cand = policy.replace(packing="balanced", num_packs=k, mapping="round-robin")
        try:
            schedule, prediction = _compile(cand, spec, hardware, trace, iterations, grad_clip=grad_clip)
        except InputError:
            continue
        if prediction.fits and sorted(set(schedule.pack_gpu)) == list(range(gpus)):
            return cand, (schedule, prediction)
    return None


SAVE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def model_dtype(model: str) -> str:
    """The dtype a model's config gives its weights (`torch_dtype`, or `dtype` in transformers 5), as
    --save-dtype names it; fp32 when the config gives none or one tinypipe does not save in."""
    from tinypipe.describe.hfconfig import load_config

    raw = load_config(model)
    given = raw.get("torch_dtype") or raw.get("dtype")
    return SAVE_DTYPES.get(str(given), "fp32")


def _policy(opts: RunOptions, adapter_lora: LoraSpec | None = None) -> Policy:
    """--policy (default: the embedded job's preset and microbatch size), --microbatch-size over it; LoRA from
    --lora, else from the adapter directory `--model` names (`adapter_lora`)."""
    policy = load_policy(opts.policy or DEFAULT_POLICY)
    size = opts.microbatch_size
    if size is None and not opts.policy:
        size = DEFAULT_MICROBATCH_SIZE
    if size is not None:
        if size < 1:
            raise InputError(f"--microbatch-size: must be >= 1, got {size}")
        policy = policy.replace(microbatch_size=size)
    if opts.optimizer_state is not None:
        policy = policy.replace(optimizer_state=opts.optimizer_state)
    if adapter_lora is not None and opts.lora is None and opts.load_in_4bit:  # an adapter continued on a 4-bit base
        adapter_lora, opts = dataclasses.replace(adapter_lora, nf4=True), dataclasses.replace(opts, load_in_4bit=False)
    lora = opts.lora_spec() or adapter_lora
    if lora is not None:
        if lora.dropout > 0 and policy.recompute:
            raise InputError(f"--lora-dropout {lora.dropout:g}: needs a policy without recompute (a recomputed "
                             "forward would draw other dropout masks than the one its input came from)")
        policy = policy.replace(lora=lora)
    return policy
