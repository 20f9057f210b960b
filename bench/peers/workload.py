"""The one workload every system runs (one definition, read by the runner and by every peer script).

Llama-shaped model with random initialisation, bf16 compute, fp32 master weights and fp32 AdamW state,
sequence 2048, 65,536 tokens (32 sequences) per optimizer step, microbatches of 4 sequences where a
system takes a microbatch size, random token ids drawn from a seeded generator (no downloads).
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


@dataclass(frozen=True)
class Workload:
    """What one optimizer step is, for every system alike; `sequences` is over all GPUs together."""

    seq_len: int = SEQ_LEN
    batch_tokens: int = BATCH_TOKENS
    microbatch_size: int = MICROBATCH_SIZE
    seed: int = SEED

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
        if self.batch_tokens % self.seq_len:
            return f"--batch-tokens {self.batch_tokens} is not a multiple of --seq-len {self.seq_len}"
        unit = self.microbatch_size * world
        if self.sequences % unit:
            return (f"{self.sequences} sequences per step do not split into microbatches of {self.microbatch_size} "
                    f"on {world} GPU(s) (need a multiple of {unit})")
        return None

    def argv(self) -> list[str]:
        return ["--seq-len", str(self.seq_len), "--batch-tokens", str(self.batch_tokens),
                "--microbatch-size", str(self.microbatch_size), "--seed", str(self.seed)]


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help=f"tokens per sequence (default {SEQ_LEN})")
    p.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS,
                   help=f"tokens per optimizer step over all GPUs (default {BATCH_TOKENS:,})")
    p.add_argument("--microbatch-size", type=int, default=MICROBATCH_SIZE,
                   help=f"sequences per microbatch where a system takes one (default {MICROBATCH_SIZE})")
    p.add_argument("--seed", type=int, default=SEED, help=f"initialisation and data seed (default {SEED})")


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(seq_len=args.seq_len, batch_tokens=args.batch_tokens, microbatch_size=args.microbatch_size,
                    seed=args.seed)
