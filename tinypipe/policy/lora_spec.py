"""LoraSpec: low-rank adapters on a frozen base (rank, alpha, dropout, the linears they wrap), as peft spells them.

The defaults are peft's `LoraConfig`'s: r 8, lora_alpha 8, lora_dropout 0, and the targets peft picks for
the model's family when none are given (`q_proj` and `v_proj` for Llama, Mistral and Qwen; GPT-2's
fused `c_attn`, GPT-NeoX's `query_key_value`: the roles q and v). Targets are roles, the same for every
family; `describe.model.LayerSpec.linears` says which module of a block plays each role.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.common.jsonio import Fields

ROLES = ("q", "k", "v", "o", "gate", "up", "down")  # the linears of a decoder block a LoRA may wrap
DEFAULT_TARGETS = ("q", "v")  # peft's default for every family tinypipe reads
DEFAULT_RANK = 8
DEFAULT_ALPHA = 8.0
# peft (`autocast_adapter_dtype=True`, its default) keeps adapters in fp32 under a bf16 base: weights,
# their gradients and AdamW's two moments, 4 bytes each, on the GPU that owns the layer
ADAPTER_STATE_BYTES_PER_PARAM = 16
ADAPTER_WEIGHT_BYTES_PER_PARAM = 4


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """LoRA adapters: W x + (alpha / rank) B A dropout(x) on each targeted linear; the base is frozen."""

    rank: int = DEFAULT_RANK
    alpha: float = DEFAULT_ALPHA
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InputError(f"lora: rank must be an integer >= 1; got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise InputError(f"lora: alpha must be a number > 0; got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise InputError(f"lora: dropout must be a probability in [0, 1); got {self.dropout!r}")
        targets = tuple(self.targets)
        bad = [t for t in targets if t not in ROLES]
        if bad or not targets:
            raise InputError(f"lora: targets: {bad[0]!r} is not a linear of a block; expected some of "
                             f"{','.join(ROLES)}" if bad else "lora: targets: name at least one linear")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))
        object.__setattr__(self, "targets", tuple(r for r in ROLES if r in targets))  # one order, no repeats

    @property
    def scaling(self) -> float:
        """peft's `lora_alpha / r` (rsLoRA off)."""
        return self.alpha / self.rank

    def text(self) -> str:
        """One token for a schedule's header: `r16,a32,d0.05,q+k+v`; `parse` reads it back."""
        return f"r{self.rank},a{self.alpha:g},d{self.dropout:g}," + "+".join(self.targets)

    @classmethod
    def parse(cls, text: str, where: str = "lora") -> LoraSpec:
        try:
            r, a, d, t = text.split(",")
            if r[0] != "r" or a[0] != "a" or d[0] != "d":
                raise ValueError(text)
            return cls(rank=int(r[1:]), alpha=float(a[1:]), dropout=float(d[1:]), targets=tuple(t.split("+")))
        except (ValueError, IndexError):
            raise InputError(f"{where}: expected r<rank>,a<alpha>,d<dropout>,<targets joined by +>; "
                             f"got {text!r}") from None

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}

    @classmethod
    def from_json(cls, obj: Any, where: str = "lora") -> LoraSpec:
        f = Fields(obj, where)
        unknown = sorted(set(f.obj) - {"rank", "alpha", "dropout", "targets"})
        if unknown:
            raise InputError(f"{where}: unknown field {unknown[0]!r}; known fields: alpha, dropout, rank, targets")
        targets = f.list("targets", list(DEFAULT_TARGETS), nonempty=True)
        if any(not isinstance(t, str) for t in targets):
            raise InputError(f"{where}: targets: expected a list of names")
        return cls(rank=f.int("rank", DEFAULT_RANK), alpha=f.float("alpha", DEFAULT_ALPHA),
                   dropout=f.float("dropout", 0.0), targets=tuple(targets))


def lora_text(lora: LoraSpec | None) -> str:
    """`lora.text()`, or "" for full training: how a profile trace names the adapters it measured."""
    return lora.text() if lora is not None else ""


def parse_targets(text: str, where: str = "--lora-targets") -> tuple[str, ...]:
    """`q,k,v,o,gate,up,down` (or `all`) as roles; an unknown name is a one-line InputError."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if names == ("all",):
        return ROLES
    bad = [t for t in names if t not in ROLES]
    if bad or not names:
        raise InputError(f"{where}: expected linears among {','.join(ROLES)} (or all); got {text!r}")
    return names


def add_lora_arguments(p: argparse.ArgumentParser, *,
                       what: str = "train LoRA adapters of rank R on a frozen base (default: every parameter)") -> None:
    """`--lora R [--lora-alpha A] [--lora-dropout P] [--lora-targets q,k,v,o,gate,up,down]` (peft's defaults)."""
    p.add_argument("--lora", type=int, default=None, metavar="R", help=what)
    p.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                   help=f"LoRA scaling numerator: updates scale by A / R (default {DEFAULT_ALPHA:g}, peft's)")
    p.add_argument("--lora-dropout", type=float, default=None, metavar="P", help="dropout on the adapters' input "
                   "(default 0)")
    p.add_argument("--lora-targets", default=None, metavar="LIST",
                   help=f"linears to adapt among {','.join(ROLES)}, or all (default {','.join(DEFAULT_TARGETS)}, "
                        "peft's)")


def lora_from_args(args: object) -> LoraSpec | None:
    """The LoraSpec `add_lora_arguments`' flags ask for (None without --lora); a flag without --lora is an error."""
    rank = getattr(args, "lora", None)
    extra = [f for f in ("lora_alpha", "lora_dropout", "lora_targets") if getattr(args, f, None) is not None]
    if rank is None:
        if extra:
            raise InputError(f"--{extra[0].replace('_', '-')} needs --lora R")
        return None
    alpha, dropout, targets = (getattr(args, f, None) for f in ("lora_alpha", "lora_dropout", "lora_targets"))
    return LoraSpec(rank=rank, alpha=DEFAULT_ALPHA if alpha is None else alpha,
                    dropout=0.0 if dropout is None else dropout,
                    targets=DEFAULT_TARGETS if targets is None else parse_targets(targets))
