"""Hugging Face models as layer stacks: configs, deterministic init, safetensors streaming.

`build_model` builds the whole Hugging Face model on the meta device (no memory), splits it into
the pipeline's layers (`layers.Embed`, `layers.Block` x L, `layers.Head`) and materialises only the
layers a process owns: from the model directory's safetensors, one tensor at a time, or from a
seeded initialisation that gives every parameter the same value whatever `only` is. Saving a
trained stack is `hf_save.py`'s.
"""

from __future__ import annotations

import copy
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tinypipe.common.errors import InputError
from tinypipe.describe.families import RUN_FAMILIES
from tinypipe.describe.hfconfig import config_path, load_config, load_model, shipped_models
from tinypipe.describe.model import ModelSpec

from . import moe
from .layers import Block, Embed, Head, LayerStack

ATTN_IMPLEMENTATION = "sdpa"  # causal without a mask: SDPA's flash kernel on CUDA, fused on CPU
DEFAULT_INIT_STD = 0.02  # transformers' default `initializer_range`
TIED = ("lm_head.weight", "embed_tokens.weight")  # the shared matrix: name in the Head, name in the Embed
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class UnsupportedModelError(InputError):
    """A model `run` cannot train (yet): the message says what and what to use instead."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: its Hugging Face config, ModelSpec and local directory (if any)."""

    name: str
    config: Any  # transformers.PretrainedConfig, attention implementation set
    spec: ModelSpec
    directory: Path | None  # a local model directory (weights and tokenizer files may be there)

    @property
    def has_weights(self) -> bool:
        d = self.directory
        return d is not None and ((d / SINGLE_FILE).is_file() or (d / INDEX_FILE).is_file())


def load_source(name_or_path: str, *, attn_implementation: str = ATTN_IMPLEMENTATION) -> ModelSource:
    """Resolve a shipped model name or a local directory / config.json into a ModelSource."""
    from transformers import AutoConfig

    path, name = config_path(name_or_path)
    spec = load_model(name_or_path)
    raw = load_config(name_or_path)
    family = raw.get("model_type")
    if family not in RUN_FAMILIES:  # the decoder-only families `run` can split
        raise UnsupportedModelError(
            f"{path}: `run` trains {', '.join(RUN_FAMILIES)} models; this one is {family!r} "
            f"(shipped models: {', '.join(shipped_models())})")
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "torch_dtype", "dtype")}
    config = AutoConfig.for_model(family, **fields)
    config._attn_implementation = attn_implementation
    directory = None if path.parent == _shipped_folder() else path.parent
    return ModelSource(name=name, config=config, spec=spec, directory=directory)


def _shipped_folder() -> Path:
    from tinypipe import traces

    folder: Path = traces.folder("models")  # tinypipe.traces: data files, untyped here
    return folder


def build_model(name_or_path: str, *, seed: int, only: set[int] | None = None,
                dtype: torch.dtype = torch.float32,
                attn_implementation: str = ATTN_IMPLEMENTATION, lazy: bool = False) -> LayerStack:
    """The model split into its layer sequence (see `LayerStack`), materialising only `only`.

    Weights come from the model directory's safetensors when it has them (each tensor read on its
    own, straight into the layer that owns it), otherwise from `init_layer(seed)`: every
    parameter's value depends only on `seed` and its name, so any `only` gives the same weights.
    `lazy`: the layers of `only` keep their parameters on the meta device (their buffers are made);
    `LayerStack.tensors_of(i)` reads or draws layer i's weights when asked, one layer at a time, so a
    caller that copies them into its own store (the host state) never holds the model twice.
    """
    source = load_source(name_or_path, attn_implementation=attn_implementation)
    metas, names, _ = split_meta(source.config)
    wanted = set(range(len(metas))) if only is None else set(only)
    bad = sorted(i for i in wanted if not 0 <= i < len(metas))
    if bad:
        raise ValueError(f"layers {bad} out of range: {source.name} has layers 0..{len(metas) - 1}")
    if len(metas) != len(source.spec.layers):
        raise AssertionError(f"{source.name}: {len(metas)} layers built, spec has {len(source.spec.layers)}")
    reader = WeightReader(source.directory) if source.directory and source.has_weights else None
    tied = tied_names(source.config)
    head = len(metas) - 1

    # a lazy layer's structure as built: the stack's module may be changed later (LoRA wraps its linears)
    # before `tensors_of` draws its weights by the names and owners it had
    built: dict[int, nn.Module] = {}

    def tensors_of(i: int) -> dict[str, torch.Tensor]:
        if reader is not None:
            return {p: reader.get(hf, where=f"layer {i}") for p, hf in names[i].items()}
        return init_layer(built.get(i, metas[i]), names[i], seed=seed, std=_init_std(source.config))

    layers: list[nn.Module | None] = []
    for i, meta in enumerate(metas):
        if i not in wanted:
            layers.append(None)
            continue
        tensors = {} if lazy else tensors_of(i)
        if tied is not None and i == head:
            # the head computes with the embedding's matrix: the very same parameter where this
            # process holds the embedding too, else a copy of its values
            shared = layers[0].get_parameter(tied[1]) if 0 in wanted else None  # type: ignore[union-attr]
            if shared is None:
                value = (torch.empty(metas[0].get_parameter(tied[1]).shape, device="meta") if lazy
                         else tensors_of(0)[tied[1]].to(dtype))
                shared = nn.Parameter(value, requires_grad=True)
            owner_name, _, leaf = tied[0].rpartition(".")
            setattr(meta.get_submodule(owner_name), leaf, shared)
        if lazy:
            built[i] = copy.deepcopy(meta)
        layers.append(make_buffers(meta, source.config) if lazy
                      else materialize(meta, tensors, dtype=dtype, config=source.config))
    return LayerStack(layers=layers, config=source.config, spec=source.spec, names=names,
                      source_dir=source.directory, tied=tied, tensors_of=tensors_of if lazy else None)


