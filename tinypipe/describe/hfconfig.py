"""Models from Hugging Face config.json files: the shipped configs, parsing each family's fields
into a `model.Shape`, and `load_model` -> `ModelSpec`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import tinypipe.traces as traces
from tinypipe.common.errors import InputError
from tinypipe.common.jsonio import Fields, load_json
from tinypipe.describe.families import FAMILIES
from tinypipe.describe.hubcache import CONFIG, is_hub_id, model_dir
from tinypipe.describe.model import Experts, ModelSpec, Shape, layer_specs

EXTRA_KEYS = ("_source", "_published_params")  # tinypipe's keys in a shipped config; not Hugging Face's

# Limits that keep nonsense input from building absurd specs (no published model comes near them).
MAX_LAYERS = 10_000
MAX_DIM = 2**31 - 1

# The families and their defaults for optional config fields: one table, `families.FAMILIES`.
# Qwen3-MoE's expert width defaults to 768 (transformers 5.x).
_QWEN3_MOE_WIDTH_DEFAULT = 768


def from_hf_config(config: Any, *, name: str, where: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config dict; errors name `where` and the field."""
    f = Fields(config, where)
    family = f.str("model_type", choices=tuple(FAMILIES))
    shape = _READERS[FAMILIES[family].reader](f, family)
    source = f.str("_source", None)
    published = f.int("_published_params", None, minimum=1)
    return ModelSpec(
        name=name,
        family=family,
        layers=layer_specs(shape),
        hidden_size=shape.hidden,
        vocab_size=shape.vocab,
        num_blocks=shape.layers,
        tied_embeddings=shape.tied,
        max_seq_len=shape.max_seq_len,
        source=f"{where} ({source})" if source else where,
        published_params=published,
    )


def _dim(f: Fields, key: str, default: Any = ..., *, limit: int = MAX_DIM) -> int:
    value = f.int(key, default, minimum=1)
    if value > limit:
        raise InputError(f"{f._at(key)}: must be <= {limit}, got {value}")
    return value


def _check_heads(f: Fields, heads: int, kv_heads: int, kv_key: str) -> None:
    if heads % kv_heads:
        raise InputError(f"{f._at(kv_key)}: {kv_heads} does not divide the {heads} attention heads")


def _split_heads(f: Fields, hidden: int, heads: int, heads_key: str) -> int:
    if hidden % heads:
        raise InputError(f"{f._at(heads_key)}: {heads} heads do not divide the hidden size {hidden} "
                         "(give head_dim, or fix the sizes)")
    return hidden // heads


def _parse_decoder(f: Fields, family: str) -> Shape:
    """Llama, Mistral, Qwen2, Qwen3 (and their MoE kin): RMSNorm, rotary positions, SwiGLU MLP, optional GQA;
    biases, q/k norms and experts as the family's row says."""
    row = FAMILIES[family]
    hidden = _dim(f, "hidden_size")
    heads = _dim(f, "num_attention_heads")
    kv_default = row.kv_heads
    if kv_default is None or "num_key_value_heads" in f.obj:  # transformers reads null as "= heads"
        kv_default = heads
    kv_heads = _dim(f, "num_key_value_heads", kv_default)
    _check_heads(f, heads, kv_heads, "num_key_value_heads")
    head_dim_default = row.head_dim
    if f.has("head_dim") or head_dim_default is not None:
        head_dim = _dim(f, "head_dim", head_dim_default)
    else:
        head_dim = _split_heads(f, hidden, heads, "num_attention_heads")
    attention_bias = row.attention_bias and f.bool("attention_bias", False)
    layers = _dim(f, "num_hidden_layers", limit=MAX_LAYERS)
    return Shape(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=_dim(f, "intermediate_size"),
        vocab=_dim(f, "vocab_size"),
        positions=0,
        max_seq_len=_dim(f, "max_position_embeddings", row.max_positions),
        tied=f.bool("tie_word_embeddings", False),
        gated_mlp=True,
        layer_norm=row.layer_norm,
        qkv_bias=attention_bias or row.qkv_bias,
        o_bias=attention_bias,
        mlp_bias=row.mlp_bias and f.bool("mlp_bias", False),
        qk_norm=row.qk_norm,
        parallel_residual=False,
        block_dropout=False,
        embed_dropout=False,
        moe=_parse_experts(f, family, layers) if row.experts is not None else None,
    )


