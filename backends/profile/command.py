"""`tinypipe profile`: check the options, measure layers and rates on this device, write the JSON files.

Files written into `--out DIR` (made if missing; files of the same names are replaced):
- one trace per microbatch size, `<gpu>-<model>-mb<N>-seq<S>[-<dtype>].json` (the dtype suffix
  unless bf16), the `ProfileTrace` form `tinypipe.describe.trace.load_trace` reads; `simulate`, `search`
  and `run` take it with `--profile DIR`. Unless `--no-optimizer`, each kind carries its host
  optimizer step (optim.py: measured once, beside the largest microbatch's device work, the same
  in every trace; with `--optimizer-phases`, also beside a loop of the block's FWDs only and
  one of its BWDs only, and the async step alone: `OptimizerProfile.phases_s`); unless `--no-loop`,
  the block carries its recomputing FWD and BWD timed inside the executor's loop, alone and beside a
  stepping host optimizer (looptimes.py: per microbatch size);
- `rates.json`: the `HostRates` (copy rates, fixed cost, optimizer rates; fields documented inside);
- `hardware.json`: a full hardware description (`--hardware FILE` accepts it), the base preset
  with the measured rates (`HostRates.hardware`). The base is `--hardware`, else on CUDA the
  shipped preset of the local GPU model with the fewest GPUs; on a CPU only with `--hardware`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from tinypipe.common.errors import InputError
from tinypipe.common.outputs import check_dir
from tinypipe.common.progress import Progress
from tinypipe.describe.hardware import Hardware, load_hardware, shipped_hardware
from tinypipe.describe.looptimes import LoopTimes
from tinypipe.describe.optimprofile import OptimizerProfile
from tinypipe.describe.trace import ProfileTrace
from tinypipe.policy.lora_spec import LoraSpec
from tinypipe.policy.modes import HostMemory

from ..options.settings import SEED_LIMIT, rank_threads
from ..rank.cpustat import NOTABLE_STEAL
from ..rank.hostwork import host_settings
from .devloop import DeviceLoop
from .measure_layers import KindMeasurement, LayerBench, profile_trace
from .measure_loop import describe as describe_loop
from .measure_loop import has_block, time_loop, with_loop
from .optim import describe, measure_optimizer, quiet
from .profile_flags import ProfileOptions
from .rates import HostRates, measure_rates

RATES_FILE, HARDWARE_FILE = "rates.json", "hardware.json"
KINDS = ("embed", "block", "head")


def trace_file(trace: ProfileTrace) -> str:
    """`h200-llama-3.1-8b-mb1-seq2048.json` (the shipped traces' names), `-<dtype>` added unless bf16,
    `-compiled` for compiled blocks, `-lora-<adapters>` for a frozen base with LoRA adapters."""
    def slug(text: str) -> str:
        return re.sub(r"[^a-z0-9.]+", "-", text.casefold()).strip("-")

    dtype = "" if trace.dtype == "bf16" else f"-{trace.dtype}"
    compiled = "-compiled" if trace.compiled else ""
    lora = f"-lora-{slug(trace.lora)}" if trace.lora else ""
    return (f"{slug(trace.gpu_model)}-{slug(trace.model)}-mb{trace.microbatch_size}-seq{trace.seq_len}{dtype}"
            f"{compiled}{lora}.json")


def lora_flags(text: str) -> str:
    """The `--lora` flags that ask for the adapters `text` (`LoraSpec.text()`) names."""
    spec = LoraSpec.parse(text, "trace: lora")
    return (f"--lora {spec.rank} --lora-alpha {spec.alpha:g} --lora-dropout {spec.dropout:g} "
            f"--lora-targets {','.join(spec.targets)}")


def device_name(device: torch.device) -> str:
    """What the trace was measured on, for people: the GPU's name, or the CPU's model and core count."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device}), torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"CPU {cpu} ({os.cpu_count()} cores), torch {torch.__version__}"


def gpu_model_and_base(device: torch.device, hardware: str | None) -> tuple[str, Hardware | None]:
    """The trace's `gpu_model` as the hardware presets spell it, and the base preset for hardware.json.

    CUDA: `--hardware`'s GPU model when given, else the first shipped preset whose GPU model the device
    name contains (`plan.cuda_hardware`'s rule), else the device name itself. CPU: "CPU", as
    `plan.cpu_hardware` names its stand-in GPUs."""
    base = load_hardware(hardware) if hardware else None
    if device.type != "cuda":
        return "CPU", base
    name = torch.cuda.get_device_name(device)
    if base is not None:
        return base.gpus[0].model, base
    matches = [load_hardware(p) for p in shipped_hardware()]
    matches = [h for h in matches if h.gpus[0].model.casefold() in name.casefold()]
    if not matches:
        return name, None
    best = min(matches, key=lambda h: len(h.gpus))
    return best.gpus[0].model, best


def _check(opts: ProfileOptions) -> None:
    for flag in ("seq_len", "repeat", "threads", "optimizer_rounds"):
        v = getattr(opts, flag)
        if v is not None and v < 1:
            raise InputError(f"--{flag.replace('_', '-')}: must be >= 1, got {v}")
    for flag, most in (("repeat", 10_000), ("warmup", 10_000), ("threads", 4096), ("optimizer_rounds", 100),
                       ("seq_len", 1 << 20)):
        v = getattr(opts, flag)
        if v is not None and v > most:
            raise InputError(f"--{flag.replace('_', '-')}: at most {most:,}, got {v}")
    for flag in ("warmup", "seed"):
        if getattr(opts, flag) < 0:
            raise InputError(f"--{flag}: must be >= 0, got {getattr(opts, flag)}")
    if opts.seed >= SEED_LIMIT:
        raise InputError(f"--seed: must be < 2**63, got {opts.seed}")
    bad = [s for s in opts.microbatch_size if s < 1]
    if bad:
        raise InputError(f"--microbatch-size: every size must be >= 1, got {bad[0]}")
    huge = [s for s in opts.microbatch_size if s > 65536]
    if huge:
        raise InputError(f"--microbatch-size: at most 65,536, got {huge[0]}")
    check_dir(Path(opts.out), "--out")
    if opts.backend == "cuda" and not torch.cuda.is_available():
        raise InputError("--backend cuda: no CUDA device is available (torch.cuda.is_available() is false); "
                         "use --backend cpu")


def profile_main(opts: ProfileOptions) -> int:
    """The `tinypipe profile` command (options: tinypipe.cli); returns the exit code."""
    with host_settings():  # the GIL switch interval a run has (the threads are set per measurement)
        return _profile(opts)


def _profile(opts: ProfileOptions) -> int:
    from ..model.hf import load_source

    _check(opts)
    lora = opts.lora
    spec = load_source(opts.model).spec  # an unknown or untrainable model is an InputError, before any work
    if opts.seq_len > spec.max_seq_len:
        raise InputError(f"--seq-len {opts.seq_len}: {spec.name} handles at most {spec.max_seq_len} positions")
    device = torch.device("cuda", torch.cuda.current_device()) if opts.backend == "cuda" else torch.device("cpu")
    dtype = opts.dtype or ("bf16" if device.type == "cuda" else "fp32")
    compile_blocks = device.type == "cuda" if opts.compile is None else opts.compile
    threads = opts.threads or os.cpu_count() or 1
    gpu_model, base = gpu_model_and_base(device, opts.hardware)
    if device.type == "cuda" and gpu_model.casefold() not in torch.cuda.get_device_name(device).casefold():
        print(f"note: the traces are named for {gpu_model!r} (--hardware), measured on "
              f"{torch.cuda.get_device_name(device)!r}", file=sys.stderr)
    out = Path(opts.out)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    on = device_name(device) + (f", {threads} thread(s)" if device.type == "cpu" else "")
    bar = None if opts.json else Progress("profile")

    def say(text: str) -> None:
        if bar is not None:
            bar.phase(text)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        say(f"building {spec.name} (embedding, one block, head) on {device}")
        bench = LayerBench(opts.model, device=device, dtype=dtype, seed=opts.seed, compile_blocks=compile_blocks,
                           lora=lora)
        sizes = sorted(set(opts.microbatch_size))
        measured: dict[int, list[KindMeasurement]] = {}
        for size in sizes:
            measured[size] = []
            for kind in KINDS:
                say(f"timing the {kind} at {size} x {opts.seq_len} tokens ({opts.warmup} + {opts.repeat} runs)")
                measured[size].append(bench.measure(kind, microbatch_size=size, seq_len=opts.seq_len,
                                                    repeat=opts.repeat, warmup=opts.warmup, seed=opts.seed))
        opt_threads = opts.threads or rank_threads(device.type, 1, os.cpu_count() or 1)
        optimizer, opt_note, loops = _host_step_and_loops(opts, bench, sizes, device, opt_threads, say)
        traces = [profile_trace(measured[size], bench.spec, gpu_model=gpu_model, dtype=dtype, microbatch_size=size,
                                seq_len=opts.seq_len, repeat=opts.repeat, warmup=opts.warmup, on=on, when=when,
                                compiled=compile_blocks, optimizer=optimizer, optimizer_source=opt_note, lora=lora)
                  for size in sizes]
        traces = [with_loop(t, *loops[t.microbatch_size]) if t.microbatch_size in loops else t for t in traces]
        del bench
        rates = None
        if not opts.no_rates:
            say(f"measuring copies and the host optimizer on {threads} thread(s)")
            rates = measure_rates(device, threads=threads, compute_dtype=dtype, repeat=min(opts.repeat, 5), when=when)
    finally:
        torch.set_num_threads(before)
        if bar is not None:
            bar.close()
    written = _write(out, traces, rates, base)
    if opts.json:
        print(json.dumps({"written": [str(p) for p in written], "traces": [t.to_json() for t in traces],
                          "rates": rates.to_json() if rates else None}, indent=2))
        return 0
    print(_report(spec.name, gpu_model, on, traces, rates, written, base))
    return 0


def _host_step_and_loops(opts: ProfileOptions, bench: LayerBench, sizes: list[int], device: torch.device,
                         opt_threads: int, say: Callable[[str], None]
                         ) -> tuple[dict[str, OptimizerProfile] | None, str, dict[int, tuple[LoopTimes, str]]]:
    """Each layer kind's host optimizer step (with how it was timed) and the block's loop times per microbatch
    size, as the options ask (none for a frozen base: it has no host step)."""
    optimizer, opt_note = None, ""
    loops: dict[int, tuple[LoopTimes, str]] = {}
    largest = None  # the optimizer's device loop (the largest microbatch size), reused for its loop times
    # The optimizer first: in an H200 profile that timed the compiled block's loop before it,
    # every later step of that process ran 1.3-2.6x slower even with nothing else
    # running (a 50 M compact step 80 ms alone, against 30 ms in the eager profile minutes earlier
    # and 26 ms in a compiled one without the loop); the cause is not known.
    if not opts.no_optimizer and opts.lora is None:  # once, beside the largest microbatch's device work, for all
        largest = DeviceLoop(bench, microbatch_size=sizes[-1], seq_len=opts.seq_len, seed=opts.seed)
        phases = None if not opts.optimizer_phases else {
            only: DeviceLoop(bench, microbatch_size=sizes[-1], seq_len=opts.seq_len, seed=opts.seed, only=only)
            for only in ("fwd", "bwd")}
        rounds = opts.optimizer_rounds or (3 if device.type == "cuda" else 1)
        optimizer, steps, steal = measure_optimizer(bench, largest, threads=opt_threads,
                                                    max_steps=min(opts.repeat, 5), rounds=rounds, say=say,
                                                    phases=phases)
        opt_note = describe(opt_threads, steps, largest, phases) + "; " + steal_note(steal)
        del phases
    if not opts.no_loop and opts.lora is None and has_block(bench):
        for size in sizes:
            say(f"timing the block inside the executor's loop at {size} x {opts.seq_len} tokens, alone and "
                f"beside a stepping host optimizer ({opt_threads} thread(s))")
            loop = (largest if largest is not None and size == sizes[-1] else
                    DeviceLoop(bench, microbatch_size=size, seq_len=opts.seq_len, seed=opts.seed))
            loops[size] = _loop_times(bench, loop, threads=opt_threads, max_windows=opts.repeat)
        del loop
    return optimizer, opt_note, loops


def _loop_times(bench: LayerBench, loop: DeviceLoop, *, threads: int, max_windows: int) -> tuple[LoopTimes, str]:
    """The block's loop times on `loop` at `threads` torch threads (one rank's), and how they were taken."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        samples = time_loop(bench, loop, max_windows=max_windows)
    finally:
        torch.set_num_threads(before)
    return samples.times(), describe_loop(samples, loop, threads)


def _write(out: Path, traces: list[ProfileTrace], rates: HostRates | None, base: Hardware | None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files: list[tuple[Path, Any]] = [(out / trace_file(t), t.to_json()) for t in traces]
    if rates is not None:
        files.append((out / RATES_FILE, rates.to_json()))
        if base is not None:
            files.append((out / HARDWARE_FILE, rates.hardware(base).to_json()))
    for path, obj in files:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
            tmp.replace(path)
        except OSError as exc:
            raise InputError(f"{path}: cannot write: {exc.strerror or exc}") from None
    return [p for p, _ in files]


STEAL_NOTE = "host CPU time taken by the hypervisor while the steps were timed"


def steal_note(steal: list[float | None]) -> str:
    """The rounds' stolen CPU shares, for the traces' optimizer source and the report."""
    note = f"{STEAL_NOTE} (by round): " + ", ".join("unknown" if x is None else f"{100 * x:.1f}%" for x in steal)
    noisy = sum(not quiet(x) for x in steal)
    if not noisy:
        return note
    if noisy < len(steal):
        return note + f"; the rounds above {NOTABLE_STEAL:.0%} were taken again and left out of the medians"
    return note + (f" (steps timed while it took more than {NOTABLE_STEAL:.0%} ran up to 2x slow on H200, and no "
                   "round was below it: profile again)")


def _report(model: str, gpu_model: str, on: str, traces: list[ProfileTrace], rates: HostRates | None,
            written: list[Path], base: Hardware | None) -> str:
    from tinypipe.common import table

    lines = [f"{model} on {on} (traces name the GPU model {gpu_model!r})", ""]
    rows = [[t.microbatch_size, k, p.fwd_s * 1e3, p.bwd_s * 1e3, p.recompute_bwd_s * 1e3,
             table.human_bytes(p.saved_act_bytes), table.human_bytes(p.workspace_bytes)]
            for t in traces for k, p in t.kinds.items()]
    lines.append(table.render(["mb size", "kind", "fwd ms", "bwd ms", "recompute+bwd ms", "saved", "workspace"],
                              rows, align="rlrrrrr"))
    if traces and "NOT measured" in traces[0].source:
        lines.append("workspace: not measured on a CPU (no allocator peak); analytic, and the traces say so")
    rows = [[t.microbatch_size, o.fwd_s * 1e3, o.recompute_bwd_s * 1e3, o.fwd_beside_optimizer_s * 1e3,
             o.recompute_bwd_beside_optimizer_s * 1e3,
             " / ".join(f"{g * 1e6:.0f}" for g in (o.fwd_gap_s, o.recompute_bwd_gap_s, o.fwd_gap_beside_optimizer_s,
                                                    o.recompute_bwd_gap_beside_optimizer_s)),
             " / ".join(f"{g * 1e3:.2f}" for g in (o.fwd_issue_s, o.recompute_bwd_issue_s,
                                                    o.fwd_issue_beside_optimizer_s,
                                                    o.recompute_bwd_issue_beside_optimizer_s))]
            for t in traces if (o := t.kinds["block"].loop) is not None]
    if rows:
        lines += ["", "the block inside the executor's loop (what the simulator charges a recomputed block: beside "
                      "the optimizer while an OPT_STEP runs; the issue gap before a back-to-back FWD / BWD, alone "
                      "and beside; the main thread's time issuing each)",
                  table.render(["mb size", "fwd ms", "recompute+bwd ms", "fwd beside opt ms",
                                "recompute+bwd beside opt ms", "issue gap us (fwd / bwd / beside)",
                                "issue ms (fwd / bwd / beside)"], rows, align="rrrrrrr")]
    opt = {k: p.optimizer for k, p in traces[0].kinds.items() if p.optimizer is not None} if traces else {}
    if opt:
        threads = next(iter(opt.values())).threads
        rows = [[k, f"{o.params:,}", lay, o.alone_s[lay] * 1e3, o.in_run_s[lay] * 1e3,
                 o.async_in_run_s[lay] * 1e3 if lay in o.async_in_run_s else "-", o.params / o.in_run_s[lay] / 1e9]
                for k, o in opt.items() for lay in o.in_run_s]
        lines += ["", f"host optimizer step per layer kind ({threads} thread(s); in the run: beside the device's work, "
                      "what the simulator charges; async: the step that keeps the previous version)",
                  table.render(["kind", "params", "layout", "alone ms", "in run ms", "async in run ms",
                                "in run G params/s"], rows, align="lrlrrrr")]
        rows = [[k, lay, *(t * 1e3 for t in sync), *(t * 1e3 for t in asy)]
                for k, o in opt.items() for lay in o.in_run_s
                if (sync := o.phases_s(lay, o.params)) is not None
                and (asy := o.phases_s(lay, o.params, asynchronous=True)) is not None]
        if rows:
            lines += ["", "the step by what the rank's compute stream runs (what the simulator charges where "
                          "measured): waiting (alone), beside FWDs, beside BWDs",
                      table.render(["kind", "layout", "alone ms", "beside FWD ms", "beside BWD ms", "async alone ms",
                                    "async beside FWD ms", "async beside BWD ms"], rows, align="llrrrrrr")]
        if STEAL_NOTE in traces[0].source:
            lines.append(traces[0].source[traces[0].source.index(STEAL_NOTE):])
    if rates is not None:
        f = rates.factors()
        lines += ["", f"copies ({rates.device}): H2D {rates.h2d_gbps:.1f} GB/s, D2H {rates.d2h_gbps:.1f} GB/s, both at "
                      f"once {rates.bidir_gbps:.1f} GB/s, fixed cost {rates.copy_latency_s * 1e6:.1f} us",
                  f"host optimizer ({rates.threads} thread(s)): fused AdamW {rates.adam_params_per_s / 1e6:,.0f} M "
                  f"params/s; replicated step {f[HostMemory.REPLICATED]:.2f} x, compact step "
                  f"{f[HostMemory.COMPACT]:.2f} x its time"]
        if base is None:
            lines.append("no hardware.json: give --hardware NAME|FILE as the base preset the rates go into")
    lines += ["", *(f"wrote {p}" for p in written)]
    t, folder = traces[0], written[0].parent
    hw = f" --hardware {folder / HARDWARE_FILE}" if any(p.name == HARDWARE_FILE for p in written) else " --hardware H"
    lines.append(f"use: tinypipe simulate --model {model} --profile {folder}{hw} --seq-len {t.seq_len} "
                 f"--microbatch-size {t.microbatch_size}" + ("" if t.dtype == "bf16" else f" --dtype {t.dtype}")
                 + (f" {lora_flags(t.lora)}" if t.lora else "")
                 + f" (a trace is used where the hardware's GPU model is {gpu_model!r}"
                 + (", as `run --backend cpu` describes this CPU)" if gpu_model == "CPU" else ")"))
    return "\n".join(lines)
