"""LoraSpec: low-rank adapters on a frozen base (rank, alpha, dropout, the linears they wrap), as peft spells them.

The defaults are peft's `LoraConfig`'s: r 8, lora_alpha 8, lora_dropout 0, and the targets peft picks for
the model's family when none are given (`q_proj` and `v_proj` for Llama, Mistral and Qwen; GPT-2's
fused `c_attn`, GPT-NeoX's `query_key_value`: the roles q and v). Targets are roles, the same for every
family; `describe.model.LayerSpec.linears` says which module of a block plays each role.

`nf4`: the frozen base's block linears are held on the host as 4-bit NormalFloat (QLoRA's NF4, blocks of 64 with
an fp32 absmax each, through bitsandbytes: `backends/host/nf4.py`) and dequantised on the GPU at each upload
(`--load-in-4bit`, the name TRL and Unsloth give it); embeddings, norms and the head stay in the compute dtype.
The adapters are the same either way: `adapter_text` names them without the base.
"""

from __future__ import annotations

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
    nf4: bool = False  # the base's block linears held as NF4 on the host (module docstring)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InputError(f"lora: rank must be an integer >= 1; got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise InputError(f"lora: alpha must be a number > 0; got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise InputError(f"lora: dropout must be a probability in [0, 1); got {self.dropout!r}")
        if not isinstance(self.nf4, bool):
            raise InputError(f"lora: nf4 must be true or false; got {self.nf4!r}")
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

    def adapter_text(self) -> str:
        """The adapters alone: `r16,a32,d0.05,q+k+v` (what a profile trace measured, whatever the base's form)."""
        return f"r{self.rank},a{self.alpha:g},d{self.dropout:g}," + "+".join(self.targets)

    def text(self) -> str:
        """One token for a schedule's header: `r16,a32,d0.05,q+k+v`, and `,nf4` for a 4-bit base; `parse` reads
        it back."""
        return self.adapter_text() + (",nf4" if self.nf4 else "")

    @classmethod
    def parse(cls, text: str, where: str = "lora") -> LoraSpec:
        try:
            r, a, d, t, *base = text.split(",")
            if r[0] != "r" or a[0] != "a" or d[0] != "d" or base not in ([], ["nf4"]):
                raise ValueError(text)
            return cls(rank=int(r[1:]), alpha=float(a[1:]), dropout=float(d[1:]), targets=tuple(t.split("+")),
                       nf4=bool(base))
        except (ValueError, IndexError):
            raise InputError(f"{where}: expected r<rank>,a<alpha>,d<dropout>,<targets joined by +>[,nf4]; "
                             f"got {text!r}") from None

    def to_json(self) -> dict[str, Any]:
        """The fields by name; `nf4` only when set (a bf16 base's record reads as it always has)."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                **({"nf4": True} if self.nf4 else {})}

    @classmethod
    def from_json(cls, obj: Any, where: str = "lora") -> LoraSpec:
        f = Fields(obj, where)
        unknown = sorted(set(f.obj) - {"rank", "alpha", "dropout", "targets", "nf4"})
        if unknown:
            raise InputError(f"{where}: unknown field {unknown[0]!r}; known fields: alpha, dropout, nf4, rank, "
                             "targets")
        targets = f.list("targets", list(DEFAULT_TARGETS), nonempty=True)
        if any(not isinstance(t, str) for t in targets):
            raise InputError(f"{where}: targets: expected a list of names")
        return cls(rank=f.int("rank", DEFAULT_RANK), alpha=f.float("alpha", DEFAULT_ALPHA),
                   dropout=f.float("dropout", 0.0), targets=tuple(targets), nf4=f.bool("nf4", False))


def lora_text(lora: LoraSpec | None) -> str:
    """`lora.adapter_text()`, or "" for full training: how a profile trace names the adapters it measured (the
    base's form changes its uploads, not its FWD / BWD)."""
    return lora.adapter_text() if lora is not None else ""


def parse_targets(text: str, where: str = "--lora-targets") -> tuple[str, ...]:
    """`q,k,v,o,gate,up,down` (or `all`) as roles; an unknown name is a one-line InputError."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if names == ("all",):
        return ROLES
    bad = [t for t in names if t not in ROLES]
    if bad or not names:
        raise InputError(f"{where}: expected linears among {','.join(ROLES)} (or all); got {text!r}")
    return names


def lora_from_flags(rank: int | None, alpha: float | None = None, dropout: float | None = None,
                    targets: str | None = None, load_in_4bit: bool = False) -> LoraSpec | None:
    """The LoraSpec `--lora R` and its flags ask for (None without --lora; peft's defaults for the flags not
    given); a flag given without --lora is a one-line InputError."""
    if rank is None:
        extra = [f"--lora-{f}" for f, v in (("alpha", alpha), ("dropout", dropout), ("targets", targets))
                 if v is not None] + (["--load-in-4bit"] if load_in_4bit else [])
        if extra:
            raise InputError(f"{extra[0]} needs --lora R")
        return None
    return LoraSpec(rank=rank, alpha=DEFAULT_ALPHA if alpha is None else alpha,
                    dropout=0.0 if dropout is None else dropout,
                    targets=DEFAULT_TARGETS if targets is None else parse_targets(targets), nf4=load_in_4bit)