def _parse_experts(f: Fields, family: str, layers: int) -> Experts:
    """Qwen3-MoE's and Mixtral's experts: `num_experts` (Qwen3-MoE's name; transformers' `num_local_experts`
    too), `num_experts_per_tok`, the expert width (Qwen3-MoE: `moe_intermediate_size`; Mixtral's experts are
    `intermediate_size` wide) and, for Qwen3-MoE, which layers are sparse: layer k is unless it is in
    `mlp_only_layers` or (k + 1) is not a multiple of `decoder_sparse_step`, as transformers builds them."""
    experts = FAMILIES[family].experts
    assert experts is not None  # called for a family with experts
    count_default, top_default = experts
    key = "num_experts" if f.has("num_experts") or not f.has("num_local_experts") else "num_local_experts"
    count = _dim(f, key, count_default)
    top = _dim(f, "num_experts_per_tok", top_default)
    if top > count:
        raise InputError(f"{f._at('num_experts_per_tok')}: {top} experts per token, but the layer has {count}")
    if family == "mixtral":
        if f.float("router_jitter_noise", 0.0, minimum=0.0) > 0:
            raise InputError(f"{f._at('router_jitter_noise')}: router jitter (random noise on the router's input "
                             "in training) is not supported; set it to 0")
        return Experts(count=count, per_token=top, intermediate=_dim(f, "intermediate_size"),
                       sparse=(True,) * layers)
    step = _dim(f, "decoder_sparse_step", 1, limit=MAX_LAYERS)
    dense = f.list("mlp_only_layers") if f.raw("mlp_only_layers", None) is not None else []
    bad = [k for k in dense if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < layers]
    if bad:
        raise InputError(f"{f._at('mlp_only_layers')}: {bad[0]!r} is not a layer index in 0..{layers - 1}")
    return Experts(count=count, per_token=top, intermediate=_dim(f, "moe_intermediate_size", _QWEN3_MOE_WIDTH_DEFAULT),
                   sparse=tuple(k not in dense and (k + 1) % step == 0 for k in range(layers)))


def _alias(f: Fields, key: str, alias: str, default: Any = ..., *, limit: int = MAX_DIM) -> int:
    """GPT-2 spells sizes `n_embd` etc.; transformers also accepts the common name."""
    return _dim(f, alias if not f.has(key) and f.has(alias) else key, default, limit=limit)


def _dropout(f: Fields, key: str, default: float) -> bool:
    p = f.float(key, default, minimum=0.0)
    if p > 1:
        raise InputError(f"{f._at(key)}: must be a probability in [0, 1], got {p}")
    return p > 0


def _parse_gpt2(f: Fields, family: str) -> Shape:
    """GPT-2: LayerNorm with bias, learned positions, fused qkv with biases, plain 4h GELU MLP, tied."""
    if f.has("add_cross_attention") and f.bool("add_cross_attention"):
        raise InputError(f"{f._at('add_cross_attention')}: cross-attention models are not supported")
    hidden = _alias(f, "n_embd", "hidden_size")
    heads = _alias(f, "n_head", "num_attention_heads")
    head_dim = _split_heads(f, hidden, heads, "n_head")
    positions = _alias(f, "n_positions", "max_position_embeddings", FAMILIES[family].max_positions)
    return Shape(
        hidden=hidden,
        layers=_alias(f, "n_layer", "num_hidden_layers", limit=MAX_LAYERS),
        heads=heads,
        kv_heads=heads,
        head_dim=head_dim,
        intermediate=_dim(f, "n_inner", 4 * hidden),
        vocab=_dim(f, "vocab_size"),
        positions=positions,
        max_seq_len=positions,
        tied=f.bool("tie_word_embeddings", True),
        gated_mlp=False,
        layer_norm=True,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        qk_norm=False,
        parallel_residual=False,
        block_dropout=_dropout(f, "resid_pdrop", 0.1),
        embed_dropout=_dropout(f, "embd_pdrop", 0.1),
    )


