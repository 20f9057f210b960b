"""torch optimizers of one layer's parameters: torch's AdamW, or AdamW with the host's low-precision moments."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from tinypipe.policy.modes import OptimizerState


def layer_adamw(params: Iterable[nn.Parameter], *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                eps: float = 1e-8, weight_decay: float = 0.0, decay: Sequence[bool] | None = None,
                optimizer_state: OptimizerState = OptimizerState.FP32) -> torch.optim.Optimizer:
    """The optimizer of one layer's parameters: torch's AdamW, fused when they are all on the CPU
    in fp32 (the backend's host optimizer is PyTorch's fused AdamW, per layer: docs/architecture.md). `decay`:
    per parameter, whether weight decay applies (None: to all); the others form a group without it. With
    low-precision moments (`optimizer_state`), `LowPrecisionAdamW` over the same groups."""
    params = list(params)
    fused = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)
    groups: list[dict[str, Any]] = [{"params": params}]
    if decay is not None and weight_decay and not all(decay):
        groups = [g for g in ({"params": [p for p, d in zip(params, decay) if d]},
                              {"params": [p for p, d in zip(params, decay) if not d], "weight_decay": 0.0})
                  if g["params"]]
    if not OptimizerState(optimizer_state).exact:
        return LowPrecisionAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 optimizer_state=OptimizerState(optimizer_state))
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=fused or None)


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW on fp32 parameters with moments held as bf16 or 8-bit (`moments`): each step splits a parameter
    into the compact layout's planes, runs the host's chunked step on them and joins them back, so a plain
    single-process training takes the very same arithmetic as the pipeline's host state."""

    def __init__(self, groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, optimizer_state: OptimizerState) -> None:
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.optimizer_state = optimizer_state

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        from . import moments, planes

        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st.update(moments.zero_state(p.numel(), self.optimizer_state))
                st["step"] += 1
                hi, lo = torch.empty(p.numel(), dtype=torch.int16), torch.empty(p.numel(), dtype=torch.int16)
                planes.split(p.detach().reshape(-1), hi, lo)
                moments.lowp_adamw_step(hi, lo, p.grad.reshape(-1), {k: v for k, v in st.items() if k != "step"},
                                        state=self.optimizer_state, step=int(st["step"].item()), lr=group["lr"],
                                        beta1=beta1, beta2=beta2, eps=group["eps"],
                                        weight_decay=group["weight_decay"])
                planes.join(hi, lo, p.detach().view(-1))
