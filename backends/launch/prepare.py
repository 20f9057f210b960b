"""What a run needs before any worker starts: its inputs checked, the machine it runs on, the schedule.

Every user mistake found here is an `InputError` (one line, exit code 2) raised before a process is
spawned: a model that cannot be found or trained, a data file that is not JSONL, a policy that
does not fit the model or the devices (the compiler's checks, then the simulator's memory ledgers
at the devices' capacities), more devices than exist, batch sizes that do not divide.

The schedule is compiled for a `Hardware` describing where the run happens. On CUDA that is the
shipped preset of the GPU model when one matches, else a description of the local GPUs; on the
CPU backend, N worker processes stand in for GPUs and `cpu_hardware` describes them with rates
measured in a fraction of a second (GEMM rate, copy bandwidth, AdamW rate): the simulator's
prediction printed beside the measurement is made with it and an analytic trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tinypipe.common.errors import InputError
from tinypipe.common.table import gib
from tinypipe.common.units import MIB, parse_bytes
from tinypipe.compiler import WINDOW_ITERATIONS, window_steps
from tinypipe.describe.hardware import GPU, HOST, Hardware, Host, Link, load_hardware, shipped_hardware
from tinypipe.describe.model import ModelSpec
from tinypipe.describe.trace import ProfileTrace, load_profiles, trace_for, unmatched_note
from tinypipe.ir.schedule import Schedule
from tinypipe.policy import Policy, load_policy
from tinypipe.policy.lora_spec import LoraSpec, lora_from_args, lora_text
from tinypipe.sim import SimResult
from tinypipe.sim.guard import simulate_policy

from ..host.optim_rules import default_lr, lr_schedule, warmup_steps
from ..host.state import AdamWConfig
from ..model.hf import ModelSource, hf_name_maps
from ..options.record import RunOptions
from ..options.settings import DEFAULT_MICROBATCH_SIZE, DEFAULT_POLICY, rank_threads
from ..rank.rss_guard import GuardSettings
from ..rank.worker import Job
from ..save.lora_save import check_adapter, lora_files
from .calibrate import calibrate_run
from .hostfit import check_host_fits, run_host_limit
from .inputs import check_checkpoint, check_clip, check_eval

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


def _rate(fn: Callable[[], object], work: float, repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return work / max(best, 1e-9)


def cpu_hardware(workers: int, *, threads: int) -> Hardware:
    """N CPU worker processes as stand-in GPUs, with rates measured here on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(256, 256)
        flops = _rate(lambda: [a @ a for _ in range(8)], 8 * 2 * 256**3)
        src, dst = torch.empty(8 * MIB, dtype=torch.uint8), torch.empty(8 * MIB, dtype=torch.uint8)
        gbps = _rate(lambda: dst.copy_(src), src.numel()) / 1e9
        p = torch.zeros(1 << 18, requires_grad=True)
        p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW([p], fused=True)
        adam = _rate(opt.step, p.numel())
    finally:
        torch.set_num_threads(before)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count() or 1
    return Hardware(
        name=f"cpu-x{workers}", provenance="measured",
        source=f"this host's CPU as {workers} worker processes ({threads} thread(s) each): {flops / 1e9:.1f} GFLOP/s "
               f"(fp32 GEMM 256^3), {gbps:.1f} GB/s copies, {adam / 1e6:.0f} M params/s fused AdamW, measured "
               f"at start-up; all workers share the host's memory",
        host=Host(memory_bytes=mem, dma_gbps=gbps, cpu_cores=cores, adam_params_per_s=adam),
        gpus=tuple(GPU(f"gpu{i}", "CPU", mem, flops, gbps) for i in range(workers)), switches=("rc0",),
        links=(Link(HOST, "rc0", "mem", gbps, 0.0),)
        + tuple(Link("rc0", f"gpu{i}", "pcie", gbps, 2e-6) for i in range(workers)))


def cuda_hardware(gpus: int, name: str | None) -> Hardware:
    """`name` (a preset or file), else the shipped preset of the local GPU model with enough GPUs."""
    if not torch.cuda.is_available():
        raise InputError("--backend cuda: no CUDA device is available (torch.cuda.is_available() is false); "
                         "use --backend cpu")
    have = torch.cuda.device_count()
    if gpus > have:
        raise InputError(f"--gpus {gpus}: only {have} CUDA device{'s' if have != 1 else ''} here")
    hw: Hardware | None = None
    if name is not None:
        hw = load_hardware(name)
    else:
        model = torch.cuda.get_device_name(0)
        for preset in shipped_hardware():
            cand = load_hardware(preset)
            if cand.gpus[0].model.casefold() in model.casefold() and len(cand.gpus) >= gpus:
                if hw is None or len(cand.gpus) < len(hw.gpus):
                    hw = cand
        if hw is None:
            raise InputError(f"no shipped hardware preset describes {model!r}; give --hardware NAME|FILE "
                             f"(presets: {', '.join(shipped_hardware())})")
    if len(hw.gpus) < gpus:
        raise InputError(f"--gpus {gpus}: hardware {hw.name} has only {len(hw.gpus)} GPUs")
    return hw


