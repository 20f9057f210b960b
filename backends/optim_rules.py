"""The optimizer's rules beside AdamW itself: the learning rate per step, which parameters decay, the lr default.

`LRSchedule.lr(step)` is the learning rate of optimizer step `step` (0-based), the same numbers as
transformers' `get_constant_schedule_with_warmup`, `get_linear_schedule_with_warmup` and
`get_cosine_schedule_with_warmup` (one half-cycle) driven by `torch.optim.lr_scheduler.LambdaLR`:
the first step of a warmup runs at lr 0, as there.

`decays(name, ndim)`: weight decay applies to matrices, not to norms, biases or the token
embedding (nor to a head tied to it, whose matrix is the embedding's) -- the parameters
transformers' Trainer leaves undecayed (norms, biases), plus the embedding, as in GPT-style
recipes, since decaying rows of tokens that a step never sees only shrinks them.

`default_lr(params)`: the learning rate `tinypipe run` uses when none is given, from the model's
parameter count -- 3e-3 up to 10 M parameters (the tiny test models), then falling as 1/sqrt of
the size to 3e-5 at 100 G: 3e-3 x sqrt(1e7 / params), clamped to [3e-5, 3e-3]. At 8 B parameters
that is 1.1e-4, in the range the published full fine-tunes of Llama-3-8B use (1e-5..2e-4); at
0.5 B 4.2e-4; the rule is a starting point for full fine-tuning with AdamW, not a tuned value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("constant", "linear", "cosine")
LR_SMALL, LR_SMALL_PARAMS, LR_FLOOR = 3e-3, 10_000_000, 3e-5


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate per optimizer step: `warmup_steps` rising linearly from 0, then `kind` over the
    rest of `total_steps` (constant, linear to 0, or a cosine half-cycle to 0)."""

    base_lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"lr schedule {self.kind!r}: one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"warmup_steps {self.warmup_steps} and total_steps {self.total_steps}: need >= 0, >= 1")

    def factor(self, step: int) -> float:
        """The multiplier of `base_lr` at optimizer step `step` (0-based)."""
        w = self.warmup_steps
        if step < w:
            return step / max(1, w)
        if self.kind == "constant":
            return 1.0
        if self.kind == "linear":
            return max(0.0, (self.total_steps - step) / max(1, self.total_steps - w))
        progress = (step - w) / max(1, self.total_steps - w)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    def lr(self, step: int) -> float:
        return self.base_lr * self.factor(step)


def warmup_steps(total_steps: int, *, steps: int | None, ratio: float | None) -> int:
    """--warmup-steps, else --warmup-ratio of the run's steps (rounded up, as transformers' TrainingArguments)."""
    if steps is not None:
        return steps
    return math.ceil(total_steps * ratio) if ratio else 0


def decays(name: str, ndim: int) -> bool:
    """Whether weight decay applies to the parameter `name` (its name in its pipeline layer) of `ndim` dims."""
    return ndim >= 2 and not name.startswith("embed_tokens")


def default_lr(params: int) -> float:
    """The learning rate for a model of `params` parameters when --lr is not given (see the module docstring)."""
    if params <= LR_SMALL_PARAMS:
        return LR_SMALL
    return max(LR_FLOOR, LR_SMALL * math.sqrt(LR_SMALL_PARAMS / params))
