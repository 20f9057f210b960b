"""Tests of tinypipe.describe.model: exact parameter counts, per-layer formulas, and input errors."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinypipe import traces
from tinypipe.common.errors import InputError
from tinypipe.describe.hfconfig import from_hf_config, load_config, load_model, shipped_models
from tinypipe.describe.model import (
    HEAD_CHUNK_BYTES,
    LayerKind,
    ModelSpec,
    head_chunk_tokens,
    head_workspace_bytes,
    head_workspace_fixed_bytes,
)

SHIPPED = ["gpt2-xl", "llama-3.1-70b", "llama-3.1-8b", "mistral-7b", "mixtral-8x7b", "pythia-1b", "qwen2-7b",
           "qwen3-1.7b", "qwen3-14b", "qwen3-235b-a22b", "qwen3-30b-a3b", "qwen3-32b", "qwen3-4b", "tiny-llama",
           "tiny-mixtral", "tiny-qwen3-moe"]

# Hand-sized configs (hidden 8, vocab 10) whose per-layer counts are worked out in the comments.
LLAMA_GQA = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 16, "vocab_size": 10, "num_hidden_layers": 2}
QWEN3_TIED = {"model_type": "qwen3", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 6, "intermediate_size": 4, "vocab_size": 10, "num_hidden_layers": 1,
              "tie_word_embeddings": True}
QWEN2_BIAS = {"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
              "intermediate_size": 4, "vocab_size": 10, "num_hidden_layers": 1}
GPT2_TINY = {"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1, "vocab_size": 10, "n_positions": 4}
NEOX_TINY = {"model_type": "gpt_neox", "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16,
             "vocab_size": 10, "num_hidden_layers": 1, "rotary_pct": 0.5}


def _params(spec: ModelSpec) -> list[tuple[str, int, int]]:
    return [(layer.name, layer.params, layer.gpu_params) for layer in spec.layers]


# --- exact counts of the shipped models -------------------------------------------------------------

def test_shipped_names() -> None:
    """Every shipped config is listed by name, sorted."""
    assert shipped_models() == SHIPPED


def test_llama_counts_literal() -> None:
    """Llama-3.1-8B and -70B have exactly their published parameter counts."""
    assert load_model("llama-3.1-8b").params == 8_030_261_248
    assert load_model("llama-3.1-70b").params == 70_553_706_496


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_matches_published(name: str) -> None:
    """A shipped config names its source and, where it gives a published count, matches it exactly."""
    spec = load_model(name)
    path = traces.path("models", name)
    assert path is not None
    raw = json.loads(path.read_text())
    assert raw["_source"] and raw["_source"] in spec.source
    assert spec.published_params == raw.get("_published_params")
    if spec.published_params is not None:
        assert spec.params == spec.published_params
    assert len(spec.layers) == spec.num_blocks + 2
    assert [layer.index for layer in spec.layers] == list(range(len(spec.layers)))


def test_counts_without_published_number() -> None:
    """Models without an exact published count: the count is the config arithmetic, pinned here."""
    # Qwen3-1.7B, tied: 28 x 50,336,000 (block) + 151,936 x 2048 (embedding, once) + 2048 (norm).
    # Qwen publish "1.7B (1.4B non-embedding)". The 2,031,739,904 sometimes quoted counts the tied
    # matrix twice, as a checkpoint storing lm_head.weight separately would.
    qwen3 = load_model("qwen3-1.7b")
    assert qwen3.params == 1_720_574_976
    assert qwen3.params + qwen3.vocab_size * qwen3.hidden_size == 2_031_739_904
    assert sum(layer.gpu_params for layer in qwen3.layers) == 2_031_739_904
    # Qwen2-7B: 28 x 233,057,792 + 2 x 152,064 x 3584 + 3584 (Qwen publish "7.6B"; 6.53B non-embedding).
    assert load_model("qwen2-7b").params == 7_615_616_512
    # tiny-llama is tinypipe's own: 4 x 36,992 + 2 x 256 x 64 + 64.
    assert load_model("tiny-llama").params == 180_800


def test_block_names_and_kinds() -> None:
    """The layer sequence is embed, block.0 .. block.L-1, head."""
    spec = load_model("tiny-llama")
    names = ["embed", "block.0", "block.1", "block.2", "block.3", "head"]
    assert [layer.name for layer in spec.layers] == names
    assert [layer.kind for layer in spec.layers] == [LayerKind.EMBED, *[LayerKind.BLOCK] * 4, LayerKind.HEAD]


# --- hand-computed tiny configs -----------------------------------------------------------------------

def test_gqa_untied_llama() -> None:
    """GQA shrinks k/v to kv_heads x head_dim; an untied head owns norm + vocab x hidden."""
    spec = from_hf_config(LLAMA_GQA, name="t")
    # head_dim 2; q 8x8, k 8x4, v 8x4, o 8x8 = 192; SwiGLU 3 x 8 x 16 = 384; two RMSNorms 16.
    assert _params(spec) == [("embed", 80, 80), ("block.0", 592, 592), ("block.1", 592, 592),
                             ("head", 88, 88)]
    assert spec.params == 80 + 2 * 592 + 88
    assert [(lay.linear_flops_per_token, lay.attn_flops_per_token_per_ctx) for lay in spec.layers] == [
        (0.0, 0.0), (1152.0, 32.0), (1152.0, 32.0), (160.0, 0.0)]
    # block: 2 x (h + h + q + 2kv + q + h + h + 4i) + 4 x heads = 2 x 120 + 16; head (chunked, nothing
    # per vocabulary entry): RMSNorm's fp32 input 4h + normalised 2h + rstd 4, normed 2h, labels 8, lse 4
    assert [(lay.saved_act_bytes_per_token, lay.boundary_bytes_per_token) for lay in spec.layers] == [
        (0, 16), (256, 16), (256, 16), (80, 16)]
    assert spec.layers[1].fwd_flops_per_token(64) == 1152 + 32 * 32
    assert spec.layers[1].param_bytes() == 2 * 592 and spec.layers[1].param_bytes("fp32") == 4 * 592


def test_tied_qwen3_head_dim_override() -> None:
    """Tied head owns only its norm but needs the embedding on the GPU; head_dim overrides hidden/heads."""
    spec = from_hf_config(QWEN3_TIED, name="t")
    # q 8x12, k 8x6, v 8x6, o 12x8 = 288; q_norm + k_norm 12; SwiGLU 96; norms 16.
    assert _params(spec) == [("embed", 80, 80), ("block.0", 412, 412), ("head", 8, 88)]
    assert spec.params == 500 and spec.tied_embeddings
    assert spec.layers[1].attn_flops_per_token_per_ctx == 4 * 2 * 6


def test_qwen2_qkv_bias() -> None:
    """Qwen2 adds q/k/v biases (not o) whatever attention_bias says."""
    spec = from_hf_config(QWEN2_BIAS, name="t")
    # 4 x 64 weights + 3 x 8 biases + 96 MLP + 16 norms.
    assert _params(spec) == [("embed", 80, 80), ("block.0", 392, 392), ("head", 88, 88)]
    assert from_hf_config(dict(QWEN2_BIAS, attention_bias=False), name="t").params == spec.params


def test_llama_biases() -> None:
    """Llama's attention_bias adds q/k/v/o biases and mlp_bias adds gate/up/down biases."""
    spec = from_hf_config(dict(LLAMA_GQA, attention_bias=True, mlp_bias=True), name="t")
    # 592 + (8 + 4 + 4 + 8) attention biases + (16 + 16 + 8) MLP biases.
    assert [layer.params for layer in spec.layers] == [80, 656, 656, 88]


