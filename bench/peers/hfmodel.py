"""The model and the data every peer trains: a Hugging Face causal LM built from the runner's config.json
(transformers 4.5x or 5.x), with seeded random weights, and seeded random token ids.

Building is fast at billions of parameters: the model is made on the meta device (no memory, no
initialisation), then each parameter is drawn on `init_device` (the GPU, where `normal_` is cheap),
cast, and moved to `out_device` one at a time, so the GPU never holds more than one tensor of it.
Values: Linear and Embedding weights ~ N(0, 0.02) drawn in bf16 (the compute dtype) from one generator
seeded with `seed`, in the model's parameter order; norm weights 1. Rotary-embedding buffers are
computed for real by a freshly built module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from peers.workload import INIT_STD, Workload

ATTN_IMPLEMENTATION = "sdpa"  # the same attention kernels in every system (flash attention through SDPA)


def load_config(config_dir: str | Path) -> Any:
    """The transformers config of the runner's model, without KV cache, with SDPA attention."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(config_dir))
    config.use_cache = False
    config._attn_implementation = ATTN_IMPLEMENTATION
    return config


def build_model(config_dir: str | Path, *, dtype: torch.dtype, seed: int, init_device: torch.device | str,
                out_device: torch.device | str = "cpu") -> nn.Module:
    """`AutoModelForCausalLM.from_config` of the runner's config, materialised in `dtype` on `out_device`."""
    from transformers import AutoModelForCausalLM

    config = load_config(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, leaf = name.rpartition(".")
            with torch.device(out_device):
                setattr(model.get_submodule(parent), leaf, type(module)(config=config))
    generator = torch.Generator(device=init_device).manual_seed(seed)
    made: dict[int, nn.Parameter] = {}  # a tied matrix is made once and set in both places
    with torch.no_grad():
        for module in model.modules():
            for leaf, param in list(module.named_parameters(recurse=False)):
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(_draw(module, leaf, param, generator, init_device)
                                                   .to(device=out_device, dtype=dtype), requires_grad=True)
                setattr(module, leaf, made[id(param)])
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"left on the meta device after materialising: {left[:5]}")
    return model


def _draw(module: nn.Module, leaf: str, param: torch.Tensor, generator: torch.Generator,
          device: torch.device | str) -> torch.Tensor:
    value = torch.empty(param.shape, dtype=torch.bfloat16, device=device)
    if "Norm" in type(module).__name__:
        return value.fill_(1.0 if leaf == "weight" else 0.0)
    if leaf == "bias":
        return value.zero_()
    return value.normal_(0.0, INIT_STD, generator=generator)


def enable_checkpointing(model: nn.Module) -> str:
    """Checkpoint every decoder layer's activations (non-reentrant) with transformers' own switch, whose
    name changed in 5.x; returns the call used."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x (the old name warns there)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return "activation_checkpointing_enable(use_reentrant=False)"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return "gradient_checkpointing_enable(use_reentrant=False)"


def count_params(model: nn.Module) -> int:
    """Distinct parameters (a tied matrix once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def token_batch(workload: Workload, vocab_size: int, *, step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's sequences of optimizer step `step`: [sequences / world, seq_len] token ids, uniform
    over the vocabulary, from a generator seeded by (seed, step, rank); on the CPU."""
    generator = torch.Generator().manual_seed((workload.seed * 1_000_003 + step) * 4099 + rank)
    rows = workload.per_rank(world)
    return torch.randint(0, vocab_size, (rows, workload.seq_len), generator=generator)
