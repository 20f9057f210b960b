"""What the `tinypipe` commands share: the workload of a command line, output checks, JSON and lists."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError


def workloads(args: argparse.Namespace, policy_names: list[str]) -> list[tuple[Any, Any, Any, Any]]:
    """`workload` of each policy name, with the `--profile` traces read once; a note on stderr (once)
    for each microbatch size that none of them matches."""
    from tinypipe.describe.trace import load_profiles, unmatched_note

    profiles = load_profiles(args.profile or ())
    hw, planning = calibrated(args, profiles)
    out = [workload(args, name, planning, hw) for name in policy_names]
    notes = dict.fromkeys(unmatched_note(profiles, trace, model) for model, _, _, trace in out)
    for note in notes:
        if note is not None:
            print(note, file=sys.stderr)
    return out


def calibrated(args: argparse.Namespace, profiles: Any) -> tuple[Any, Any]:
    """`--calibration`: the hardware and profiles to plan with (None and `profiles` without it); a note on stderr."""
    if not getattr(args, "calibration", None):
        return None, profiles
    from tinypipe.describe.hardware import load_hardware
    from tinypipe.estimate.hostcal import calibrate, load_rates

    hw, planning, line = calibrate(load_hardware(args.hardware), load_rates(args.calibration), profiles)
    print(f"note: calibrated to {args.calibration}: {line}", file=sys.stderr)
    return hw, planning


def workload(args: argparse.Namespace, policy_name: str, profiles: Any, hw: Any = None) -> tuple[Any, Any, Any, Any]:
    """Model, hardware (`hw`, else `--hardware`), policy (with CLI overrides) and trace (`profiles` first) for one
    policy name."""
    from tinypipe.describe.hardware import load_hardware
    from tinypipe.describe.hfconfig import load_model
    from tinypipe.describe.trace import trace_for
    from tinypipe.policy import load_policy
    from tinypipe.policy.lora_spec import lora_from_args, lora_text

    for flag in ("seq_len", "iterations", "microbatches", "microbatch_size"):
        v = getattr(args, flag, None)
        if v is not None:
            positive("--" + flag.replace("_", "-"), v)
            at_most("--" + flag.replace("_", "-"), v, LIMITS[flag])
    model = load_model(args.model)
    if args.seq_len > model.max_seq_len:
        raise InputError(f"--seq-len {args.seq_len}: {model.name} handles at most {model.max_seq_len:,} positions")
    hw = hw or load_hardware(args.hardware)
    policy = load_policy(policy_name)
    changes = {k: getattr(args, k) for k in ("microbatches", "microbatch_size", "optimizer_state")
               if getattr(args, k, None)}
    if changes:
        policy = policy.replace(**changes)
    lora = lora_from_args(args)
    if lora is not None:
        policy = policy.replace(lora=lora)
    batch_tokens = getattr(args, "batch_tokens", None)
    if batch_tokens is not None:  # one workload for every policy: its microbatch count follows
        per_mb = policy.microbatch_size * args.seq_len
        if batch_tokens % per_mb:
            raise InputError(f"--batch-tokens {batch_tokens}: not a multiple of policy {policy.name!r}'s microbatch "
                             f"({policy.microbatch_size} sequence(s) x {args.seq_len} tokens = {per_mb})")
        policy = policy.replace(microbatches=batch_tokens // per_mb)
    trace = trace_for(model, hw.gpus[0], microbatch_size=policy.microbatch_size, seq_len=args.seq_len,
                      dtype=args.dtype, profiles=profiles, lora=lora_text(policy.lora))
    return model, hw, policy, trace


# the most a command line may ask for: beyond these, compiling and simulating takes hours (a schedule holds
# iterations x microbatches x layers actions), so a mistyped number is refused instead of run
LIMITS = {"seq_len": 1 << 24, "iterations": 64, "microbatches": 4096, "microbatch_size": 65536, "workers": 1024,
          "top": 100_000, "batch_tokens": 1 << 34}


def host_limit(value: str | None, hw: Any) -> tuple[int | None, str | None]:
    """`--host-mem`: bytes, or `here` (this machine's, `describe.thismachine`); unset, this machine's when `hw`
    describes it (its GPU model is here), else the hardware's own (None). With a note saying which."""
    from tinypipe.common.units import parse_bytes
    from tinypipe.describe.thismachine import host_limit_here, host_memory_here, is_here

    if value is not None and value != "here":
        return parse_bytes(value, "--host-mem"), None
    if value == "here" or is_here(hw):
        limit, said = host_limit_here(hw, host_memory_here())
        return limit, f"note: host memory limit {said}: {hw.name} is this machine (--host-mem to plan for another)"
    return None, None


def positive(flag: str, v: int) -> None:
    if v < 1:
        raise InputError(f"{flag}: must be >= 1, got {v}")


def at_most(flag: str, v: int, most: int) -> None:
    if v > most:
        raise InputError(f"{flag}: at most {most:,}, got {v:,}")


def print_json(obj: Any) -> int:
    print(json.dumps(obj, indent=2, default=str))
    return 0


def print_list(kind: str, names: list[str], as_json: bool) -> int:
    if as_json:
        return print_json(names)
    print(f"shipped {kind}: " + ", ".join(names))
    return 0


def check_outputs(**paths: str | None) -> None:
    """Fail before any work when an output file cannot be written (`--plot` also needs matplotlib)."""
    from tinypipe.common.outputs import check_file

    for flag, value in paths.items():
        if value is None:
            continue
        check_file(Path(value), "--" + flag.replace("_", "-"))
        if flag == "plot" and Path(value).exists():  # a picture is never drawn over a file the user has
            raise InputError(f"--plot {value}: the file exists; give a new name or remove it")
        if flag == "plot":
            from tinypipe.cli.plot import _pyplot

            formats = _pyplot().gcf().canvas.get_supported_filetypes()
            suffix = Path(value).suffix.lower().lstrip(".")
            if suffix and suffix not in formats:
                raise InputError(f"--plot {value}: .{suffix} is not a picture format; end the name with .png "
                                 f"(or .{', .'.join(sorted(f for f in formats if f != 'png'))})")


def plot_to(draw: Callable[..., Any], what: Any, path: str) -> None:
    """Draw a PNG; a file that cannot be written is an InputError."""
    try:
        draw(what, path)
    except OSError as exc:
        raise InputError(f"{path}: cannot write: {exc.strerror or exc}") from None


def write_new(path: Path, text: str) -> None:
    """Write an output file atomically (temp file + rename) so a failure never leaves half a file."""
    if path.is_dir():
        raise InputError(f"{path}: is a directory; give a file name")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise InputError(f"{path}: cannot write: {exc.strerror}") from None