def split_meta(config: Any) -> tuple[list[nn.Module], list[dict[str, str]], nn.Module | None]:
    """The model's layers as meta-device modules, their parameter -> Hugging Face name maps, and
    the model's rotary-embedding module built for real on the CPU (None where layers hold their own)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.float()
    base = model.model
    rotary_meta = getattr(base, "rotary_emb", None)
    rotary = None if rotary_meta is None else make_rotary(rotary_meta, config)
    impl = config._attn_implementation
    metas: list[nn.Module] = [Embed(base.embed_tokens)]
    metas += [Block(layer, rotary, attn_implementation=impl, sliding_window=sliding_window(config, k))
              for k, layer in enumerate(base.layers)]
    metas.append(Head(base.norm, model.lm_head))
    moe.mark(metas, moe.routing(metas, config))  # MoE blocks keep their router logits (the load-balancing loss)
    hf_name: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        hf_name.setdefault(id(p), n)  # a tied matrix keeps its first (embedding) name
    # a parameter is listed under the first layer that holds it: the tied LM head lists only its norm
    seen: set[int] = set()
    names: list[dict[str, str]] = []
    for m in metas:
        names.append({n: hf_name[id(p)] for n, p in m.named_parameters() if id(p) not in seen})
        seen.update(id(p) for p in m.parameters())
    return metas, names, rotary


def tied_names(config: Any) -> tuple[str, str] | None:
    """For a model whose LM head computes with the token embedding matrix: (its name in the head
    layer, its name in the embedding layer); None for untied models."""
    if not getattr(config, "tie_word_embeddings", False):
        return None
    return TIED


def hf_name_maps(config: Any) -> list[dict[str, str]]:
    """Per layer: parameter name in the layer -> Hugging Face state-dict name."""
    return split_meta(config)[1]


# --- what differs between transformers versions (with layers._call_decoder_layer) -------------

def make_rotary(meta: nn.Module, config: Any) -> nn.Module:
    """A real (CPU, fp32) copy of a meta rotary-embedding module: 5.x and late 4.x take the config;
    early 4.x Mistral/Qwen2-style modules take (dim, max_position_embeddings, base)."""
    with torch.device("cpu"):
        try:
            rotary = type(meta)(config=config)
        except TypeError:
            rotary = type(meta)(meta.dim, max_position_embeddings=meta.max_position_embeddings,
                                base=meta.base)
    return rotary.float()


def set_config_dtype(config: Any, dtype: torch.dtype) -> None:
    """Record the weights' dtype in a config: `dtype` in 5.x (`torch_dtype` is its deprecated alias
    there), `torch_dtype` in 4.x."""
    if isinstance(getattr(type(config), "torch_dtype", None), property):
        config.dtype = dtype
    else:
        config.torch_dtype = dtype


def sliding_window(config: Any, k: int) -> int | None:
    """The attention window of decoder layer k, or None for full causal attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return None
    if layer_types:  # 5.x and late 4.x Qwen2/Qwen3 configs say it per layer
        return int(window) if layer_types[k] == "sliding_attention" else None
    if config.model_type in ("mistral", "mixtral"):
        return int(window)
    if getattr(config, "use_sliding_window", False):  # 4.4x Qwen2/Qwen3
        return int(window) if k >= getattr(config, "max_window_layers", 0) else None
    return None


