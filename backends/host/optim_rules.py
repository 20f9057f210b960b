"""The optimizer's rules beside AdamW itself: the learning rate per step, which parameters decay, the lr default.

`LRSchedule.lr(step)` is the learning rate of optimizer step `step` (0-based). The schedules are
transformers' `SchedulerType` names (`TrainingArguments.lr_scheduler_type`) that are a function of the
step, each a pure function below with the parameters `lr_scheduler_kwargs` gives it there
(`SCHEDULE_PARAMS`), equal to transformers' schedule driven by `torch.optim.lr_scheduler.LambdaLR`
(transformers/optimization.py): the first step of a warmup runs at lr 0, as there. One difference:
tinypipe's `constant` warms up when asked (transformers' `constant` ignores the warmup steps; with none
the two are the same, and `constant_with_warmup` is the same function). `reduce_lr_on_plateau` and
`greedy` follow a metric, not the step, and are refused.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tinypipe.common.errors import InputError

LR_SMALL, LR_SMALL_PARAMS, LR_FLOOR = 3e-3, 10_000_000, 3e-5
SHAPES = ("linear", "cosine", "1-sqrt")  # warmup_stable_decay's warmup_type and decay_type
# each schedule's parameters (transformers' lr_scheduler_kwargs) and their defaults; None: none (required or derived)
SCHEDULE_PARAMS: dict[str, dict[str, Any]] = {
    "constant": {}, "constant_with_warmup": {}, "linear": {},
    "cosine": {"num_cycles": 0.5},
    "cosine_with_restarts": {"num_cycles": 1},
    "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "inverse_sqrt": {"timescale": None},
    "cosine_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None},
    "cosine_warmup_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None, "warmup_lr_rate": None},
    "warmup_stable_decay": {"num_decay_steps": None, "num_stable_steps": None, "warmup_type": "linear",
                            "decay_type": "cosine", "min_lr_ratio": 0.0, "num_cycles": 0.5},
}
SCHEDULES = tuple(SCHEDULE_PARAMS)
NOT_OF_THE_STEP = {"reduce_lr_on_plateau": "lowers the lr when a metric stops improving",
                   "greedy": "adapts the lr to the training loss"}
INT_PARAMS = ("timescale", "num_decay_steps", "num_stable_steps")


# --- each schedule: the multiplier of the peak lr at optimizer step t (0-based), w warmup steps of n ----------

def warmup(t: int, w: int) -> float:
    """Linear warmup from 0: t / w."""
    return t / max(1, w)


def _progress(t: int, w: int, n: int) -> float:
    return (t - w) / max(1, n - w)


def constant(t: int, w: int, n: int) -> float:
    return warmup(t, w) if t < w else 1.0


def linear(t: int, w: int, n: int) -> float:
    """To 0 at step n: (n - t) / (n - w)."""
    return warmup(t, w) if t < w else max(0.0, (n - t) / max(1, n - w))


def cosine(t: int, w: int, n: int, *, num_cycles: float = 0.5, min_lr_rate: float = 0.0) -> float:
    """(1 + cos(2 pi c p)) / 2 of the progress p after the warmup (c = 0.5: one half-cycle to 0), raised to
    min_lr_rate: f (1 - r) + r."""
    if t < w:
        return warmup(t, w)
    f = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * _progress(t, w, n)))
    return max(0.0, f * (1.0 - min_lr_rate) + min_lr_rate)


def cosine_with_restarts(t: int, w: int, n: int, *, num_cycles: float = 1) -> float:
    """A half-cosine to 0 repeated num_cycles times (hard restarts to the peak); 0 from step n on."""
    if t < w:
        return warmup(t, w)
    p = _progress(t, w, n)
    return 0.0 if p >= 1.0 else max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * p) % 1.0))))


def polynomial(t: int, w: int, n: int, *, lr: float, lr_end: float = 1e-7, power: float = 1.0) -> float:
    """From the peak lr to lr_end as (1 - p)^power, then lr_end."""
    if t < w:
        return warmup(t, w)
    if t > n:
        return lr_end / lr
    return ((lr - lr_end) * math.pow(1.0 - (t - w) / max(1, n - w), power) + lr_end) / lr


def inverse_sqrt(t: int, w: int, n: int, *, timescale: int | None = None) -> float:
    """1 / sqrt((t - w + s) / s), s = timescale (default: the warmup steps, else 10,000)."""
    if t < w:
        return warmup(t, w)
    s = timescale or w or 10_000
    return 1.0 / math.sqrt((t - w + s) / s)


def cosine_warmup_with_min_lr(t: int, w: int, n: int, *, num_cycles: float = 0.5, min_lr_rate: float = 0.0,
                              warmup_lr_rate: float | None = None) -> float:
    """`cosine` with min_lr_rate, one step ahead: the warmup starts at 1 / w (or warmup_lr_rate) and reaches the
    peak at its last step; the cosine's progress is (t - w + 1) / (n - w)."""
    if t < w:
        if warmup_lr_rate is None:
            return (t + 1) / max(1, w)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * t / max(1, w - 1)
    f = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * (t - w + 1) / max(1, n - w)))
    return max(0.0, f * (1.0 - min_lr_rate) + min_lr_rate)


def _shape(kind: str, p: float, num_cycles: float, *, rising: bool) -> float:
    if kind == "linear":
        return p if rising else 1.0 - p
    if kind == "cosine":
        return 0.5 * (1.0 - math.cos(math.pi * p)) if rising else 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * p))
    return 1.0 - math.sqrt(1.0 - p) if rising else 1.0 - math.sqrt(p)  # 1-sqrt


