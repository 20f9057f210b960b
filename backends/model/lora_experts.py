"""LoRA on a MoE layer's experts with peft's structure and names: `LoraParam`, peft's `ParamWrapper` of one 3-D weight.

transformers keeps a MoE MLP's experts as two 3-D weights, `gate_up_proj` [E, 2 m, h] and `down_proj` [E, h, m]
(Qwen3-MoE, Mixtral). peft adapts them through `target_parameters` (`mlp.experts.gate_up_proj`, ...): a
`ParamWrapper` per weight, nested around the experts module in the order the module declares them (the first
innermost), each holding `lora_A.default` [r E, in] and `lora_B.default` [out, r E]. Expert e's weight becomes
W_e + (alpha / r) B_e A_e, with A_e the rows e r .. e r + r - 1 of A and B_e the columns e, E + e, ... of B:
peft's `get_delta_factors` and its `baddbmm` over the experts, in the weight's dtype. peft refuses dropout here.

peft hands the experts module that adapted weight (`functional_call`): every forward writes a new copy of all E
experts' weights, and the backward a gradient of that size, for every expert whether or not a token routed to it.
For transformers' gated experts (`lowrank_ok`: Qwen3-MoE, Mixtral), the outermost wrapper computes instead what
that weight computes, row by row, without making it: the tokens sorted by expert, x W_e^T + scaling (x A_e^T) B_e^T
per expert group (`torch.nn.functional.grouped_mm` on a GPU, a loop over the experts elsewhere), the gate, the
down projection the same way, the routing weights, the rows back in token order and summed over the top k, as
transformers' `grouped_mm` experts do. Other experts modules get peft's path.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
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
        a, b = self.factors(base.dtype)
        return torch.baddbmm(base, b, a, alpha=self.scaling)

    def factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A as [E, r, in], B as [E, out, r]) in `dtype`: expert e's low-rank factors."""
        a_weight, b_weight = cast(nn.Linear, self.lora_A[ADAPTER]).weight, cast(nn.Linear, self.lora_B[ADAPTER]).weight
        a = a_weight.to(dtype).reshape(self.num_experts, self.rank, -1)
        b = b_weight.to(dtype).reshape(-1, self.rank, self.num_experts).permute(2, 0, 1)
        return a, b

    def chain(self) -> dict[str, LoraParam]:
        """The wrappers around one experts module, by the name of the weight each adapts (this one outermost)."""
        out: dict[str, LoraParam] = {}
        module: nn.Module = self
        while isinstance(module, LoraParam):
            out[module.parameter_name] = module
            module = module.base_layer
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        experts, path = self._target()
        chain = self.chain()
        if lowrank_ok(experts, chain):
            return lowrank_experts(experts, chain, *args, **kwargs)
        return torch.func.functional_call(self.base_layer, {path: self.weight()}, args, kwargs, strict=False)


LOWRANK_WEIGHTS = ("gate_up_proj", "down_proj")


def lowrank_ok(experts: nn.Module, chain: dict[str, LoraParam]) -> bool:
    """Whether `lowrank_experts` computes what `experts` computes: transformers' gated experts, weights [E, out,
    in] (not transposed), gate and up concatenated, no bias, no norm after the experts, and only their two
    weights adapted. A flag a transformers version does not set (5.17 has no `has_post_expert_norm`) reads as
    transformers' default."""
    weights = [getattr(experts, n, None) for n in LOWRANK_WEIGHTS]
    return (all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights) and set(chain) <= set(LOWRANK_WEIGHTS)
            and getattr(experts, "has_gate", True) and getattr(experts, "is_concatenated", True)
            and not getattr(experts, "is_transposed", False) and not getattr(experts, "has_bias", False)
            and not getattr(experts, "has_post_expert_norm", False) and callable(getattr(experts, "_apply_gate", None)))


class _Groups:
    """The expert groups of rows sorted by expert: their ends (int32, for the GPU's grouped GEMM) and, on first
    use, their sizes on the host (for the loop over the experts)."""

    def __init__(self, sizes: torch.Tensor) -> None:
        self.sizes = sizes
        self.offsets = torch.cumsum(sizes, dim=0, dtype=torch.int32)
        self._counts: list[int] | None = None

    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = [int(n) for n in self.sizes.tolist()]
        return self._counts


def _grouped(x: torch.Tensor, weight: torch.Tensor, groups: _Groups) -> torch.Tensor:
    """x [S, in] sorted by expert, times weight [E, out, in] transposed per expert group -> [S, out]: one grouped
    GEMM on a GPU in bf16 where every row is a multiple of 16 bytes (what `grouped_mm` takes), else a loop over the
    experts (the CPU; a rank that is not a multiple of 8)."""
    row_bytes = (x.shape[-1] * x.element_size(), weight.shape[1] * x.element_size())
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm") and all(b % 16 == 0 for b in row_bytes):
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=groups.offsets)
    parts = [chunk @ weight[e].t() for e, chunk in enumerate(x.split(groups.counts())) if chunk.shape[0]]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


def lowrank_experts(experts: nn.Module, chain: dict[str, LoraParam], hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The adapted experts' output [tokens, hidden] for the routing `top_k_index`/`top_k_weights` [tokens, k]."""
    count: int = experts.num_experts  # type: ignore[assignment]
    top_k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    groups = _Groups(torch.bincount(ids, minlength=count))

    def project(x: torch.Tensor, name: str) -> torch.Tensor:
        y = _grouped(x, getattr(experts, name), groups)
        wrapper = chain.get(name)
        if wrapper is None:
            return y
        a, b = wrapper.factors(x.dtype)
        return y + wrapper.scaling * _grouped(_grouped(x, a, groups), b.contiguous(), groups)

    rows = hidden_states[order // top_k]
    out = project(experts._apply_gate(project(rows, "gate_up_proj")), "down_proj")  # type: ignore[operator]
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    summed = out[back].view(-1, top_k, out.shape[-1]).sum(dim=1)
    return summed.to(hidden_states.dtype)


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
