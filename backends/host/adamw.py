"""The host optimizer's settings: AdamW's hyperparameters, the learning rate per step, which parameters decay."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .optim_rules import LRSchedule, decays


@dataclass(frozen=True)
class AdamWConfig:
    """The optimizer's settings. The optimizer itself is `torch_adamw.layer_adamw` (torch's AdamW,
    fused on CPU fp32), the same one the single-process reference trains with.

    `schedule`: the learning rate per optimizer step (`optim_rules.LRSchedule`; None: `lr` always).
    `decay_exempt`: weight decay only where `optim_rules.decays` says (not norms, biases, embeddings).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: LRSchedule | None = None
    decay_exempt: bool = False

    def make(self, params: list[torch.Tensor], names: Sequence[str] | None = None) -> torch.optim.Optimizer:
        from .torch_adamw import layer_adamw

        decay = None if not self.decay_exempt or names is None else [decays(n, p.dim()) for n, p in zip(names, params)]
        return layer_adamw(params, lr=self.lr, betas=self.betas, eps=self.eps,  # type: ignore[arg-type]
                           weight_decay=self.weight_decay, decay=decay)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        return self.lr if self.schedule is None else self.schedule.lr(step)
