"""LoRA runs' files: a peft adapter directory out (and a merged model with `--merge`), an adapter directory in.

The output directory of a LoRA run is what `PeftModel.from_pretrained(base, out)` reads:
`adapter_config.json` (peft's own `LoraConfig`, written by peft) and `adapter_model.safetensors` (the
adapters under peft's keys, `lora_adapters.peft_name`). Each rank writes its layers' adapters to a part file;
after a barrier rank 0 joins them into the one file peft wants, atomically. `--merge` also writes the
base with the adapters folded in (`W + (alpha / r) B A`) as a Hugging Face model in `out/merged`. An
adapter directory to continue is held against the run's base before any worker starts (`check_adapter`:
every tensor's peft key and shape, read from the safetensors header).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tinypipe.common.errors import InputError
from tinypipe.describe.model import LayerKind, ModelSpec
from tinypipe.policy.lora_spec import ROLES, LoraSpec
from tinypipe.policy.modes import OptimizerState

from ..host.frozen import FrozenHostState, frozen_host_state
from ..host.state import DTYPES, HostState
from ..model.layers import LayerStack
from ..model.lora_adapters import PEFT_MODULES, PEFT_PREFIX
from .hf_save import save_pretrained

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED_DIR = "merged"


@dataclass(frozen=True)
class LoraFiles:
    """What a LoRA run reads and writes beyond the checkpoint: an adapter directory to continue from, --merge."""

    adapter: str | None = None
    merge: bool = False


def is_adapter_dir(path: str) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def lora_files(model: str, *, lora: int | None = None, optimizer_state: str | None = None, merge: bool = False,
               save: bool = True, save_every: int = 0) -> tuple[LoraFiles, str, LoraSpec | None]:
    """`run`'s LoRA files from its options (`model`, the `--lora` rank, ...), the model to build, and the adapter's
    LoraSpec. `--model DIR` naming a peft adapter directory continues that adapter: the model is the base its
    config names, and its LoraSpec is the run's unless `--lora` gives one. Options that mean nothing to a LoRA
    run are refused: --optimizer-state bf16 / 8bit (the adapters' AdamW is fp32 on the device), --merge with
    --no-save and no --save-every (no adapters saved to merge)."""
    adapter, base_model, spec = None, model, None
    if model and is_adapter_dir(model):
        adapter = model
        spec, base = read_adapter_config(adapter)
        if not base:
            raise InputError(f"{adapter}/{ADAPTER_CONFIG}: names no base_model_name_or_path to train it on")
        if not Path(base).exists() and "/" in base:
            raise InputError(f"{adapter}/{ADAPTER_CONFIG}: base model {base!r} is not a local path (nothing is "
                             "downloaded); give the base's directory there")
        base_model = base
    if optimizer_state is not None and not OptimizerState(optimizer_state).exact and (lora or adapter):
        raise InputError(f"--optimizer-state {optimizer_state}: a LoRA run's AdamW state is its adapters', held in "
                         "fp32 on the GPU (the frozen base has none on the host); leave --optimizer-state out")
    if merge and lora is None and adapter is None:
        raise InputError("--merge: only for a LoRA run (--lora R, or --model an adapter directory)")
    if merge and not save and not save_every:
        raise InputError("--merge with --no-save: the run saves no adapters to merge; leave out one of them (or add "
                         "--save-every N: each OUT/step-N then holds a merged model)")
    return LoraFiles(adapter=adapter, merge=merge), base_model, spec


def read_adapter_config(path: str) -> tuple[LoraSpec, str | None]:
    """The LoraSpec of a peft adapter directory, and the base model it names (`base_model_name_or_path`)."""
    where = str(Path(path) / ADAPTER_CONFIG)
    try:
        cfg = json.loads(Path(where).read_text())
        modules = cfg["target_modules"]
        by_module = {m: r for r, m in PEFT_MODULES.items()}
        if isinstance(modules, str) or any(m not in by_module for m in modules):
            raise InputError(f"{where}: target_modules {modules!r}: `run` continues adapters on "
                             f"{', '.join(PEFT_MODULES.values())} only")
        if cfg.get("use_rslora") or cfg.get("use_dora") or cfg.get("bias", "none") != "none":
            raise InputError(f"{where}: rsLoRA, DoRA and bias training are not supported")
        spec = LoraSpec(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), dropout=float(cfg.get("lora_dropout", 0)),
                        targets=tuple(r for r in ROLES if PEFT_MODULES[r] in modules))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{where}: not a peft LoRA adapter config ({exc})") from None
    return spec, cfg.get("base_model_name_or_path")


def adapter_shapes(spec: ModelSpec, names: list[dict[str, str]], lora: LoraSpec) -> dict[str, tuple[int, ...]]:
    """peft's key -> shape of every adapter tensor `lora` puts on the blocks of the model `spec`, whose
    parameters `names` gives per layer with their Hugging Face names (`hf.hf_name_maps`): A is (rank, in
    features), B (out features, rank), as `lora_adapters.peft_name` names them."""
    out: dict[str, tuple[int, ...]] = {}
    for layer, hf in zip(spec.layers, names):
        if layer.kind is not LayerKind.BLOCK:
            continue
        features = {roles: (fan_in, fan_out) for roles, fan_in, fan_out in layer.linears}
        for role in lora.targets:
            weight = next((v for k, v in hf.items() if k.endswith(f".{PEFT_MODULES[role]}.weight")), None)
            if weight is None or role not in features:
                continue
            stem, (fan_in, fan_out) = PEFT_PREFIX + weight.removesuffix(".weight"), features[role]
            out[f"{stem}.lora_A.weight"] = (lora.rank, fan_in)
            out[f"{stem}.lora_B.weight"] = (fan_out, lora.rank)
    return out


def check_adapter(path: str, spec: ModelSpec, names: list[dict[str, str]], lora: LoraSpec, base: str) -> None:
    """InputError unless the adapter directory `path` holds exactly the adapters `lora` puts on the model
    `base` (`spec`, `names`: `adapter_shapes`), each of its shape: an adapter made for another base model
    (other layers or widths), another rank or other targets is refused before any worker starts. Reads the
    safetensors header only."""
    from safetensors import SafetensorError, safe_open

    where = Path(path) / ADAPTER_WEIGHTS
    if not where.is_file():
        raise InputError(f"{path}: no {ADAPTER_WEIGHTS} (a peft adapter directory holds one)")
    try:
        with safe_open(str(where), "pt") as f:
            held = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise InputError(f"{where}: not a safetensors file ({exc})") from None
    want = adapter_shapes(spec, names, lora)
    wrong = [f"{k!r} has shape {held[k]}, {spec.name}'s needs {shape}" for k, shape in want.items()
             if k in held and held[k] != shape]
    wrong += [f"no {k!r}" for k in want if k not in held]
    wrong += [f"{k!r} has no place in {spec.name}" for k in held if k not in want]
    if wrong:
        raise InputError(f"{where}: {wrong[0]}{f' ({len(wrong) - 1} more)' if len(wrong) > 1 else ''}: the adapter "
                         f"does not fit {base} with LoRA {lora.text()}; it was made for another base model, rank or "
                         f"targets (its {ADAPTER_CONFIG} names the base in base_model_name_or_path): continue it on "
                         "its own base, or start new adapters with --model BASE --lora R")


def read_adapter(path: str) -> dict[str, torch.Tensor]:
    where = Path(path) / ADAPTER_WEIGHTS
    if not where.is_file():
        raise InputError(f"{path}: no {ADAPTER_WEIGHTS} (a peft adapter directory holds one)")
    return load_file(str(where))


def build_with_adapter(base: str, adapter: str, lora: LoraSpec, *, seed: int) -> LayerStack:
    """The whole model `base` with the peft adapter directory `adapter` in its blocks (peft's modules, the saved
    values): what `PeftModel.from_pretrained` computes, as a LayerStack (e.g. for `LayerStack.logits`)."""
    from ..model.hf import build_model
    from ..model.lora_adapters import inject, peft_name

    stack = build_model(base, seed=seed)
    layers = list(range(len(stack.layers)))
    _, initial = inject(stack, lora, layers, seed=seed)
    state = read_adapter(adapter)
    with torch.no_grad():
        for i, own in initial.items():
            params = dict(stack._layer(i).named_parameters())
            for n in own:
                params[n].copy_(state[peft_name(stack, i, n)])
    return stack


def lora_host_state(job: Any, stack: LayerStack, layers: list[int], device: torch.device) -> FrozenHostState:
    """The frozen host state of a rank of `job` (a `worker.Job` whose schedule trains LoRA)."""
    lora = job.schedule.lora
    assert lora is not None
    files: LoraFiles = job.lora_files
    return frozen_host_state(stack, lora, layers, device=device, compute_dtype=DTYPES[job.schedule.compute_dtype],
                             optim=job.optim, seed=job.seed, pin=device.type == "cuda",
                             adapter_state=read_adapter(files.adapter) if files.adapter else None,
                             adapter_where=files.adapter or "")


def save_outputs(host: HostState, stack: LayerStack, out: str, lora: LoraSpec | None, files: LoraFiles,
                 base: str, rank: int, world: int, barrier: Callable[[], None], *,
                 dtype: torch.dtype | None = None) -> None:
    """The trained model: a Hugging Face model (full training; `dtype` as `--save-dtype` says), or a peft
    adapter directory (LoRA; the adapters in fp32, as peft keeps them)."""
    if lora is None:
        save_pretrained(host.masters(), stack.config, out, rank=rank, world=world, source_dir=stack.source_dir,
                        dtype=dtype)
        return
    assert isinstance(host, FrozenHostState)
    save_adapter(host, stack, lora, out, rank=rank, barrier=barrier, base=base)
    if files.merge:
        save_pretrained(host.merged(), stack.config, Path(out) / MERGED_DIR, rank=rank, world=world,
                        source_dir=stack.source_dir, dtype=dtype)


def save_adapter(host: FrozenHostState, stack: LayerStack, lora: LoraSpec, out: str, *, rank: int,
                 barrier: Callable[[], None], base: str) -> None:
    """`out` as a peft adapter directory (module docstring); every rank calls it."""
    from ..model.lora_adapters import peft_config

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    part = path / f".adapter-part-{rank}.safetensors"
    save_file(host.adapters.peft_state(), str(part), metadata={"format": "pt"})
    barrier()
    if rank != 0:
        return
    parts = sorted(path.glob(".adapter-part-*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for p in parts:
        state.update(load_file(str(p)))
    tmp = path / f".{ADAPTER_WEIGHTS}.tmp{os.getpid()}"
    save_file(dict(sorted(state.items())), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / ADAPTER_WEIGHTS)
    cfg = peft_config(lora, stack.spec.family)
    cfg.base_model_name_or_path = base
    cfg.save_pretrained(str(path))
    for p in parts:
        p.unlink()
