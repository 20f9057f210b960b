"""A LoRA linear with peft's structure and parameter names, computed in the block's compute dtype.

`LoraLinear(base)` holds what peft's `lora_adapters.Linear` holds under the same names (`base_layer`,
`lora_A.default`, `lora_B.default`, `lora_dropout.default`), so the renames of a LOAD and the keys of the
saved adapter are peft's. Its forward is W x + s B A dropout(x), s = alpha / r, with the adapters' fp32
masters cast to the input's dtype (bf16 on a GPU) and the low-rank product added into the base output
by one addmm: what peft computes under `torch.autocast(bfloat16)`, as the Hugging Face Trainer runs
bf16. peft outside autocast keeps the adapters in fp32 beside a bf16 base and casts every input to fp32
for their GEMMs; on an H200 that made an 8B block's recompute-and-backward much slower than the
frozen block alone (`bench/device/lora_block.py`). In fp32 (the CPU) the two compute the same values up to
the order of one addition.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER = "default"  # peft's adapter name


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base_layer = base
        w = base.weight
        self.lora_A = nn.ModuleDict({ADAPTER: nn.Linear(base.in_features, rank, bias=False, device=w.device)})
        self.lora_B = nn.ModuleDict({ADAPTER: nn.Linear(rank, base.out_features, bias=False, device=w.device)})
        self.lora_dropout = nn.ModuleDict({ADAPTER: nn.Dropout(dropout) if dropout > 0 else nn.Identity()})
        self.scaling = alpha / rank
        self.in_features, self.out_features = base.in_features, base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        a = cast(nn.Linear, self.lora_A[ADAPTER]).weight.to(x.dtype)
        b = cast(nn.Linear, self.lora_B[ADAPTER]).weight.to(x.dtype)
        h = F.linear(self.lora_dropout[ADAPTER](x), a)
        out = torch.addmm(y.reshape(-1, self.out_features), h.reshape(-1, h.shape[-1]), b.t(), alpha=self.scaling)
        return out.view(y.shape)


def inject_lora(module: nn.Module, targets: set[str], *, rank: int, alpha: float, dropout: float) -> None:
    """Replace every `nn.Linear` of `module` whose own name is in `targets` by a `LoraLinear` around it (in place)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(parent, name, LoraLinear(child, rank=rank, alpha=alpha, dropout=dropout))
