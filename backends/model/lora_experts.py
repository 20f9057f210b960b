"""LoRA on a MoE layer's experts with peft's structure and names: `LoraParam`, peft's `ParamWrapper` of one 3-D weight.

transformers keeps a MoE MLP's experts as two 3-D weights, `gate_up_proj` [E, 2 m, h] and `down_proj` [E, h, m]
(Qwen3-MoE, Mixtral). peft adapts them through `target_parameters` (`mlp.experts.gate_up_proj`, ...): a
`ParamWrapper` per weight, nested around the experts module in the order the module declares them (the first
innermost), each holding `lora_A.default` [r E, in] and `lora_B.default` [out, r E]. Expert e's weight becomes
W_e + (alpha / r) B_e A_e, with A_e the rows e r .. e r + r - 1 of A and B_e the columns e, E + e, ... of B:
peft's `get_delta_factors` and its `baddbmm` over the experts, in the weight's dtype. peft refuses dropout here.
The experts module then computes with that weight (through `functional_call`), so routing, the expert loop and
its kernels stay transformers' own.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from .lora_linear import ADAPTER


class LoraParam(nn.Module):
    """peft's `ParamWrapper` of the 3-D expert weight `parameter_name` of the experts module (maybe wrapped)."""

    def __init__(self, base: nn.Module, parameter_name: str, *, rank: int, alpha: float) -> None:
        super().__init__()
        self.base_layer = base
        self.parameter_name = parameter_name
        experts, _ = self._target()
        weight = getattr(experts, parameter_name)
        count, out_features, in_features = weight.shape
        self.num_experts, self.rank, self.scaling = count, rank, alpha / rank
        self.lora_A = nn.ModuleDict({ADAPTER: nn.Linear(in_features, rank * count, bias=False, device=weight.device)})
        self.lora_B = nn.ModuleDict({ADAPTER: nn.Linear(rank * count, out_features, bias=False, device=weight.device)})
        self.lora_dropout = nn.ModuleDict({ADAPTER: nn.Identity()})

    def _target(self) -> tuple[nn.Module, str]:
        """(the experts module, the wrapped weight's name relative to `base_layer`)."""
        module, path = self.base_layer, list[str]()
        while isinstance(module, LoraParam):
            module, path = module.base_layer, [*path, "base_layer"]
        return module, ".".join([*path, self.parameter_name])

    def weight(self) -> torch.Tensor:
        """The adapted weight: W + scaling x B_e A_e per expert (peft's `_LoraFactorsProxy`)."""
        experts, _ = self._target()
        base: torch.Tensor = getattr(experts, self.parameter_name)
        a_weight, b_weight = cast(nn.Linear, self.lora_A[ADAPTER]).weight, cast(nn.Linear, self.lora_B[ADAPTER]).weight
        a = a_weight.to(base.dtype).reshape(self.num_experts, self.rank, -1)  # (E, r, in)
        b = b_weight.to(base.dtype).reshape(-1, self.rank, self.num_experts).permute(2, 0, 1)  # (E, out, r)
        return torch.baddbmm(base, b, a, alpha=self.scaling)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _, path = self._target()
        return torch.func.functional_call(self.base_layer, {path: self.weight()}, args, kwargs, strict=False)


def expert_modules(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, child name) of every experts module of `module`'s MoE MLPs (a module with `experts` and `gate`)."""
    out: list[tuple[nn.Module, str]] = []
    for m in module.modules():
        if isinstance(getattr(m, "gate", None), nn.Module) and isinstance(getattr(m, "experts", None), nn.Module):
            out.append((m, "experts"))
    return out


def inject_expert_lora(module: nn.Module, ranks: dict[str, int], *, rank: int, alpha: float) -> None:
    """Wrap the expert weights of `module` that `ranks` names (`gate_up_proj`, `down_proj`) in `LoraParam`s of
    `ranks[name]` x `rank` and x `alpha`, nested in the experts module's declaration order as peft does (in place)."""
    for parent, name in expert_modules(module):
        experts = getattr(parent, name)
        wrapped = experts
        for pname, p in experts.named_parameters(recurse=False):
            if pname in ranks and p.dim() == 3:
                wrapped = LoraParam(wrapped, pname, rank=ranks[pname] * rank, alpha=ranks[pname] * alpha)
        setattr(parent, name, wrapped)