def _parse_neox(f: Fields, family: str) -> Shape:
    """GPT-NeoX (Pythia): LayerNorm with bias, partial rotary (no params), fused qkv, plain MLP, untied."""
    hidden = _dim(f, "hidden_size")
    heads = _dim(f, "num_attention_heads")
    attention_bias = f.bool("attention_bias", True)
    return Shape(
        hidden=hidden,
        layers=_dim(f, "num_hidden_layers", limit=MAX_LAYERS),
        heads=heads,
        kv_heads=heads,
        head_dim=_split_heads(f, hidden, heads, "num_attention_heads"),
        intermediate=_dim(f, "intermediate_size"),
        vocab=_dim(f, "vocab_size"),
        positions=0,
        max_seq_len=_dim(f, "max_position_embeddings", FAMILIES[family].max_positions),
        tied=f.bool("tie_word_embeddings", False),
        gated_mlp=False,
        layer_norm=True,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=True,
        qk_norm=False,
        parallel_residual=f.bool("use_parallel_residual", True),
        block_dropout=_dropout(f, "hidden_dropout", 0.0),
        embed_dropout=False,
    )


# The parser of each `Family.reader`: (the config's fields, its family) -> its Shape.
_READERS: dict[str, Callable[[Fields, str], Shape]] = {
    "decoder": _parse_decoder, "gpt2": _parse_gpt2, "gpt_neox": _parse_neox,
}


def shipped_models() -> list[str]:
    """Names of the model configs shipped in `traces/models/`, sorted."""
    found: list[str] = traces.names("models")  # tinypipe.traces: data files, untyped here
    return found


def config_path(name_or_path: str) -> tuple[Path, str]:
    """The config file for a shipped name, a config.json path, a directory holding one or a Hugging Face Hub id
    (`org/name`, through the Hugging Face cache: `hubcache.model_dir`), and a name (a Hub id's: its `name`).

    A shipped name wins over a directory of the same name; write `./name` for the directory. A local path wins
    over a Hub id.
    """
    shipped = traces.path("models", name_or_path) if "/" not in name_or_path else None
    if shipped is not None:
        return shipped, name_or_path
    p = Path(name_or_path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise InputError(f"{p}: directory holds no config.json")
        return p / "config.json", p.resolve().name
    if p.is_file():
        return p, (p.resolve().parent.name if p.name == "config.json" else p.stem)
    if is_hub_id(name_or_path):
        return model_dir(name_or_path) / CONFIG, name_or_path.split("/")[1]
    raise InputError(f"unknown model {name_or_path!r}: not a file or directory, a Hugging Face Hub id (org/name), "
                     f"nor a shipped model ({', '.join(shipped_models())})")


def load_config(name_or_path: str) -> dict[str, Any]:
    """The Hugging Face config dict of a model (shipped name or path), without tinypipe's extra keys."""
    path, _ = config_path(name_or_path)
    config = load_json(path)
    Fields(config, str(path))  # an object, or an InputError naming the file
    return {k: val for k, val in config.items() if k not in EXTRA_KEYS}


def load_model(name_or_path: str) -> ModelSpec:
    """A shipped model by name (`llama-3.1-8b`) or a path to a config.json / a directory holding one."""
    path, name = config_path(name_or_path)
    return from_hf_config(load_json(path), name=name, where=str(path))