def test_gpt2_tiny() -> None:
    """GPT-2: learned positions in embed, LayerNorm and linear biases, 4h MLP, tied head."""
    spec = from_hf_config(GPT2_TINY, name="t")
    # embed 10x8 + 4x8; block ln 16 + c_attn 192+24 + c_proj 64+8 + ln 16 + fc 256+32 + proj 256+8.
    assert _params(spec) == [("embed", 112, 112), ("block.0", 872, 872), ("head", 16, 96)]
    assert spec.max_seq_len == 4
    # dropout on by default: 2 x (2h + 3h + h + h + h + 2 x 32) + 4 x 2 heads + 2h mask bytes
    assert spec.layers[1].saved_act_bytes_per_token == 2 * (8 * 8 + 64) + 8 + 16
    assert spec.layers[0].saved_act_bytes_per_token == 8
    no_dropout = from_hf_config(dict(GPT2_TINY, resid_pdrop=0.0, embd_pdrop=0), name="t")
    assert no_dropout.layers[1].saved_act_bytes_per_token == 2 * (8 * 8 + 64) + 8
    assert from_hf_config(dict(GPT2_TINY, n_inner=16), name="t").layers[1].params == 872 - 2 * 8 * 16 - 16


def test_neox_tiny() -> None:
    """GPT-NeoX: untied embed_out, biases, LayerNorms; rotary_pct and parallel residual change no params."""
    spec = from_hf_config(NEOX_TINY, name="t")
    # lns 32 + qkv 192+24 + dense 64+8 + fc 128+16 + proj 128+8.
    assert _params(spec) == [("embed", 80, 80), ("block.0", 600, 600), ("head", 96, 96)]
    assert from_hf_config(dict(NEOX_TINY, rotary_pct=1.0), name="t").params == spec.params
    sequential = from_hf_config(dict(NEOX_TINY, use_parallel_residual=False), name="t")
    assert sequential.params == spec.params
    assert sequential.layers[1].saved_act_bytes_per_token == spec.layers[1].saved_act_bytes_per_token + 16
    assert from_hf_config(dict(NEOX_TINY, attention_bias=False), name="t").params == spec.params - 24 - 8


