"""`tinypipe run`'s options for a frugal run (state precision, checkpoints kept) and the disk check before one.

`check_disk` refuses a run whose checkpoints the disk cannot hold, before any worker starts: one
checkpoint's bytes come from the same formula as the host state (`hostmem.checkpoint_bytes`, for the
layers each rank holds; under LoRA the adapters and their moments, `estimate.lora.adapter_checkpoint_bytes`),
and the disk must hold `--keep-checkpoints` + 1 of them (the next is written beside the kept ones before
the oldest goes) and the fine-tuned model in its save dtype, or a LoRA run's adapter directory and its
merged model if asked for (once at the end, and once more per `--save-every` N steps), less what earlier
checkpoints of this run already hold there.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import tinypipe.cli.flags as flags
from tinypipe.common.errors import InputError
from tinypipe.common.table import gib
from tinypipe.policy.modes import OptimizerState

KEEP_HELP = ("complete training-state checkpoints kept in --out (default 1: the next is written beside it, so "
             "the disk holds two while one is written, and a crash at any moment leaves one; 0: none written)")


def add_frugal_arguments(p: argparse.ArgumentParser) -> None:
    """Register --optimizer-state and --keep-checkpoints on `run`'s parser (defaults: None, see settings)."""
    flags.add_optimizer_state(p, "how the host holds AdamW's moments: fp32 (exact), bf16, or 8bit (block-wise "
                                 "quantised, Dettmers et al. 2021); the master stays fp32 (default: the policy's, "
                                 "fp32)")
    p.add_argument("--keep-checkpoints", type=int, default=None, metavar="N", help=KEEP_HELP)


def checkpoint_plan_bytes(spec: Any, schedule: Any) -> int:
    """Bytes of one checkpoint of all ranks of `schedule` (each rank's layers by `hostmem.checkpoint_bytes`, or
    under LoRA by `estimate.lora.adapter_checkpoint_bytes`: the adapters and their moments, not the base)."""
    from tinypipe.estimate.hostmem import checkpoint_bytes
    from tinypipe.estimate.lora_costs import adapter_checkpoint_bytes
    from tinypipe.ir.schedule import owned_layers

    if schedule.lora is not None:
        return sum(adapter_checkpoint_bytes(spec, schedule.lora, tuple(owned_layers(schedule, r)))
                   for r in range(schedule.num_gpus))
    return sum(checkpoint_bytes(spec, schedule.host_memory, compute_dtype=schedule.compute_dtype,
                                layers=tuple(owned_layers(schedule, r)), optimizer=schedule.optimizer,
                                optimizer_state=schedule.optimizer_state) for r in range(schedule.num_gpus))


def model_bytes(spec: Any, dtype: str = "fp32") -> int:
    """Bytes of the fine-tuned model `save_pretrained` writes in `dtype` (a tied matrix once)."""
    from tinypipe.describe.model import DTYPE_BYTES

    return DTYPE_BYTES[dtype] * int(spec.params)


def output_bytes(spec: Any, schedule: Any, dtype: str = "fp32", *, merge: bool = False) -> int:
    """Bytes of one saved output: the fine-tuned model in `dtype`, or under LoRA the peft adapter directory
    (fp32 adapters) and, with `merge`, the merged model in `dtype` beside it."""
    from tinypipe.estimate.lora_costs import model_adapter_params
    from tinypipe.policy.lora_spec import ADAPTER_WEIGHT_BYTES_PER_PARAM

    if schedule.lora is None:
        return model_bytes(spec, dtype)
    adapters = ADAPTER_WEIGHT_BYTES_PER_PARAM * model_adapter_params(spec, schedule.lora)
    return adapters + (model_bytes(spec, dtype) if merge else 0)


def free_bytes(out: Path) -> int:
    """Free bytes of the filesystem `out` is (or will be) on: that of its nearest existing ancestor."""
    p = out.resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def check_disk(out: str, spec: Any, schedule: Any, *, keep: int, checkpoints: bool, save_model: bool = True,
               save_dtype: str = "fp32", model_copies: int = 1, merge: bool = False,
               free: int | None = None) -> dict[str, int]:
    """The bytes a run's output needs on disk (`need`, `free`, `checkpoint`, `model`); InputError when
    `out`'s filesystem cannot hold them, saying how much and what to change. `model_copies`: the saved
    models the run writes (the end's, and one per --save-every); `merge`: a LoRA run also writes the merged
    model (`output_bytes`)."""
    from ..save import checkpoint

    one = checkpoint_plan_bytes(spec, schedule) if checkpoints and keep > 0 else 0
    model = model_copies * output_bytes(spec, schedule, save_dtype, merge=merge) if save_model else 0
    reused = checkpoint.held_bytes(out) if one else 0  # this run's own earlier checkpoints make way
    need = max(0, (keep + 1) * one - reused) + model
    free = free_bytes(Path(out)) if free is None else free
    if need > free:
        parts = [f"{keep + 1} x {gib(one)} of checkpoints (--keep-checkpoints {keep} kept, and the next written "
                 f"beside {'it' if keep == 1 else 'them'})"] if one else []
        if reused:
            parts.append(f"less {gib(reused)} its earlier checkpoints hold")
        if model:
            parts.append(f"{gib(model)} for the fine-tuned model" + (f" ({model_copies} copies: --save-every)"
                                                                    if model_copies > 1 else ""))
        fixes = []
        if one and keep > 1 and keep * one - reused + model <= free:
            fixes.append(f"--keep-checkpoints {keep - 1}")
        if one and model <= free:
            fixes.append("--keep-checkpoints 0 (no checkpoints: the run cannot be resumed)")
        if schedule.optimizer_state != OptimizerState.INT8 and one and schedule.lora is None:
            fixes.append("--optimizer-state 8bit (smaller checkpoints)")
        fixes.append("an --out on a larger filesystem")
        raise InputError(f"--out {out}: the run needs {gib(need)} on disk ({', '.join(parts)}) and its filesystem "
                         f"has {gib(free)} free; use {' or '.join(fixes)}")
    return {"need": need, "free": free, "checkpoint": one, "model": model}
