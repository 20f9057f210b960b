"""The model every system builds: a Hugging Face config.json with a shipped (or given) model's shapes and
N decoder layers, written once per run of the runner.

Llama-3.1-8B in full needs more host memory than a 1-GPU H200 machine has (128 GiB) under the peers'
offload layouts (RoundPipe ~22 B/param, FSDP2 and DeepSpeed >= 16 B/param: 130-175 GB), so the runner
keeps its layer shapes (hidden 4096, 32 heads, 8 KV heads, intermediate 14336, vocabulary 128256) and
takes fewer decoder layers: what each layer costs is the 8B's, only the count differs. LoRA keeps one
frozen bf16 copy of the base (about 2 B/param), so with `--lora` the whole model is the default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from peers.workload import LORA_TARGETS, Lora
from tinypipe.common.errors import InputError
from tinypipe.describe.hfconfig import config_path, load_config, load_model

# RoundPipe 0.1.1 has sequential presets for LlamaForCausalLM and Qwen3ForCausalLM (roundpipe/models);
# tinypipe trains both families too.
FAMILIES = ("llama", "qwen3")
DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_LAYERS = 12
DROPPED = ("torch_dtype", "dtype")  # each system casts the weights itself


def model_config(model: str, layers: int | None, seq_len: int) -> tuple[str, dict[str, Any]]:
    """(name, Hugging Face config dict) of `model` (a shipped tinypipe name, a config.json or a directory
    holding one) with `layers` decoder layers (None: its own); InputError when it cannot be benchmarked here."""
    if layers is not None and layers < 1:
        raise InputError(f"--layers: must be >= 1, got {layers}")
    _, name = config_path(model)
    raw = load_config(model)
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise InputError(f"--model {model}: the peers are compared on {' or '.join(FAMILIES)} models "
                         f"(RoundPipe's presets); this one is {family!r}")
    if int(raw.get("max_position_embeddings", seq_len)) < seq_len:
        raise InputError(f"--model {model}: handles at most {raw['max_position_embeddings']} positions, "
                         f"--seq-len is {seq_len}")
    config = {k: v for k, v in raw.items() if k not in DROPPED}
    if layers is not None:
        config["num_hidden_layers"] = layers
    config["use_cache"] = False
    return name, config


def write_config(root: Path, name: str, config: dict[str, Any]) -> Path:
    """Write `root/name/config.json` and return that directory.

    The directory is named after the model so that tinypipe plans with its measured per-layer traces
    of that model (`tinypipe.describe.trace.find_trace` matches traces by model name; they are per layer kind,
    so they hold for any layer count)."""
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def params_of(directory: Path) -> int:
    """Parameters of the model in `directory` (tinypipe's ModelSpec; exact for these families)."""
    return load_model(str(directory)).params


def adapter_params_of(directory: Path, lora: Lora) -> int:
    """Parameters of `lora`'s adapters on the model in `directory` (tinypipe's formula: r (in + out) per
    wrapped linear; its roles are peft's module names less `_proj`)."""
    from tinypipe.estimate.lora_costs import model_adapter_params
    from tinypipe.policy.lora_spec import LoraSpec

    targets = tuple(t.removesuffix("_proj") for t in LORA_TARGETS)
    return model_adapter_params(load_model(str(directory)), LoraSpec(rank=lora.rank, alpha=lora.alpha,
                                                                     targets=targets))