def test_head_sizes_follow_the_chunked_head() -> None:
    """The head keeps 8h + 16 bytes per token with RMSNorm (4h + 20 with LayerNorm), nothing per
    vocabulary entry; its workspace is the larger of 2h per token + one 523-token chunk of logits
    (6 bytes each) and RMSNorm's fp32 backward, 16h per token: the H200 measurement of the chunked
    Llama-3.1-8B head, at 2,048 to 16,384 tokens."""
    llama = load_model("llama-3.1-8b")
    h, v = 4096, 128_256
    assert llama.layers[-1].saved_act_bytes_per_token == 8 * h + 16 == 32_784
    assert HEAD_CHUNK_BYTES == 256 * 2**20 and head_chunk_tokens(v) == 523 == HEAD_CHUNK_BYTES // (4 * v)
    chunk = 6 * 523 * v  # 383.8 MiB
    assert head_workspace_fixed_bytes(llama, 8192) == chunk and head_workspace_fixed_bytes(llama, 100) == 600 * v
    assert [head_workspace_bytes(llama, t) for t in (100, 2048, 4096, 8192, 16384)] == [
        2 * h * 100 + 6 * 100 * v, 2 * h * 2048 + chunk, 2 * h * 4096 + chunk, 16 * h * 8192, 16 * h * 16384]
    assert from_hf_config(GPT2_TINY, name="t").layers[-1].saved_act_bytes_per_token == 4 * 8 + 20
    assert head_chunk_tokens(2**40) == 1


# --- agreement with transformers ----------------------------------------------------------------------

