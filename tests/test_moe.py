"""Mixture-of-experts models in the core: total vs active parameters, per-layer formulas, config errors, the
analytic trace, LoRA sizes and `inspect coverage` / `inspect model`."""

from __future__ import annotations

import json

import pytest

from tinypipe.cli import main
from tinypipe.common.errors import InputError
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import from_hf_config, load_model
from tinypipe.describe.model import experts_hit, read_weight_bytes
from tinypipe.describe.trace import analytic_trace
from tinypipe.estimate.coverage import MOE_COVERAGE_MODELS, moe_coverage
from tinypipe.estimate.lora_costs import adapter_params
from tinypipe.policy.lora_spec import ROLES, LoraSpec

# Hand-sized Qwen3-MoE: hidden 8, 2 heads of 4 (1 kv head), 4 experts of width 4, 2 a token, layer 1 dense (width 16).
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 4, "intermediate_size": 16, "moe_intermediate_size": 4, "num_experts": 4,
             "num_experts_per_tok": 2, "num_hidden_layers": 3, "mlp_only_layers": [1], "vocab_size": 10}


def test_published_models_total_and_active() -> None:
    """Qwen3-30B-A3B, Qwen3-235B-A22B and Mixtral-8x7B: their published totals exactly (the shipped configs say
    so) and the active parameters their names and cards give (3.3B, 22B, 12.9B)."""
    got = {n: (load_model(n).params, load_model(n).active_params)
           for n in ("qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b")}
    assert got == {"qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
                   "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520),
                   "mixtral-8x7b": (46_702_792_704, 12_879_925_248)}
    block = load_model("qwen3-30b-a3b").layers[1]
    assert (block.experts, block.experts_per_token, block.expert_params) == (128, 8, 3 * 2048 * 768)
    assert block.expert_bytes("bf16") == 2 * 3 * 2048 * 768 and block.gpu_params == block.params  # uploads them all


def test_hand_sized_qwen3_moe_layers() -> None:
    """Per layer, worked by hand. Sparse block: attention q 64 + k 32 + v 32 + o 64 = 192, q/k norms 8, two norms
    16, router 4 x 8 = 32, experts 4 x 3 x 8 x 4 = 384: 632, of which 632 - 2 x 96 = 440 active; FLOPs 2 x (192 +
    32 + 2 x 96). Dense layer 1: 192 + 3 x 8 x 16 + 16 + 8 = 600. Saved bytes: 2 x (16 + 12 + 16 + 8 + 8 + 8 + 2
    x (2 x 8 + 4 x 4)) + 4 x 2 (lse) + 4 x 4 (router softmax) = 288; the dense layer's MLP keeps 4 x 16: 272."""
    spec = from_hf_config(QWEN3_MOE, name="t")
    rows = [(x.name, x.params, x.active_params, x.linear_flops_per_token, x.saved_act_bytes_per_token, x.experts)
            for x in spec.layers]
    assert rows == [("embed", 80, 80, 0.0, 0, 0), ("block.0", 632, 440, 832.0, 288, 4),
                    ("block.1", 600, 600, 1152.0, 272, 0), ("block.2", 632, 440, 832.0, 288, 4),
                    ("head", 88, 88, 160.0, 80, 0)]
    assert spec.params == 2032 and spec.active_params == 1648 and spec.is_moe
    assert spec.layers[1].expert_linears == (("gate+up", 8, 8), ("down", 4, 8))
    # peft gives a MoE model's MLP roles to the experts: the dense layer's MLP takes no LoRA
    assert [roles for roles, _, _ in spec.layers[2].linears] == ["q", "k", "v", "o"]
    # decoder_sparse_step 2: layers 1 and 3 of 4 are sparse (transformers: (k + 1) % step == 0)
    step2 = from_hf_config({**QWEN3_MOE, "mlp_only_layers": [], "decoder_sparse_step": 2, "num_hidden_layers": 4},
                           name="t")
    assert [x.experts for x in step2.layers[1:-1]] == [0, 4, 0, 4]


def test_mixtral_names_its_experts_num_local_experts() -> None:
    """Mixtral's experts are `intermediate_size` wide, in every layer; `num_local_experts` counts them."""
    spec = from_hf_config({"model_type": "mixtral", "hidden_size": 8, "num_attention_heads": 2,
                           "num_key_value_heads": 2, "intermediate_size": 4, "num_local_experts": 3,
                           "num_experts_per_tok": 1, "num_hidden_layers": 2, "vocab_size": 10}, name="t")
    assert [(x.experts, x.experts_per_token, x.expert_params) for x in spec.layers[1:-1]] == [(3, 1, 96)] * 2
    dense = load_model("qwen3-32b")
    assert not dense.is_moe and dense.active_params == dense.params


