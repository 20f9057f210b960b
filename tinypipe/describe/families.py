"""The model families tinypipe reads, one row each: how its Hugging Face config is read and what trains it.

`hfconfig.py` reads a config by its family's row (`Family.reader` names the parser, the defaults fill what
the config leaves out); `model.py` takes the norm from it; `backends/model` splits into pipeline layers the
families whose row says `runs`, and trains LoRA on those whose row says `lora`. The defaults are the
transformers 5.x config classes', so that a config which omits a field describes the model transformers
would build from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One Hugging Face `model_type`."""

    reader: str  # the parser of its config in hfconfig.py: "decoder" (Llama-like), "gpt2" or "gpt_neox"
    max_positions: int  # `max_position_embeddings` when the config leaves it out
    layer_norm: bool = False  # LayerNorm with bias; else RMSNorm
    kv_heads: int | None = None  # decoder: `num_key_value_heads` when left out (None: as many as the heads)
    head_dim: int | None = None  # decoder: `head_dim` when left out (None: hidden size / heads)
    attention_bias: bool = False  # decoder: reads `attention_bias` (q, k, v and o biases)
    qkv_bias: bool = False  # decoder: q, k and v always have biases (o never)
    mlp_bias: bool = False  # decoder: reads `mlp_bias`
    qk_norm: bool = False  # decoder: RMSNorm of head_dim on q and k
    experts: tuple[int, int] | None = None  # a mixture-of-experts MLP: (experts, experts per token) when left out
    runs: bool = False  # `run` splits it into pipeline layers and trains it (backends/model/hf.py)
    lora: bool = False  # `run --lora` trains adapters on it (backends/model/lora_adapters.py)


FAMILIES: dict[str, Family] = {
    "llama": Family("decoder", 2048, attention_bias=True, mlp_bias=True, runs=True, lora=True),
    "mistral": Family("decoder", 131072, kv_heads=8, runs=True, lora=True),
    "qwen2": Family("decoder", 32768, kv_heads=32, qkv_bias=True, runs=True, lora=True),
    "qwen3": Family("decoder", 32768, kv_heads=32, head_dim=128, attention_bias=True, qk_norm=True, runs=True,
                    lora=True),
    "gpt2": Family("gpt2", 1024, layer_norm=True),
    "gpt_neox": Family("gpt_neox", 2048, layer_norm=True),
    "qwen3_moe": Family("decoder", 32768, kv_heads=4, attention_bias=True, qk_norm=True, experts=(128, 8),
                        runs=True, lora=True),
    "mixtral": Family("decoder", 131072, kv_heads=8, experts=(8, 2), runs=True, lora=True),
}

RUN_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.runs)  # what `run` trains
LORA_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.lora)  # what `run --lora` trains
MOE_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.experts is not None)