def _layer_of(param_name: str) -> str:
    """Which pipeline layer a transformers parameter belongs to."""
    m = re.search(r"\.(?:layers|h)\.(\d+)\.", param_name)
    if m:
        return f"block.{m.group(1)}"
    if re.search(r"embed_tokens|\.wte\.|\.wpe\.|embed_in", param_name):
        return "embed"
    return "head"


def _hf_layer_params(config: dict[str, Any], *, meta: bool) -> dict[str, int]:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.for_model(**config)
    if meta:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    else:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    counts: dict[str, int] = {}
    for param_name, p in model.named_parameters():  # a tied weight is listed once
        counts[_layer_of(param_name)] = counts.get(_layer_of(param_name), 0) + p.numel()
    return counts


TINY_HF = {
    "tiny-llama": load_config("tiny-llama"),
    "qwen3": {**QWEN3_TIED, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 64, "attention_bias": True},
    "gpt2": {**GPT2_TINY, "n_embd": 32, "n_head": 4, "n_layer": 2, "vocab_size": 64, "n_positions": 16,
             "bos_token_id": 0, "eos_token_id": 0},
    "qwen2": {**QWEN2_BIAS, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2},
    "neox": {**NEOX_TINY, "attention_bias": False, "tie_word_embeddings": True, "bos_token_id": 0,
             "eos_token_id": 0},
    "llama-biases": {**LLAMA_GQA, "attention_bias": True, "mlp_bias": True, "head_dim": 3},
    "mistral": {**LLAMA_GQA, "model_type": "mistral"},
    "qwen3-kv-null": {**QWEN2_BIAS, "model_type": "qwen3", "num_key_value_heads": None, "head_dim": 4},
}


@pytest.mark.parametrize("key", sorted(TINY_HF))
def test_tiny_matches_transformers(key: str) -> None:
    """Each layer's params equal those of the transformers model built (random init) from the same config."""
    spec = from_hf_config(TINY_HF[key], name=key)
    assert _hf_layer_params(TINY_HF[key], meta=False) == {layer.name: layer.params for layer in spec.layers}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_match_transformers(name: str) -> None:
    """Each shipped model's per-layer params equal transformers' for the same config (on the meta device)."""
    spec = load_model(name)
    expected = {layer.name: layer.params for layer in spec.layers}
    assert _hf_layer_params(load_config(name), meta=True) == expected


# --- loading and errors --------------------------------------------------------------------------------

def test_load_paths(tmp_path: Path) -> None:
    """load_model takes a config.json path or a directory holding one, and records the file as source."""
    (tmp_path / "my-model").mkdir()
    cfg = tmp_path / "my-model" / "config.json"
    cfg.write_text(json.dumps(LLAMA_GQA))
    for arg in (str(cfg), str(tmp_path / "my-model")):
        spec = load_model(arg)
        assert (spec.name, spec.params, spec.source, spec.family) == ("my-model", 1352, str(cfg), "llama")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(LLAMA_GQA, _source="made by hand")))
    spec = load_model(str(other))
    assert (spec.name, spec.source) == ("other", f"{other} (made by hand)")


