"""The one workload every system runs (one definition, read by the runner and by every peer script).

Llama-shaped model with random initialisation, bf16 compute, fp32 master weights and fp32 AdamW state,
sequence 2048, 65,536 tokens (32 sequences) per optimizer step, microbatches of 4 sequences where a
system takes a microbatch size, random token ids drawn from a seeded generator (no downloads).
With `--lora R`: LoRA adapters of rank R on every linear of every decoder layer (alpha 2R unless
`--lora-alpha`, no dropout), the base frozen, AdamW over the adapters only.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

SEQ_LEN = 2048
BATCH_TOKENS = 65_536
MICROBATCH_SIZE = 4
LR = 1e-4
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
INIT_STD = 0.02  # transformers' default `initializer_range`
SEED = 0
# --lora: every linear of a decoder layer, by peft's module names (tinypipe's `--lora-targets all`)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_DROPOUT = 0.0
LORA_ALPHA_PER_RANK = 2.0  # --lora-alpha's default: 2 x rank


@dataclass(frozen=True)
class Lora:
    """LoRA adapters of rank `rank` on LORA_TARGETS in every decoder layer, updates scaled by alpha / rank,
    dropout LORA_DROPOUT; the base frozen."""

    rank: int
    alpha: float

    def argv(self) -> list[str]:
        return ["--lora", str(self.rank), "--lora-alpha", f"{self.alpha:g}"]

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": LORA_DROPOUT, "targets": list(LORA_TARGETS)}


@dataclass(frozen=True)
class Workload:
    """What one optimizer step is, for every system alike; `sequences` is over all GPUs together."""

    seq_len: int = SEQ_LEN
    batch_tokens: int = BATCH_TOKENS
    microbatch_size: int = MICROBATCH_SIZE
    seed: int = SEED
    lora: Lora | None = None  # None: every parameter trains

    @property
    def sequences(self) -> int:
        return self.batch_tokens // self.seq_len

    def per_rank(self, world: int) -> int:
        """Sequences each of `world` data-parallel ranks trains on per step."""
        return self.sequences // world

    def passes(self, world: int) -> int:
        """Microbatches (forward + backward passes) per rank per step, `microbatch_size` sequences each."""
        return self.per_rank(world) // self.microbatch_size

    def problem(self, world: int) -> str | None:
        """Why this workload cannot be split over `world` ranks, or None."""
        if self.seq_len < 1 or self.microbatch_size < 1 or self.batch_tokens < 1:
            return "--seq-len, --microbatch-size and --batch-tokens must be >= 1"
        if self.lora is not None and self.lora.rank < 1:
            return f"--lora: the rank must be >= 1, got {self.lora.rank}"
        if self.lora is not None and not self.lora.alpha > 0:
            return f"--lora-alpha: must be > 0, got {self.lora.alpha:g}"
        if self.batch_tokens % self.seq_len:
            return f"--batch-tokens {self.batch_tokens} is not a multiple of --seq-len {self.seq_len}"
        unit = self.microbatch_size * world
        if self.sequences % unit:
            return (f"{self.sequences} sequences per step do not split into microbatches of {self.microbatch_size} "
                    f"on {world} GPU(s) (need a multiple of {unit})")
        return None

    def argv(self) -> list[str]:
        return ["--seq-len", str(self.seq_len), "--batch-tokens", str(self.batch_tokens),
                "--microbatch-size", str(self.microbatch_size), "--seed", str(self.seed),
                *(self.lora.argv() if self.lora else [])]


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help=f"tokens per sequence (default {SEQ_LEN})")
    p.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS,
                   help=f"tokens per optimizer step over all GPUs (default {BATCH_TOKENS:,})")
    p.add_argument("--microbatch-size", type=int, default=MICROBATCH_SIZE,
                   help=f"sequences per microbatch where a system takes one (default {MICROBATCH_SIZE})")
    p.add_argument("--seed", type=int, default=SEED, help=f"initialisation and data seed (default {SEED})")
    p.add_argument("--lora", type=int, default=None, metavar="R",
                   help=f"train LoRA adapters of rank R on {', '.join(LORA_TARGETS)} of every decoder layer, the "
                        "base frozen (default: every parameter trains)")
    p.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                   help=f"LoRA updates scale by A / R (default {LORA_ALPHA_PER_RANK:g} x R)")


def workload_of(args: argparse.Namespace) -> Workload:
    """The workload the options ask for; `--lora-alpha` without `--lora` is ignored here (the runner refuses it)."""
    lora = None
    if args.lora is not None:
        alpha = LORA_ALPHA_PER_RANK * args.lora if args.lora_alpha is None else args.lora_alpha
        lora = Lora(rank=args.lora, alpha=float(alpha))
    return Workload(seq_len=args.seq_len, batch_tokens=args.batch_tokens, microbatch_size=args.microbatch_size,
                    seed=args.seed, lora=lora)
