"""What one Llama-3.1-8B decoder block costs on this GPU with a frozen base and LoRA adapters, by how they run.

    python3 bench/device/lora_block.py --out $OUT/lora_block.json [--tokens 8192] [--compile]

Per variant: the forward (no autograd, as a recomputing schedule's FWD) and the recompute backward (the
forward again with autograd, then the backward), CUDA-event medians over --repeat runs after --warmup.
Variants: `full` (every weight trained: the weight-gradient GEMMs), `frozen` (no adapters: the input's
gradient only), `peft-fp32` (peft's LoRA modules, fp32 adapters as peft keeps them beside a bf16 base:
the input is cast to fp32 for the adapters' GEMMs), `peft-autocast` (the same under
torch.autocast(bfloat16), as the Hugging Face Trainer runs bf16), `lora-bf16` (tinypipe's LoRA linear:
fp32 adapter masters cast to the compute dtype, the low-rank product added into the base output with one
addmm). Eager and, with --compile, torch.compile'd like `run --compile`. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from blocktime import time_block
from torch import nn

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def block(dtype: torch.dtype) -> tuple[nn.Module, Any]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=1, max_position_embeddings=8192, rope_theta=500000.0,
                      torch_dtype="bfloat16")
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0).to(device="cuda", dtype=dtype)
    return layer, LlamaRotaryEmbedding(cfg).to("cuda")


def with_lora(layer: nn.Module, variant: str, rank: int, alpha: float) -> list[nn.Parameter]:
    """Adapters into `layer` for `variant`; returns the trainable parameters (fp32)."""
    if variant.startswith("peft"):
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0),
                                layer)
        params = []
        for n, p in layer.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()
                p.requires_grad_(True)
                params.append(p)
        return params
    from tinypipe.backends.model.lora_linear import LoraLinear

    params = []
    for module in list(layer.modules()):
        for t in TARGETS:
            child = getattr(module, t, None)
            if isinstance(child, nn.Linear):
                wrapped = LoraLinear(child, rank=rank, alpha=alpha, dropout=0.0)
                wrapped.to("cuda")
                setattr(module, t, wrapped)
                params += [p for n, p in wrapped.named_parameters() if "lora_" in n]
    for p in params:
        nn.init.normal_(p, std=0.01)
    return params


def measure(variant: str, compiled: bool, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    layer, rope = block(torch.bfloat16)
    for p in layer.parameters():
        p.requires_grad_(variant == "full")
    adapters = with_lora(layer, variant, args.rank, args.alpha) if variant not in ("full", "frozen") else []
    x = torch.randn(args.tokens // 2048, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(2048, device="cuda")[None].expand(x.shape[0], -1)
    pe = rope(x, pos)
    dy = torch.randn_like(x)

    def run(h: torch.Tensor) -> torch.Tensor:
        out = layer(h, position_embeddings=pe, position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    fn = torch.compile(run, dynamic=False) if compiled else run
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if variant == "peft-autocast" else \
        (lambda: torch.autocast("cuda", enabled=False))

    trained = [*adapters, *(layer.parameters() if variant == "full" else [])]
    row = {"variant": variant, "compiled": compiled,
           **time_block(fn, x, dy, trained, warmup=args.warmup, repeat=args.repeat, ctx=ctx),
           "adapter_params": sum(p.numel() for p in adapters)}
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=["full", "frozen", "peft-fp32", "peft-autocast", "lora-bf16"])
    p.add_argument("--compile", action="store_true", help="also each variant torch.compile'd")
    args = p.parse_args()
    rows = []
    for compiled in ([False, True] if args.compile else [False]):
        for v in args.variants:
            try:
                rows.append(measure(v, compiled, args))
            except Exception as e:  # noqa: BLE001 - one variant's failure is a row, not the end of the table
                rows.append({"variant": v, "compiled": compiled, "error": f"{type(e).__name__}: {e}"[:300]})
            r = rows[-1]
            if "error" in r:
                print(f"{v:14s} {'compiled' if compiled else 'eager':8s} failed: {r['error']}", flush=True)
            else:
                print(f"{v:14s} {'compiled' if compiled else 'eager':8s} fwd {r['fwd_ms']:7.2f} ms  "
                      f"recompute+bwd {r['recompute_bwd_ms']:7.2f} ms  (first {r['first_s']:.1f} s)", flush=True)
    doc = {"what": __doc__.splitlines()[0], "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "tokens": args.tokens, "rank": args.rank, "alpha": args.alpha, "repeat": args.repeat, "rows": rows,
           "date": time.strftime("%Y-%m-%d")}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