@pytest.mark.parametrize(("change", "words"), [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok: 5 experts per token, but the layer has 4"),
    ({"mlp_only_layers": [3]}, "mlp_only_layers: 3 is not a layer index in 0..2"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers: expected a list"),
    ({"num_experts": 0}, "num_experts"),
])
def test_bad_moe_configs_name_the_field(change: dict[str, object], words: str) -> None:
    """A MoE config that cannot describe a model is a one-line error naming the field."""
    with pytest.raises(InputError, match=words):
        from_hf_config({**QWEN3_MOE, **change}, name="t", where="cfg.json")


def test_router_jitter_is_refused() -> None:
    """Mixtral's router jitter (training noise on the router's input) is refused, by name."""
    with pytest.raises(InputError, match="router_jitter_noise"):
        from_hf_config({"model_type": "mixtral", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
                        "intermediate_size": 4,
                        "num_hidden_layers": 1, "vocab_size": 10, "router_jitter_noise": 0.1}, name="t")


def test_experts_hit_and_weight_reads() -> None:
    """A token reads its k experts; a microbatch reads the experts expected to get any of its tokens, E (1 - (1 -
    k / E)^T): all 128 of Qwen3-30B-A3B's at 2,048 tokens, 2 of 4 for one token, none for none."""
    block = from_hf_config(QWEN3_MOE, name="t").layers[1]
    assert (experts_hit(block, 0), experts_hit(block, 1), experts_hit(block, 2)) == (0.0, 2.0, 3.0)
    assert read_weight_bytes(block, 1) == 2 * 440 and read_weight_bytes(block, 10**6) == 2 * 632
    big = load_model("qwen3-30b-a3b").layers[1]
    assert experts_hit(big, 2048) == pytest.approx(128) and read_weight_bytes(big, 2048) == big.param_bytes()


def test_analytic_trace_of_a_moe_model_counts_active_flops_and_says_so() -> None:
    """The analytic trace's MoE block costs its active FLOPs (plus reading every expert, as 2,048 tokens route to
    all): Qwen3-30B-A3B's block (623M parameters, 83M active) takes more than its active GEMMs and less than
    GEMMs over all 623M would, and the trace's source says the MoE times are analytic."""
    gpu = load_hardware("h200x1").gpus[0]
    moe = load_model("qwen3-30b-a3b")
    trace = analytic_trace(moe, gpu, microbatch_size=1, seq_len=2048)
    assert "MoE blocks, none measured" in trace.source
    assert "MoE" not in analytic_trace(load_model("qwen3-32b"), gpu, microbatch_size=1, seq_len=2048).source
    block = moe.layers[1]
    assert block.linear_flops_per_token == 2 * (block.active_params - 2 * 2048 - 2 * 128)  # less the norms
    gemm_s = 2048 * block.fwd_flops_per_token(2048) / (0.7 * gpu.matmul_flops)
    assert gemm_s < trace.kinds["block"].fwd_s < 2048 * 2 * block.params / (0.7 * gpu.matmul_flops)


def test_lora_on_experts_counts_each_expert_at_pefts_ranks() -> None:
    """LoRA r on all seven roles of a sparse block: attention r (in + out) each, 4 x 4 x (8 + 8) + 4 x (8 + 4) x 2
    = 352; each of 4 experts' gate/up at 2 r (peft fuses gate and up), 8 x (8 + 8), and down at r, 4 x (4 + 8):
    4 x (128 + 48) = 704."""
    spec = from_hf_config(QWEN3_MOE, name="t")
    lora = LoraSpec(rank=4, alpha=8.0, targets=ROLES)
    assert adapter_params(spec.layers[1], lora) == 4 * (8 + 8) * 2 + 4 * (8 + 4) * 2 + 704
    assert adapter_params(spec.layers[2], lora) == 4 * (8 + 8) * 2 + 4 * (8 + 4) * 2  # the dense layer: attention
    assert adapter_params(spec.layers[1], LoraSpec(rank=4, targets=("q", "v"))) == 4 * 16 + 4 * 12


def test_moe_coverage_per_shipped_box() -> None:
    """Each box as it is: Qwen3-30B-A3B fully fine-tunes on the 2x H200 host (252 GiB) with bf16 or 8-bit moments
    and on the 1 TiB RTX 4090 server at every precision; Qwen3-235B-A22B only with LoRA there (its bf16 base is
    438 GiB) and not at all on the H200 host."""
    models = [load_model(n) for n in MOE_COVERAGE_MODELS]
    got = {hw: {r["model"]: [r[k] for k in ("tinypipe fp32", "tinypipe bf16", "tinypipe 8bit", "tinypipe LoRA")]
                for r in moe_coverage(load_hardware(hw), models)} for hw in ("h200x2", "rtx4090x8-pcie4")}
    assert got == {"h200x2": {"qwen3-30b-a3b": [False, True, True, True],
                              "qwen3-235b-a22b": [False, False, False, False]},
                   "rtx4090x8-pcie4": {"qwen3-30b-a3b": [True, True, True, True],
                                       "qwen3-235b-a22b": [False, False, False, True]}}


def test_inspect_coverage_and_model_show_moe(capsys: pytest.CaptureFixture[str]) -> None:
    """`inspect coverage` lists both Qwen3 MoE models for every box (JSON and text); `inspect model` prints the
    active parameters beside the total."""
    assert main(["inspect", "coverage", "--hardware", "h200x1", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["moe_models"] == ["qwen3-30b-a3b", "qwen3-235b-a22b"]
    assert [r["model"] for r in rep["servers"][0]["moe"]] == rep["moe_models"]
    assert main(["inspect", "coverage", "--hardware", "h200x1"]) == 0
    text = capsys.readouterr().out
    assert "Mixture-of-experts models" in text and "qwen3-235b-a22b" in text
    assert main(["inspect", "model", "qwen3-30b-a3b", "--hardware", "h200x1"]) == 0
    out = capsys.readouterr().out
    assert "30,532,122,624 parameters" in out and "3,353,032,704 parameters active per token (8 of 128" in out
