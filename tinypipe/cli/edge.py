"""The command line read into typed records, once: the target, the workload, LoRA, and run's, profile's and replay's
options. The parsed `argparse.Namespace` goes no further than this package; everything below takes these records."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from tinypipe.describe.target import Target, gpu_mem_bytes, host_mem_bytes
from tinypipe.describe.workload import Workload
from tinypipe.policy.lora_spec import LoraSpec, lora_from_flags
from tinypipe.policy.modes import OptimizerState

from .util import LIMITS, at_most, positive

if TYPE_CHECKING:
    from tinypipe.backends.options.record import RunOptions
    from tinypipe.backends.profile.profile_flags import ProfileOptions
    from tinypipe.describe.hardware import Hardware
    from tinypipe.describe.trace import ProfileTrace
    from tinypipe.replay.runner import ReplayOptions


def checked(args: argparse.Namespace, *dests: str) -> None:
    """Each of `dests` (argparse names) that is given: at least 1 and at most its `LIMITS` entry."""
    for dest in dests:
        v = getattr(args, dest, None)
        if v is not None:
            flag = "--" + dest.replace("_", "-")
            positive(flag, v)
            at_most(flag, v, LIMITS[dest])


def lora_of(args: argparse.Namespace) -> LoraSpec | None:
    """`--lora R` and its flags (`flags.add_lora`) as a LoraSpec; None without --lora."""
    return lora_from_flags(getattr(args, "lora", None), getattr(args, "lora_alpha", None),
                           getattr(args, "lora_dropout", None), getattr(args, "lora_targets", None),
                           bool(getattr(args, "load_in_4bit", False)))


def planning(args: argparse.Namespace) -> tuple[Hardware, tuple[ProfileTrace, ...], tuple[ProfileTrace, ...]]:
    """`--hardware`, `--profile` and `--calibration`: the hardware to plan on, the measured traces as given, and
    the traces to plan with (scaled to the calibrated host rates; a note on stderr says so)."""
    from tinypipe.describe.hardware import load_hardware
    from tinypipe.describe.trace import load_profiles

    profiles = load_profiles(args.profile or ())
    hardware = load_hardware(args.hardware)
    if not getattr(args, "calibration", None):
        return hardware, profiles, profiles
    from tinypipe.estimate.hostcal import calibrate, load_rates

    hardware, planned, line = calibrate(hardware, load_rates(args.calibration), profiles)
    print(f"note: calibrated to {args.calibration}: {line}", file=sys.stderr)
    return hardware, profiles, planned


def workload_of(args: argparse.Namespace, profiles: tuple[ProfileTrace, ...]) -> Workload:
    """The workload of `--model`, `--seq-len`, `--batch-tokens`, `--microbatches`, `--microbatch-size`,
    `--optimizer-state` (not `auto`), LoRA and `--dtype`, with `profiles` (`planning`); `checked` the numbers
    first."""
    from tinypipe.describe.hfconfig import load_model

    given = getattr(args, "optimizer_state", None)
    state = None if given in (None, "auto") else OptimizerState.parse(given, "--optimizer-state")
    return Workload(model=load_model(args.model), seq_len=args.seq_len,
                    batch_tokens=getattr(args, "batch_tokens", None), microbatches=getattr(args, "microbatches", None),
                    microbatch_size=getattr(args, "microbatch_size", None), optimizer_state=state,
                    lora=lora_of(args), dtype=args.dtype, profiles=profiles)


def target_of(args: argparse.Namespace, hardware: Hardware) -> tuple[Target, str | None]:
    """`hardware` with `--gpu-mem` and `--host-mem`: bytes, or for the host `here` (this machine's,
    `describe.thismachine`); unset, this machine's when `hardware` describes it (its GPU model is here), else the
    hardware's own. With a note saying which, when it is this machine's."""
    from tinypipe.describe.thismachine import host_limit_here, host_memory_here, is_here

    gpu = gpu_mem_bytes(args.gpu_mem) if getattr(args, "gpu_mem", None) else None
    value = getattr(args, "host_mem", None)
    if value is not None and value != "here":
        return Target(hardware=hardware, gpu_mem_bytes=gpu, host_mem_bytes=host_mem_bytes(value)), None
    if value == "here" or is_here(hardware):
        limit, said = host_limit_here(hardware, host_memory_here())
        note = f"note: host memory limit {said}: {hardware.name} is this machine (--host-mem to plan for another)"
        return Target(hardware=hardware, gpu_mem_bytes=gpu, host_mem_bytes=limit), note
    return Target(hardware=hardware, gpu_mem_bytes=gpu), None


def _record(cls: type[Any], args: argparse.Namespace, **given: Any) -> Any:
    """`cls` (a dataclass of options) from the fields of `args` of the same names, `given` over them."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names and k not in given}, **given)


def run_options(args: argparse.Namespace) -> RunOptions:
    """`tinypipe run`'s options, settled: defaults or a resumed run's record, and checked (`settings.settle`)."""
    from tinypipe.backends.options.settings import settle

    return settle(vars(args))


def profile_options(args: argparse.Namespace) -> ProfileOptions:
    from tinypipe.backends.profile.profile_flags import ProfileOptions

    record: ProfileOptions = _record(ProfileOptions, args, microbatch_size=tuple(args.microbatch_size),
                                     lora=lora_of(args))
    return record


def replay_options(args: argparse.Namespace) -> ReplayOptions:
    from tinypipe.replay.runner import ReplayOptions

    record: ReplayOptions = _record(ReplayOptions, args,
                                    gpu_mem_bytes=gpu_mem_bytes(args.gpu_mem) if args.gpu_mem else None)
    return record
