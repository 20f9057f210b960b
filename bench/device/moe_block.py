"""What one Qwen3-30B-A3B decoder block costs on this GPU, by how its experts run and how they are adapted.

    python3 bench/device/moe_block.py --out $OUT/moe_block.json [--tokens 4096 8192]

Per variant and token count: the forward (no autograd, as a recomputing schedule's FWD) and the recompute backward
(the forward again with autograd, then the backward), CUDA-event medians over --repeat runs after --warmup, bf16,
random init (the routing of random weights is near uniform), sequences of 2,048 tokens. Variants: `frozen` (no
adapters, nothing trained: the input's gradient only) with transformers' `grouped_mm` experts and with its `eager`
loop over the experts; `full` (every weight trained, `grouped_mm`); `lora-adapted` (LoRA r 16 on attention and
the experts, the experts computed with peft's adapted weight W + s B A made per call: `lora_experts.LoraParam`'s
fallback) and `lora-lowrank` (the same adapters computed per expert group as x W^T + s (x A^T) B^T, the path
`run` takes). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from blocktime import time_block
from torch import nn

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def block(experts_implementation: str) -> tuple[nn.Module, Any, int]:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding

    from tinypipe.backends.model.hf import load_source

    config = load_source("qwen3-30b-a3b").config
    config._attn_implementation = "sdpa"
    config._experts_implementation = experts_implementation
    layer = Qwen3MoeDecoderLayer(config, 0).to(device="cuda", dtype=torch.bfloat16)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.02)
    return layer, Qwen3MoeRotaryEmbedding(config).to("cuda"), int(config.hidden_size)


def with_lora(layer: nn.Module, rank: int, alpha: float) -> list[nn.Parameter]:
    from tinypipe.backends.model.lora_experts import inject_expert_lora
    from tinypipe.backends.model.lora_linear import LoraLinear

    attention = layer.self_attn
    for t in ATTENTION:
        setattr(attention, t, LoraLinear(getattr(attention, t), rank=rank, alpha=alpha, dropout=0.0))
    inject_expert_lora(layer.mlp, {"gate_up_proj": 2, "down_proj": 1}, rank=rank, alpha=alpha)
    params = [p for n, p in layer.named_parameters() if "lora_" in n]
    for p in params:
        p.data = p.data.float().cuda()
        nn.init.normal_(p, std=0.01)
        p.requires_grad_(True)
    return params


def measure(variant: str, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    from tinypipe.backends.model import lora_experts

    torch.manual_seed(0)
    layer, rope, hidden = block("eager" if variant == "frozen-eager" else "grouped_mm")
    for p in layer.parameters():
        p.requires_grad_(variant == "full")
    adapters = with_lora(layer, args.rank, args.alpha) if variant.startswith("lora") else []
    wrapper = layer.mlp.experts
    lowrank_taken = variant.startswith("lora") and lora_experts.lowrank_ok(wrapper._target()[0], wrapper.chain())
    if variant == "lora-adapted":
        lowrank_taken = False
    elif variant == "lora-lowrank" and not lowrank_taken:
        raise RuntimeError("lowrank_ok is false for this transformers' experts: the variant would time peft's path")
    seqs = max(1, tokens // 2048)
    x = torch.randn(seqs, tokens // seqs, hidden, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(x.shape[1], device="cuda")[None].expand(seqs, -1)
    pe = rope(x, pos)
    dy = torch.randn_like(x)
    trained = [*adapters, *(layer.parameters() if variant == "full" else [])]

    def run(h: torch.Tensor) -> torch.Tensor:
        out = layer(h, position_embeddings=pe, position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    lowrank = lora_experts.lowrank_ok
    if variant == "lora-adapted":
        lora_experts.lowrank_ok = lambda *a: False  # type: ignore[assignment]
    try:
        row = {"variant": variant, "tokens": tokens,
               **time_block(run, x, dy, trained, warmup=args.warmup, repeat=args.repeat),
               "adapter_params": sum(p.numel() for p in adapters), "lowrank_path": lowrank_taken,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    finally:
        lora_experts.lowrank_ok = lowrank  # type: ignore[assignment]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", nargs="+",
                   default=["frozen", "frozen-eager", "full", "lora-adapted", "lora-lowrank"])
    args = p.parse_args()
    rows = []
    for tokens in args.tokens:
        for v in args.variants:
            try:
                rows.append(measure(v, tokens, args))
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            except Exception as e:  # noqa: BLE001 - one variant's failure is a row, not the end of the table
                rows.append({"variant": v, "tokens": tokens, "error": f"{type(e).__name__}: {e}"[:300]})
            r = rows[-1]
            if "error" in r:
                print(f"{v:14s} {tokens:6d} failed: {r['error']}", flush=True)
            else:
                print(f"{v:14s} {tokens:6d} fwd {r['fwd_ms']:7.2f} ms  recompute+bwd {r['recompute_bwd_ms']:7.2f} ms"
                      f"  peak {r['peak_gib']:5.2f} GiB  (first {r['first_s']:.1f} s)", flush=True)
    import transformers

    doc = {"what": __doc__.splitlines()[0], "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "transformers": transformers.__version__, "rank": args.rank, "alpha": args.alpha,
           "repeat": args.repeat, "rows": rows, "date": time.strftime("%Y-%m-%d")}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