@pytest.mark.parametrize(("config", "message"), [
    ([1, 2], "llama.json: expected a JSON object, got a list"),
    ({**LLAMA_GQA, "num_hidden_layers": 0}, "llama.json: num_hidden_layers: must be >= 1, got 0"),
    ({**LLAMA_GQA, "hidden_size": -8}, "llama.json: hidden_size: must be >= 1, got -8"),
    ({**LLAMA_GQA, "vocab_size": "10"}, "llama.json: vocab_size: expected an integer, got the string '10'"),
    ({k: v for k, v in LLAMA_GQA.items() if k != "intermediate_size"},
     "llama.json: intermediate_size: missing required field"),
    ({**LLAMA_GQA, "model_type": "bert"},
     "llama.json: model_type: must be one of llama, mistral, qwen2, qwen3, gpt2, gpt_neox, qwen3_moe, mixtral; "
     "got 'bert'"),
    ({**LLAMA_GQA, "num_attention_heads": 3, "num_key_value_heads": 3},
     "llama.json: num_attention_heads: 3 heads do not divide the hidden size 8 "
     "(give head_dim, or fix the sizes)"),
    ({**LLAMA_GQA, "num_key_value_heads": 3}, "llama.json: num_key_value_heads: 3 does not divide the 4 "
     "attention heads"),
    ({**LLAMA_GQA, "tie_word_embeddings": 1}, "llama.json: tie_word_embeddings: expected true or false, "
     "got the number 1"),
    ({**LLAMA_GQA, "num_hidden_layers": 10**6},
     "llama.json: num_hidden_layers: must be <= 10000, got 1000000"),
    ({**GPT2_TINY, "resid_pdrop": 2}, "llama.json: resid_pdrop: must be a probability in [0, 1], got 2.0"),
    ({**GPT2_TINY, "add_cross_attention": True},
     "llama.json: add_cross_attention: cross-attention models are not supported"),
])
def test_errors_name_file_and_field(config: Any, message: str) -> None:
    """Bad configs raise InputError whose one-line message names the file and the field."""
    with pytest.raises(InputError) as info:
        from_hf_config(config, name="t", where="llama.json")
    assert str(info.value) == message


def test_unknown_name_lists_shipped() -> None:
    """An unknown model name is an InputError that lists the shipped names."""
    with pytest.raises(InputError, match="unknown model 'llama-9'.*llama-3.1-8b, mistral-7b"):
        load_model("llama-9")


def test_directory_without_config(tmp_path: Path) -> None:
    """A directory without config.json is an InputError naming the directory."""
    with pytest.raises(InputError, match="directory holds no config.json"):
        load_model(str(tmp_path))


# --- properties -------------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
VALID = [LLAMA_GQA, QWEN3_TIED, QWEN2_BIAS, GPT2_TINY, NEOX_TINY, {**LLAMA_GQA, "model_type": "mistral"}]
KEYS = sorted({k for c in VALID for k in c} | {"head_dim", "n_inner", "attention_bias", "mlp_bias",
                                                 "resid_pdrop", "hidden_size", "_published_params", "_source",
                                                 "max_position_embeddings", "use_parallel_residual"})
VALUES = (JSON | st.integers(min_value=-(2**70), max_value=2**70)
          | st.sampled_from([0, -1, 1, 2, 3, 1e300, 0.5, float("nan"), float("inf")]))


def _check_spec(spec: ModelSpec) -> None:
    assert len(spec.layers) == spec.num_blocks + 2
    assert spec.params == sum(layer.params for layer in spec.layers)
    for layer in spec.layers:
        assert 0 < layer.params <= layer.gpu_params and layer.saved_act_bytes_per_token >= 0


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_arbitrary_json_only_input_error(value: Any) -> None:
    """Any JSON value either builds a spec or raises InputError, never another exception."""
    try:
        _check_spec(from_hf_config(value, name="t"))
    except InputError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VALID),
       st.lists(st.tuples(st.sampled_from(KEYS), st.none() | VALUES, st.booleans()), min_size=1, max_size=4))
def test_mutated_config_only_input_error(base: dict[str, Any], edits: list[tuple[str, Any, bool]]) -> None:
    """Deleting keys or setting wrong types / bad numbers in a valid config only ever raises InputError."""
    config = dict(base)
    for key, value, delete in edits:
        if delete:
            config.pop(key, None)
        else:
            config[key] = value
    try:
        _check_spec(from_hf_config(config, name="t", where="m.json"))
    except InputError as exc:
        assert str(exc).startswith("m.json: ") and "\n" not in str(exc)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()))
def test_load_random_file_only_input_error(data: bytes) -> None:
    """load_model on a file of random bytes (or of arbitrary JSON) only raises InputError."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_bytes(data)
        try:
            _check_spec(load_model(str(path)))
        except InputError:
            pass