def warmup_stable_decay(t: int, w: int, n: int, *, num_decay_steps: int, num_stable_steps: int | None = None,
                        warmup_type: str = "linear", decay_type: str = "cosine", min_lr_ratio: float = 0.0,
                        num_cycles: float = 0.5) -> float:
    """Warmup from min_lr_ratio (warmup_type), the peak for num_stable_steps (default: the steps the warmup and
    the decay leave of n), then num_decay_steps down to min_lr_ratio (decay_type), then min_lr_ratio."""
    stable = n - w - num_decay_steps if num_stable_steps is None else num_stable_steps
    r = min_lr_ratio
    if t < w:
        return max(0.0, _shape(warmup_type, t / max(1, w), num_cycles, rising=True) * (1.0 - r) + r)
    if t < w + stable:
        return 1.0
    if t < w + stable + num_decay_steps:
        p = (t - w - stable) / max(1, num_decay_steps)
        return max(0.0, _shape(decay_type, p, num_cycles, rising=False) * (1.0 - r) + r)
    return r


FACTORS: dict[str, Callable[..., float]] = {
    "constant": constant, "constant_with_warmup": constant, "linear": linear, "cosine": cosine,
    "cosine_with_restarts": cosine_with_restarts, "polynomial": polynomial, "inverse_sqrt": inverse_sqrt,
    "cosine_with_min_lr": cosine, "cosine_warmup_with_min_lr": cosine_warmup_with_min_lr,
    "warmup_stable_decay": warmup_stable_decay,
}


def schedule_params(kind: str, given: Mapping[str, Any] | None = None) -> tuple[tuple[str, Any], ...]:
    """The parameters `given` (--lr-schedule-kwargs) for schedule `kind` (--lr-schedule), checked, as sorted
    (name, value) pairs; InputError on an unknown schedule or parameter, or a value of the wrong kind."""
    if kind in NOT_OF_THE_STEP:
        raise InputError(f"--lr-schedule {kind}: {NOT_OF_THE_STEP[kind]}, not a function of the step, which "
                         f"tinypipe's schedules are; one of {', '.join(SCHEDULES)}")
    if kind not in SCHEDULE_PARAMS:
        raise InputError(f"--lr-schedule {kind}: unknown; one of {', '.join(SCHEDULES)} (transformers' names)")
    known, given = SCHEDULE_PARAMS[kind], dict(given or {})
    for key, value in sorted(given.items()):
        if key not in known:
            takes = ", ".join(known) or "none"
            raise InputError(f"--lr-schedule-kwargs: {kind} takes no {key!r} (its parameters: {takes})")
        if key in ("warmup_type", "decay_type"):
            if value not in SHAPES:
                raise InputError(f"--lr-schedule-kwargs: {key} must be one of {', '.join(SHAPES)}, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise InputError(f"--lr-schedule-kwargs: {key} must be a number >= 0, got {value!r}")
        elif key in INT_PARAMS and (value != int(value) or (key == "timescale" and value < 1)):
            raise InputError(f"--lr-schedule-kwargs: {key} must be a whole number of steps"
                             f"{' >= 1' if key == 'timescale' else ''}, got {value!r}")
    if "min_lr" in known and ("min_lr" in given) == ("min_lr_rate" in given):
        raise InputError(f"--lr-schedule {kind}: give one of min_lr and min_lr_rate in --lr-schedule-kwargs, "
                         "e.g. '{\"min_lr_rate\": 0.1}'")
    if kind == "warmup_stable_decay" and "num_decay_steps" not in given:
        raise InputError("--lr-schedule warmup_stable_decay: give num_decay_steps in --lr-schedule-kwargs, "
                         "e.g. '{\"num_decay_steps\": 100}'")
    return tuple((k, int(v) if k in INT_PARAMS else v) for k, v in sorted(given.items()))


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate per optimizer step: `warmup_steps` rising from 0, then `kind` over the rest of
    `total_steps`, with `params` (`schedule_params`: the schedule's own parameters)."""

    base_lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in FACTORS:
            raise ValueError(f"lr schedule {self.kind!r}: one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"warmup_steps {self.warmup_steps} and total_steps {self.total_steps}: need >= 0, >= 1")
        p = dict(self.params)
        if self.kind == "polynomial" and not self.base_lr > p.get("lr_end", 1e-7):
            raise InputError(f"--lr-schedule polynomial: lr_end {p.get('lr_end', 1e-7):g} must be below the peak lr "
                             f"{self.base_lr:g}")
        if self.kind == "warmup_stable_decay" and "num_stable_steps" not in p:
            left = self.total_steps - self.warmup_steps - int(p["num_decay_steps"])
            if left < 0:
                raise InputError(f"--lr-schedule warmup_stable_decay: {self.warmup_steps} warmup and "
                                 f"{p['num_decay_steps']} decay steps are more than the run's {self.total_steps}")

    def factor(self, step: int) -> float:
        """The multiplier of `base_lr` at optimizer step `step` (0-based)."""
        p = dict(self.params)
        if "min_lr" in p:
            p["min_lr_rate"] = p.pop("min_lr") / self.base_lr
        if self.kind == "polynomial":
            p["lr"] = self.base_lr
        return FACTORS[self.kind](step, self.warmup_steps, self.total_steps, **p)

    def lr(self, step: int) -> float:
        return self.base_lr * self.factor(step)

    def text(self) -> str:
        """The schedule as the run's header names it: kind and parameters."""
        given = ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in self.params)
        return self.kind + (f" ({given})" if given else "")


def lr_schedule(base_lr: float, kind: str, kwargs: Mapping[str, Any] | None, warm: int, total: int) -> LRSchedule:
    """The schedule --lr-schedule KIND --lr-schedule-kwargs JSON asks for, after `warm` warmup steps of `total`
    (InputError on a mistake)."""
    return LRSchedule(base_lr, kind, warm, total, schedule_params(kind, kwargs))


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