def _check_model(name: str) -> ModelSource:
    """The model's source, its weights checked (index, shards, every tensor the model needs)."""
    from ..model.hf import load_source
    from .inputs import check_weights

    source = load_source(name)
    d = source.directory
    if d is not None and Path(name).is_dir() and not source.has_weights:
        raise InputError(f"{d}: no model weights (model.safetensors or model.safetensors.index.json); "
                         "give a model directory with safetensors, or a config.json / shipped name to train "
                         "from a seeded random initialisation")
    if d is not None and source.has_weights:
        check_weights(d, [hf for names in hf_name_maps(source.config) for hf in names.values()])
    return source


def make_run_plan(options: RunOptions | argparse.Namespace, *, phase: Callable[[str], None] | None = None
                  ) -> RunPlan:
    """Check the `tinypipe run` options and compile the schedule; InputError on any mistake.
    A Namespace (the parsed command line) is settled first (`settings.settle`). `phase(text)` hears
    what starts next (the CLI shows it as progress)."""
    from ..data.addition import ADDITION
    from ..data.batches import make_batches
    from ..data.examples import PackedSequences
    from ..data.tokenizers import load_tokenizer
    from ..options.settings import record, settle
    from ..rank.interpreter import ExecutionError
    from ..rank.worker import step_data

    args = settle(options)  # defaults or the resumed run's record; numbers and output paths checked
    guard = GuardSettings.from_env()  # the workers' host-memory guard (backends/rank/rss_guard.py)
    if args.backend == "cpu" and args.gpus > MAX_CPU_WORKERS_PER_CORE * (os.cpu_count() or 1):
        raise InputError(f"--gpus {args.gpus}: too many CPU workers for {os.cpu_count()} cores "
                         f"(at most {MAX_CPU_WORKERS_PER_CORE} per core)")
    if args.record is not None:  # --resume: the rank files complete and holding what meta.json says, before any work
        check_checkpoint(args.out, args.record, args.gpus)
    say = phase or (lambda text: None)
    profiles = load_profiles(args.profile)  # measured traces (`tinypipe profile`)
    # `--model` a peft adapter directory: its base model, and its LoraSpec (backends/save/lora_save.py)
    files, base, adapter_lora = lora_files(args)
    args = dataclasses.replace(args, model=base)
    say(f"checking the model {args.model}")
    source = _check_model(args.model)
    spec = source.spec
    if args.seq_len > spec.max_seq_len:
        raise InputError(f"--seq-len {args.seq_len}: {spec.name} handles at most {spec.max_seq_len} positions")
    data = None if args.data is None or (args.data == ADDITION and not Path(ADDITION).exists()) else args.data
    addition = data is None
    tokenizer = load_tokenizer(source.directory, vocab_size=spec.vocab_size, byte_tokens=addition or args.byte_tokens)
    policy = _policy(args, adapter_lora)
    if args.record and args.policy is None and isinstance(args.record.get("policy"), dict):
        policy = Policy.from_json(args.record["policy"], where=f"{args.out}: the checkpoint's policy")
    if files.adapter is not None and policy.lora is not None:  # an adapter made for another base is refused here
        check_adapter(files.adapter, spec, hf_name_maps(source.config), policy.lora, args.model)
    packs = args.record.get("pack_sizes") if args.record else None
    pinned = policy if packs is None or args.record is None else policy.replace(
        packing=tuple(packs), mapping=tuple(args.record["pack_gpu"]))
    tokens_per_mb = policy.microbatch_size * args.seq_len
    if args.batch_tokens % tokens_per_mb:
        raise InputError(f"--batch-tokens {args.batch_tokens}: not a multiple of the microbatch "
                         f"({policy.microbatch_size} sequences x {args.seq_len} tokens = {tokens_per_mb})")
    policy = policy.replace(microbatches=args.batch_tokens // tokens_per_mb)
    if data is not None:
        say(f"reading and tokenizing {data}")
    batches = make_batches(data, tokenizer=tokenizer, seq_len=args.seq_len, microbatch_size=policy.microbatch_size,
                           microbatches=policy.microbatches, seed=args.seed, packing=args.packing,
                           hold_out=0.0 if args.eval_data else (args.eval_fraction or 0.0))
    if args.epochs is not None and not args.resume and isinstance(batches.source, PackedSequences):
        args = dataclasses.replace(args, steps=max(1, math.ceil(args.epochs * len(batches.source)
                                                                * args.seq_len / args.batch_tokens)))
    evaluating = bool(args.eval_data or args.eval_fraction)
    if evaluating:
        check_eval(args, batches, tokenizer)
    first = int(args.record["step"]) if args.record else 0
    try:
        step_data(batches, first)
    except ExecutionError as exc:
        raise InputError(f"--seq-len {args.seq_len}: {exc}; give longer sequences") from None
    # a resumed run keeps its packs on its ranks (the packer's choice may depend on rates measured now)
    pinned = pinned.replace(microbatches=policy.microbatches)
    threads = max(1, (os.cpu_count() or 1) // args.gpus)
    gpu_mem = parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None
    if gpu_mem is not None and args.backend != "cuda":
        raise InputError("--gpu-mem: only with --backend cuda (CPU workers have no device memory to cap)")
    if args.backend == "cuda":
        hardware = cuda_hardware(args.gpus, args.hardware)
        dtype = args.dtype or "bf16"
        if gpu_mem is not None and gpu_mem > min(g.memory_bytes for g in hardware.gpus):
            raise InputError(f"--gpu-mem {args.gpu_mem}: more than the {gib(hardware.gpus[0].memory_bytes)} "
                             f"of {hardware.gpus[0].model}")
    else:
        say(f"measuring this CPU as {args.gpus} worker(s)")
        hardware = cpu_hardware(args.gpus, threads=threads)
        dtype = args.dtype or "fp32"
    if len(hardware.gpus) > args.gpus:
        hardware = _first_gpus(hardware, args.gpus)
    compile_blocks = args.backend == "cuda" if args.compile is None else args.compile
    lora = lora_text(policy.lora)
    asked = trace_for(spec, hardware.gpus[0], policy.microbatch_size, args.seq_len, dtype, profiles=profiles,
                      compiled=compile_blocks, lora=lora)
    note = unmatched_note(profiles, asked, spec, compiled=compile_blocks)
    hardware, planning, calibration = calibrate_run(
        args.calibrate or "auto", args.backend, hardware, profiles, say=say, dtype=dtype,
        threads=rank_threads(args.backend, args.gpus, os.cpu_count() or 1))
    trace = trace_for(spec, hardware.gpus[0], policy.microbatch_size, args.seq_len, dtype, profiles=planning,
                      compiled=compile_blocks, lora=lora)
    eval_every = (args.eval_every or max(1, args.steps // 10)) if evaluating else 0
    iterations = window_steps(0, iterations=WINDOW_ITERATIONS, steps=args.steps,
                              every=(args.checkpoint_every, args.save_every, eval_every))
    say("compiling and simulating the schedule")
    clip = args.max_grad_norm is not None
    if clip:
        check_clip(policy)
    schedule, prediction = _compile(pinned, spec, hardware, trace, iterations, gpu_mem, grad_clip=clip)
    compiled = pinned
    check_host_fits(pinned, prediction.peak_host_bytes, run_host_limit(hardware, args.host_mem),
                    lambda p: _host_peak(p, spec, hardware, trace, iterations, gpu_mem, grad_clip=clip))
    if not prediction.fits:
        cap = "" if gpu_mem is None else f" with --gpu-mem {gib(gpu_mem)}"
        slack = hardware.gpus[0].allocator_slack_bytes
        kept = f" ({gib(slack)} of each GPU's room is kept for PyTorch's allocator)" if slack else ""
        raise InputError(f"policy {policy.name!r} does not fit {spec.name} on {hardware.name}{cap}: "
                         f"{prediction.violation}{kept}")
    used = sorted(set(schedule.pack_gpu))
    if used != list(range(args.gpus)):
        spread = _on_every_gpu(policy, spec, hardware, trace, iterations, grad_clip=clip)
        why = (f"policy {policy.name!r} puts packs on GPUs {used}, but the run has --gpus {args.gpus}: every GPU "
               "needs at least one pack" + (f" ({spec.name} ties its LM head to its token embedding, so the head's "
                                            "pack runs on the first pack's GPU)" if spec.tied_embeddings else ""))
        if spread is None:
            raise InputError(f"{why}; no policy with more packs fits either: try fewer --gpus")
        if args.policy is not None or packs is not None:  # the user's choice: say what works instead
            change = {"packing": spread[0].packing, "num_packs": spread[0].num_packs, "mapping": spread[0].mapping}
            raise InputError(f"{why}; with {json.dumps(change)} in the policy it runs here")
        policy, (schedule, prediction) = spread  # the default job: take the spread-out variant
        compiled = policy
        spread_note = (f"note: the {policy.name} policy leaves a GPU without a pack here, so its {len(spec.layers)} "
                       f"layers run in {policy.num_packs} balanced packs dealt round-robin")
        note = spread_note if note is None else f"{note}\n{spread_note}"
    lr = default_lr(spec.params) if args.lr is None else args.lr
    warm = warmup_steps(args.steps, steps=args.warmup_steps, ratio=args.warmup_ratio)
    out = args.out
    identity = {"model": args.model, "data": args.data, "seed": args.seed, "seq_len": args.seq_len,
                "batch_tokens": args.batch_tokens, "gpus": args.gpus, "policy": policy.to_json(),
                "lr": lr, "betas": list(args.betas), "eps": args.eps, "weight_decay": args.weight_decay,
                "dtype": dtype, "pack_sizes": [len(p) for p in schedule.pack_layers],
                "pack_gpu": list(schedule.pack_gpu)}
    from ..options.frugal import check_disk

    save_dtype = args.save_dtype or model_dtype(args.model)
    check_disk(out, spec, schedule, keep=args.keep_checkpoints, checkpoints=True, save_dtype=save_dtype,
               save_model=args.save or bool(args.save_every), merge=args.merge,
               model_copies=1 + (args.steps // args.save_every if args.save_every else 0))
    if args.resume:  # the same checks the workers make, before any of them starts
        from ..save import checkpoint

        found = checkpoint.find(out)
        assert found is not None  # settle read it
        checkpoint.read_meta(found, identity)
    job = Job(model=args.model, schedule=schedule, steps=args.steps, seq_len=args.seq_len,
              microbatch_size=policy.microbatch_size, data=data, seed=args.seed,
              byte_tokens=args.byte_tokens, packing=args.packing, save_every=args.save_every, grad_norm=args.grad_norm,
              max_grad_norm=args.max_grad_norm, eval_data=args.eval_data, eval_fraction=args.eval_fraction or 0.0,
              eval_every=eval_every,
              save_dtype=save_dtype, save_model=args.save,
              optim=AdamWConfig(lr=lr, betas=args.betas, eps=args.eps, weight_decay=args.weight_decay,
                                schedule=lr_schedule(lr, args.lr_schedule, args.lr_schedule_kwargs, warm, args.steps),
                                decay_exempt=not args.decay_all),
              backend=args.backend, out=out,
              checkpoint_every=args.checkpoint_every, checkpoint_s=60.0 * args.checkpoint_minutes,
              resume=args.resume, identity=identity, record=record(args), gpu_mem_bytes=gpu_mem,
              keep_checkpoints=args.keep_checkpoints,
              threads=rank_threads(args.backend, args.gpus, os.cpu_count() or 1),
              compile_blocks=compile_blocks, trace_memory=args.trace_memory, lora_files=files, rss_guard=guard)
    return RunPlan(job=job, world=args.gpus, policy=policy, spec=spec, hardware=hardware, trace=trace,
                   schedule=schedule, prediction=prediction, batch_tokens=args.batch_tokens, addition_task=addition,
                   note=note, compiled_policy=compiled, calibration=calibration, data_lines=batches.lines())


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


def _policy(args: RunOptions, adapter_lora: LoraSpec | None = None) -> Policy:
    """--policy (default: the embedded job's preset and microbatch size), --microbatch-size over it; LoRA from
    --lora, else from the adapter directory `--model` names (`adapter_lora`)."""
    policy = load_policy(args.policy or DEFAULT_POLICY)
    size = args.microbatch_size
    if size is None and not args.policy:
        size = DEFAULT_MICROBATCH_SIZE
    if size is not None:
        if size < 1:
            raise InputError(f"--microbatch-size: must be >= 1, got {size}")
        policy = policy.replace(microbatch_size=size)
    if getattr(args, "optimizer_state", None) is not None:
        policy = policy.replace(optimizer_state=args.optimizer_state)
    lora = lora_from_args(args) or adapter_lora
    if lora is not None:
        if lora.dropout > 0 and policy.recompute:
            raise InputError(f"--lora-dropout {lora.dropout:g}: needs a policy without recompute (a recomputed "
                             "forward would draw other dropout masks than the one its input came from)")
        policy = policy.replace(lora=lora)
    return policy


def _first_gpus(hw: Hardware, n: int) -> Hardware:
    """`hw` restricted to its first n GPUs (links to the others dropped)."""
    keep = {f"gpu{i}" for i in range(n)}
    links = tuple(x for x in hw.links if not (x.a.startswith("gpu") and x.a not in keep)
                  and not (x.b.startswith("gpu") and x.b not in keep))
    return Hardware(name=f"{hw.name}[:{n}]", provenance=hw.provenance, source=hw.source, host=hw.host,
                    gpus=hw.gpus[:n], switches=hw.switches, links=links, gpu_p2p=hw.gpu_p2p)