# --- deterministic initialisation -----------------------------------------------------------------

def _init_std(config: Any) -> float:
    return float(getattr(config, "initializer_range", None) or DEFAULT_INIT_STD)


def param_seed(seed: int, hf_name: str) -> int:
    """The generator seed of one parameter: a hash of the run seed and its Hugging Face name (which
    carries the layer number), the same in every process and Python run."""
    digest = hashlib.sha256(f"{seed}/{hf_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_layer(meta: nn.Module, names: dict[str, str], *, seed: int, std: float) -> dict[str, torch.Tensor]:
    """Fresh fp32 values for a layer's parameters, as transformers' `_init_weights` draws them for
    these families: Linear and Embedding weights ~ N(0, std) (the padding row zero), biases 0,
    norm weights 1; each parameter from its own generator seeded by `param_seed(seed, name)`."""
    out: dict[str, torch.Tensor] = {}
    drawn: list[tuple[str, nn.Module, torch.Tensor]] = []
    for name, param in meta.named_parameters():
        if name not in names:  # another layer's (the tied LM head's embedding matrix)
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = meta.get_submodule(owner_name)
        if "Norm" in type(owner).__name__:
            out[name] = torch.ones(param.shape) if leaf == "weight" else torch.zeros(param.shape)
        elif leaf == "bias":
            out[name] = torch.zeros(param.shape)
        else:
            out[name] = torch.empty(param.shape)
            drawn.append((name, owner, out[name]))

    def draw(item: tuple[str, nn.Module, torch.Tensor]) -> None:
        name, owner, value = item
        value.normal_(0.0, std, generator=torch.Generator().manual_seed(param_seed(seed, names[name])))
        padding = getattr(owner, "padding_idx", None)
        if isinstance(owner, nn.Embedding) and padding is not None:
            value[padding] = 0.0

    # one generator per parameter draws on one core: the parameters draw side by side (a 70B layer's seven
    # matrices, 0.86 G values, in the time of its largest, instead of one after another)
    workers = min(len(drawn), torch.get_num_threads())
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(draw, drawn))
    else:
        for item in drawn:
            draw(item)
    return out


def materialize(meta: nn.Module, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype,
                config: Any) -> nn.Module:
    """Give a meta layer real parameters (`tensors`, cast to `dtype`, no further copy) and real
    rotary buffers where a layer owns a rotary module (transformers 4.4x)."""
    for name, param in list(meta.named_parameters()):
        if name not in tensors and not param.is_meta:  # already real (a tied matrix set by the caller)
            continue
        value = tensors[name]
        if tuple(value.shape) != tuple(param.shape):
            raise InputError(f"parameter {name}: weights have shape {tuple(value.shape)}, "
                             f"the config gives {tuple(param.shape)}")
        owner_name, _, leaf = name.rpartition(".")
        setattr(meta.get_submodule(owner_name), leaf, nn.Parameter(value.to(dtype), requires_grad=True))
    make_buffers(meta, config)
    left = [n for n, t in [*meta.named_parameters(), *meta.named_buffers()] if t.is_meta]
    if left:
        raise AssertionError(f"tensors left on the meta device: {left}")
    return meta


def make_buffers(meta: nn.Module, config: Any) -> nn.Module:
    """Real rotary buffers where a layer owns a rotary module (transformers 4.4x); parameters untouched."""
    for owner_name, module in list(meta.named_modules()):
        if "RotaryEmbedding" in type(module).__name__:
            parent_name, _, leaf = owner_name.rpartition(".")
            setattr(meta.get_submodule(parent_name), leaf, make_rotary(module, config))
    return meta


# --- safetensors in and out -----------------------------------------------------------------------

class WeightReader:
    """Reads single tensors from a model directory's safetensors (one file or an index of shards)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / INDEX_FILE
        if index.is_file():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise InputError(f"{index}: not a safetensors index ({exc})") from exc
        else:
            with safe_open(str(directory / SINGLE_FILE), framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        self._open: dict[str, Any] = {}

    def get(self, name: str, *, where: str = "") -> torch.Tensor:
        """The tensor `name` (Hugging Face state-dict name), read from disk now."""
        file = self.weight_map.get(name)
        if file is None:
            raise InputError(f"{self.directory}: the weights have no tensor {name!r}"
                             + (f" ({where})" if where else ""))
        if file not in self._open:
            self._open[file] = safe_open(str(self.directory / file), framework="pt")
        tensor: torch.Tensor = self._open[file].get_tensor(name)
        return tensor
